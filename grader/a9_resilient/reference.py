"""The grader's own answers for assignment 9, written with loops, not with the library. Instructors only.

* ``outer_rounds`` / ``schedule_table``: the Nesterov outer step and the fragment rule, from the
  formulas of lecture 11;
* ``simulate``: Streaming DiLoCo in one process -- p workers' parameters side by side, every inner
  step, every launch (the pseudo-gradient averaged over the workers by a plain sum), the delayed
  apply, the mix and the flush, step by step;
* ``replay``: a fault-tolerant run's membership history in one process -- at each step the
  contributors' gradients added in slot order, divided by their number, the momentum step.

Each ``check_*`` returns the check a ``Case`` runs on the ranks' reports.
"""

from __future__ import annotations

import torch

from . import workers as w

TOLERANCE = 1e-11  # float64; the allreduce adds the workers' deltas in its own order


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    error = (got - want).abs().max().item() if got.numel() else 0.0
    scale = 1.0 + want.abs().max().item() if want.numel() else 1.0
    if not error <= TOLERANCE * scale:
        raise AssertionError(f"{what}: differs from the reference by up to {error:.3g}")


# --- task 1 ------------------------------------------------------------------------------------
def outer_rounds(spec: dict, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    problem = spec["outer"][index]
    n, (lr, mu) = problem["numel"], problem["lr_mu"]
    theta, v = w.draw([n], spec["seed"], index, 0).tolist(), [0.0] * n
    for r in range(problem["rounds"]):
        delta = w.draw([n], spec["seed"], index, r + 1).tolist()
        for i in range(n):
            v[i] = mu * v[i] + delta[i]
            theta[i] = theta[i] - lr * (delta[i] + mu * v[i])
    return torch.tensor(theta, dtype=torch.float64), torch.tensor(v, dtype=torch.float64)


def due_at(inner_steps: int, fragments: int, t: int) -> list[int]:
    """The fragments launched after step t: those whose launches (their offset, then every H) include t."""
    due = []
    for f in range(fragments):
        first = (f + 1) * inner_steps // fragments
        if t in range(first, t + 1, inner_steps):
            due.append(f)
    return due


def schedule_table(inner_steps: int, fragments: int, steps: int) -> list[list[int]]:
    return [due_at(inner_steps, fragments, t) for t in range(1, steps + 1)]


def check_outer_and_schedule(spec: dict):
    def check(outs: list[dict]) -> None:
        out = outs[0]
        for index, got in enumerate(out["rounds"]):
            theta, v = outer_rounds(spec, index)
            lr, mu = spec["outer"][index]["lr_mu"]
            _close(got["momentum"], v, f"nesterov_step_ (lr {lr}, mu {mu}): the momentum buffer")
            _close(got["params"], theta, f"nesterov_step_ (lr {lr}, mu {mu}): the parameters")
        for (h, f, steps), got in zip(spec["schedules"], out["due"], strict=True):
            want = schedule_table(h, f, steps)
            for t, (a, b) in enumerate(zip(got, want), start=1):
                if list(a) != b:
                    raise AssertionError(f"fragments_due({t}, H={h}, F={f}) = {list(a)}, expected {b}")

    return check


# --- task 2 ------------------------------------------------------------------------------------
def simulate(spec: dict, world: int) -> dict:
    """Every worker's flattened parameters after every inner step (and after the flush)."""
    h, frags, tau, mix = spec["inner_steps"], spec["fragments"], spec["delay"], spec["mix"]
    lr, mu = spec["outer_lr"], spec["outer_momentum"]
    workers = [w.regression_params(spec) for _ in range(world)]

    def flat(params):
        return torch.cat([p.reshape(-1) for p in params])

    start = flat(workers[0])
    n = start.numel()
    theta, v = start.clone(), torch.zeros(n, dtype=torch.float64)
    local = [start.clone() for _ in range(world)]
    bounds = [(f * n // frags, (f + 1) * n // frags) for f in range(frags)]
    pending: list[tuple[int, int, torch.Tensor]] = []  # (apply after step, fragment, averaged delta)

    def apply(item):
        pending.remove(item)
        _, f, delta = item
        lo, hi = bounds[f]
        v[lo:hi] = mu * v[lo:hi] + delta  # the formula, slice by slice (not the library's)
        theta[lo:hi] = theta[lo:hi] - lr * (delta + mu * v[lo:hi])
        for r in range(world):
            local[r][lo:hi] = mix * local[r][lo:hi] + (1 - mix) * theta[lo:hi]

    trajectory = [[] for _ in range(world)]
    for t in range(1, spec["steps"] + 1):
        for r in range(world):
            params = _unflatten(local[r], workers[r])
            w.inner_step(params, *w.regression_batch(spec, r, t), spec["inner_lr"])
            local[r] = flat(params)
        for item in [x for x in pending if x[0] == t]:
            apply(item)
        for f in due_at(h, frags, t):
            lo, hi = bounds[f]
            total = torch.zeros(hi - lo, dtype=torch.float64)
            for r in range(world):
                total = total + (theta[lo:hi] - local[r][lo:hi])
            item = (t + tau, f, total / world)
            pending.append(item)
            if tau == 0:
                apply(item)
        for r in range(world):
            trajectory[r].append(local[r].clone())
    left = len(pending)
    if spec["flush"]:
        for item in list(pending):
            apply(item)
    return {"trajectory": trajectory, "final": [x.clone() for x in local], "pending_at_end": left}


def _unflatten(values: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for p in like:
        out.append(values[offset : offset + p.numel()].view_as(p).clone())
        offset += p.numel()
    return out


def check_streaming(spec: dict, world: int):
    want = simulate(spec, world)
    what = (
        f"StreamingSync(H={spec['inner_steps']}, F={spec['fragments']}, delay={spec['delay']}, "
        f"mix={spec['mix']}) on {world} workers"
    )

    def check(outs: list[dict]) -> None:
        for rank, out in enumerate(outs):
            for t, (got, ref) in enumerate(zip(out["trajectory"], want["trajectory"][rank], strict=True), 1):
                _close(got, ref, f"{what}: rank {rank}'s parameters after inner step {t}")
            end = "after flush()" if spec["flush"] else "at the end"
            _close(out["final"], want["final"][rank], f"{what}: rank {rank}'s parameters {end}")

    return check


# --- task 3 ------------------------------------------------------------------------------------
def replay(spec: dict, history: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One process through ``history``: parameters and momentum buffers at the end."""
    model = w.quorum_model(spec)
    params = list(model.parameters())
    buffers = [torch.zeros_like(p) for p in params]
    for step, contributors in enumerate(history):
        grads = []
        for slot in sorted(contributors):
            model.zero_grad()
            w.quorum_loss(model, spec, slot, step).backward()
            grads.append([p.grad.clone() for p in params])
        with torch.no_grad():
            for i, p in enumerate(params):
                total = grads[0][i].clone()
                for g in grads[1:]:
                    total = total + g[i]
                average = total / len(grads)
                buffers[i] = buffers[i] * spec["mu"] + average
                p.sub_(spec["lr"] * buffers[i])
    return [p.detach() for p in params], buffers


def check_quorum(spec: dict):
    def check(outs: list[dict]) -> None:
        slots = outs[0]["slots"]
        survivors = [(s, out) for s, out in enumerate(slots) if out is not None]
        if not survivors:
            raise AssertionError("no rank survived the run")
        history = survivors[0][1]["history"]
        if len(history) != spec["steps"]:
            raise AssertionError(
                f"slot {survivors[0][0]} recorded {len(history)} steps, expected {spec['steps']}"
            )
        deaths = sum(1 for step in history if len(step) < spec["ranks"])
        if deaths == 0:
            raise AssertionError(f"no step lost a contributor, though ranks were killed: history {history}")
        params, buffers = replay(spec, history)
        for slot, out in survivors:
            if out["history"] != history:
                raise AssertionError(f"slots disagree on who contributed: {out['history']} vs {history}")
            for name, got, want in (
                ("parameters", out["params"], params),
                ("momentum", out["buffers"], buffers),
            ):
                for a, b in zip(got, want, strict=True):
                    if not torch.equal(a, b):
                        raise AssertionError(
                            f"slot {slot} (incarnation {out['incarnation']}): the {name} differ from a "
                            f"one-process replay of the history {history} (by up to "
                            f"{(a - b).abs().max().item():.3g}); average over the contributors only, "
                            "added in slot order"
                        )
            for step, members, nbytes, gradient in out["traffic"]:
                if len(history[step]) == members and nbytes != (members - 1) * gradient:
                    raise AssertionError(
                        f"slot {slot}, step {step}: exchange sent {nbytes} bytes among {members} members, "
                        f"expected (k - 1) x {gradient} = {(members - 1) * gradient}"
                    )

    return check


# --- task 4, measured --------------------------------------------------------------------------
LINK_BYTES_PER_S = 100e6 / 8  # the emulated 100 Mbit/s link
LATENCY_S = 5e-4  # per message
FLOPS = 1e9  # the emulated device's rate: a step of the regression is 6 N B FLOPs


def step_compute_s(spec: dict) -> float:
    n = spec["inputs"] * spec["outputs"] + spec["outputs"]
    return 6 * n * spec["batch"] / FLOPS


def emulated_ms(spec: dict, steps: int, nbytes: int, messages: int) -> float:
    """steps x compute + bytes / link + messages x latency, in milliseconds."""
    return 1e3 * (steps * step_compute_s(spec) + nbytes / LINK_BYTES_PER_S + messages * LATENCY_S)


def time_to_target(spec: dict, trajectory: list[torch.Tensor], traffic: list[list[int]], world: int) -> float:
    """The emulated milliseconds until rank 0's parameters first reach the target held-out loss."""
    for t, (flat, (nbytes, messages)) in enumerate(zip(trajectory, traffic), start=1):
        if w.heldout_loss(spec, world, flat) <= spec["target"]:
            return emulated_ms(spec, t, nbytes, messages)
    best = min(w.heldout_loss(spec, world, flat) for flat in trajectory)
    raise AssertionError(
        f"the held-out loss never reached the target {spec['target']} in {spec['steps']} inner steps (best "
        f"{best:.3g}): choose another design() (lecture 11 section 1: H, the outer lr and momentum)"
    )


def traffic_floor(spec: dict, design: dict) -> list[tuple[int, int]]:
    """The least cumulative (bytes, messages) rank 0 can have sent by each inner step: every launch
    of fragment f (n_f float64 values) that has been *applied* by then -- launched at s, applied
    after s + tau -- needs rank 0's n_f values on the other worker (no averaging to 1e-11 works
    with fewer bytes) in at least one message. The time is scored on max(counted, floor), so
    counters that are forged, or a rank 0 that replays the other worker instead of exchanging, win
    nothing below the design's own floor."""
    h, frags, tau = design["inner_steps"], design["fragments"], design["delay"]
    n = spec["inputs"] * spec["outputs"] + spec["outputs"]
    sizes = [(f + 1) * n // frags - f * n // frags for f in range(frags)]
    floor, nbytes, messages = [], 0, 0
    for t in range(1, spec["steps"] + 1):
        launched = t - tau
        if launched >= 1:
            for f in due_at(h, frags, launched):
                nbytes, messages = nbytes + 8 * sizes[f], messages + 1
        floor.append((nbytes, messages))
    return floor


def checked_design(spec: dict, design: dict) -> dict:
    """The design again on the trusted side: bounded, so that the simulation stays small."""
    n = spec["inputs"] * spec["outputs"] + spec["outputs"]
    h, frags, tau = design["inner_steps"], design["fragments"], design["delay"]
    if not (1 <= h <= spec["steps"] and 1 <= frags <= min(h, n) and 0 <= tau < h):
        raise AssertionError(
            f"design() {design}: needs 1 <= inner_steps <= {spec['steps']}, 1 <= fragments <= "
            f"min(inner_steps, {n}), 0 <= delay < inner_steps"
        )
    return design


def checked_traffic(traffic: list[list[int]]) -> list[tuple[int, int]]:
    """The transport's cumulative counters as rank 0 reported them: never negative, never falling."""
    last = (0, 0)
    for t, (nbytes, messages) in enumerate(traffic, start=1):
        if nbytes < last[0] or messages < last[1]:
            raise AssertionError(
                f"the transport's counters fell after inner step {t}: {traffic[t - 2]} -> "
                f"{[nbytes, messages]}: they count what was sent and cannot fall"
            )
        last = (nbytes, messages)
    return [tuple(pair) for pair in traffic]


def check_measured(spec: dict, world: int):
    def check(outs: list[dict]) -> float:
        design = checked_design(spec, outs[0]["design"])
        want = simulate(dict(spec, **design, flush=False), world)
        for t, (got, ref) in enumerate(zip(outs[0]["trajectory"], want["trajectory"][0], strict=True), 1):
            _close(
                got, ref, f"the measured run (design() {design}): rank 0's parameters after inner step {t}"
            )
        counted = checked_traffic(outs[0]["traffic"])
        floor = traffic_floor(spec, design)
        traffic = [[max(c[0], f[0]), max(c[1], f[1])] for c, f in zip(counted, floor, strict=True)]
        return time_to_target(spec, outs[0]["trajectory"], traffic, world)

    return check

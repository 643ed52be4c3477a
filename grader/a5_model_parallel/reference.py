"""The trusted side of assignment 5's hidden tests: the dense computations, the schedules written
a second time, a brute-force checker and a simulator, and the checks.

Nothing here runs next to student code, and nothing here uses the library's tensor or pipeline
parallelism (``minidist.parallel.tensor``/``pipeline``) or the solution: the dense model is plain
torch in this process, and the 1F1B schedule is derived again from its definition (stage r may
hold at most p - r microbatches, and starts a backward as soon as it may), so that a bug in the
library or the solution is not graded as right. ``tests/grader/test_grade_a5.py`` checks the reference
against the solution's schedules.

Each ``*_check`` returns a function of the ranks' reports (read back as data) that raises
``AssertionError`` with a message a student may read: it names what differs and by how much,
never the expected value. ``measured_check`` (the measured test, graded in tiers) returns, when
the run is right, the step's time on the emulated clock (``emulated_time``: the order the
grader's stages logged, F = B = W = 1 unit) over the ideal (``ideal_time``); ``split_late`` is
the split schedule the stage step must run, ``zero_bubble`` the fastest (for the course's tests).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from . import workers

ATOL, RTOL = 1e-9, 1e-7  # float64 throughout: the same sums in another order


# --- schedules, the second time ------------------------------------------------------------------
def gpipe(p: int, m: int) -> list[list[tuple[str, int]]]:
    return [[("F", j) for j in range(m)] + [("B", j) for j in range(m)] for _ in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[tuple[str, int]]]:
    """Greedy: stage r runs the next forward while it holds fewer than min(p - r, m) microbatches
    (or has no backward left to run), else the next backward."""
    out = []
    for r in range(p):
        limit, forwards, backwards, actions = min(p - r, m), 0, 0, []
        while backwards < m:
            if forwards < m and forwards - backwards < limit:
                actions.append(("F", forwards))
                forwards += 1
            else:
                actions.append(("B", backwards))
                backwards += 1
        out.append(actions)
    return out


def zero_bubble(p: int, m: int) -> list[list[tuple[str, int]]]:
    """A schedule that splits every backward into B (the input's gradient) and W (the weights'),
    derived from when work can start: stage r runs min(p - r, m) forwards, then for each
    microbatch k in order its B, the W of microbatch k - r (so that stage r holds at most p), the
    next forward; then the Ws left. With F = B = W it idles p - 1 units per stage for m >= p
    (1F1B: 3 (p - 1)). The grader's own, for its tests of the emulated clock (never in a spec)."""
    out = []
    for r in range(p):
        forwards = min(p - r, m)
        actions = [("F", j) for j in range(forwards)]
        weights = 0
        for k in range(m):
            actions.append(("B", k))
            if k - r >= 0:
                actions.append(("W", k - r))
                weights += 1
            if forwards < m:
                actions.append(("F", forwards))
                forwards += 1
        actions += [("W", j) for j in range(weights, m)]
        out.append(actions)
    return out


def split_late(p: int, m: int) -> list[list[tuple[str, int]]]:
    """1F1B with every backward split into B, where 1F1B has its backward, and W, all at the end
    of the stage's list: what ``test_run_stage[...-split]`` runs (a split schedule that gives away
    nothing of a fast one: its spec is readable in the sandbox)."""
    return [
        [(kind, j) for kind, j in actions] + [("W", j) for j in range(m)] for actions in one_f_one_b(p, m)
    ]


def as_actions(schedule) -> list[list[tuple[str, int]]]:
    """A reported schedule as lists of (str, int) tuples; AssertionError if it is not one."""
    try:
        return [[(str(kind), int(j)) for kind, j in actions] for actions in schedule]
    except (TypeError, ValueError) as error:
        raise AssertionError(
            f"a schedule is a list (one per stage) of ('F', j) / ('B', j): {error}"
        ) from None


def check_schedule(schedule, p: int, m: int) -> None:
    """Every stage runs F j and B j once each; run in order, stage by stage, a forward waits for
    the previous stage's forward, a backward for its own forward and the next stage's backward.
    Brute force: advance any stage whose next action is ready until all are done, or none can
    move (a deadlock). AssertionError naming the first violation."""
    if len(schedule) != p:
        raise AssertionError(f"{len(schedule)} stage lists for {p} stages")
    want = sorted([("F", j) for j in range(m)] + [("B", j) for j in range(m)])
    for r, actions in enumerate(schedule):
        if sorted(actions) != want:
            raise AssertionError(
                f"stage {r} does not run each of the {m} forwards and backwards exactly once"
            )
    done: set[tuple[int, str, int]] = set()
    position = [0] * p
    while True:
        moved = False
        for r in range(p):
            if position[r] == len(schedule[r]):
                continue
            kind, j = schedule[r][position[r]]
            if kind == "F":
                ready = r == 0 or (r - 1, "F", j) in done
            else:
                ready = (r, "F", j) in done and (r == p - 1 or (r + 1, "B", j) in done)
            if ready:
                done.add((r, kind, j))
                position[r] += 1
                moved = True
        if all(position[r] == len(schedule[r]) for r in range(p)):
            return
        if not moved:
            stuck = ", ".join(
                f"stage {r} at {schedule[r][position[r]]}" for r in range(p) if position[r] < 2 * m
            )
            raise AssertionError(f"the schedule deadlocks: {stuck} wait for each other")


def simulate(schedule, t_forward: float = 1.0, t_backward: float = 2.0) -> float:
    """The bubble fraction: every action starts when its stage is free and its inputs are there
    (no communication time); 1 - busy time / (p x the time of the whole step)."""
    p = len(schedule)
    end: dict[tuple[int, str, int], float] = {}
    free, position = [0.0] * p, [0] * p
    while any(position[r] < len(schedule[r]) for r in range(p)):
        for r in range(p):
            while position[r] < len(schedule[r]):
                kind, j = schedule[r][position[r]]
                deps = [(r - 1, "F", j)] if kind == "F" and r > 0 else []
                if kind == "B":
                    deps = [(r, "F", j)] + ([(r + 1, "B", j)] if r < p - 1 else [])
                if any(d not in end for d in deps):
                    break
                start = max([free[r]] + [end[d] for d in deps])
                free[r] = end[(r, kind, j)] = start + (t_forward if kind == "F" else t_backward)
                position[r] += 1
    busy = sum(t_forward if kind == "F" else t_backward for actions in schedule for kind, _ in actions)
    return 1.0 - busy / (p * max(free))


def bubble_formula(p: int, m: int) -> float:
    return (p - 1) / (m + p - 1)


def peaks(schedule) -> list[int]:
    """Per stage, the most microbatches forwarded and not yet backwarded at once (a backward split
    into B and W is done at the second of the two)."""
    out = []
    for actions in schedule:
        split = {j for kind, j in actions if kind == "W"}
        parts: dict[int, int] = {}
        live = peak = 0
        for kind, j in actions:
            if kind == "F":
                live += 1
            else:
                parts[j] = parts.get(j, 0) + 1
                live -= parts[j] == (2 if j in split else 1)
            peak = max(peak, live)
        out.append(peak)
    return out


#: the emulated clock's units: a forward, a backward's input part (B) and its weight part (W) each
#: do the FLOPs of the stage's matmuls once (2 N T for N weights and T rows: x W^T, g W, g^T x);
#: a whole backward (B and W in one call) is both. Sending takes no time (the simulator's rule).
UNITS = {"F": 1.0, "B": 1.0, "W": 1.0}


def check_executed(orders: list[list[tuple[str, int]]], p: int, m: int) -> None:
    """The order the grader's stages logged: on every stage the forwards 0 .. m-1 in order, one
    backward per microbatch in the same order (whole, or its B part) and at most one W part each,
    nothing run twice. AssertionError naming the first violation."""
    for r, order in enumerate(orders):
        where = f"stage {r}"
        if any(j < 0 for _, j in order):
            raise AssertionError(
                f"{where}: a backward ran twice for one forward (a second backward adds nothing)"
            )
        forwards = [j for kind, j in order if kind == "F"]
        backwards = [j for kind, j in order if kind == "B"]
        weights = sorted(j for kind, j in order if kind == "W")
        if forwards != list(range(m)):
            raise AssertionError(f"{where}: {len(forwards)} forwards for {m} microbatches")
        if backwards != list(range(m)):
            raise AssertionError(
                f"{where}: the backwards (B) ran {len(backwards)} times or out of microbatch order; "
                f"one per microbatch, in the order of the forwards"
            )
        if len(weights) != len(set(weights)):
            raise AssertionError(f"{where}: a weight part (W) ran twice")


def emulated_time(orders: list[list[tuple[str, int]]]) -> float:
    """The step's time on the emulated clock (``UNITS``) when every stage runs its logged order:
    each piece of work starts when its stage is free and what it needs is there -- F j the
    activation of F j on the stage before; B j and W j the gradient from B j on the stage after
    (and their own forward). AssertionError if the orders wait on each other (they cannot have run)."""
    p = len(orders)
    split = [{j for kind, j in order if kind == "W"} for order in orders]
    end: dict[tuple[int, str, int], float] = {}
    free, position = [0.0] * p, [0] * p
    while any(position[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while position[r] < len(orders[r]):
                kind, j = orders[r][position[r]]
                needs = [(r - 1, "F", j)] if kind == "F" and r > 0 else []
                if kind != "F":
                    needs = [(r, "F", j)] + ([(r + 1, "B", j)] if r < p - 1 else [])
                if any(n not in end for n in needs):
                    break
                length = UNITS[kind] + (UNITS["W"] if kind == "B" and j not in split[r] else 0.0)
                free[r] = end[(r, kind, j)] = max([free[r]] + [end[n] for n in needs]) + length
                position[r] += 1
                moved = True
        if not moved:
            raise AssertionError("the stages' orders wait on each other: they cannot have run")
    return max(free)


def ideal_time(m: int) -> float:
    """One stage's work with no idle time: m forwards and m whole backwards."""
    return m * (UNITS["F"] + UNITS["B"] + UNITS["W"])


# --- tensor parallel: the dense model --------------------------------------------------------
def _close(what: str, got, want, atol: float = ATOL, rtol: float = RTOL) -> None:
    if not torch.is_tensor(got):
        raise AssertionError(f"{what}: got {type(got).__name__}, not a tensor")
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, which is wrong")
    got = got.to(want.dtype)
    if not torch.allclose(got, want, rtol=rtol, atol=atol):
        diff = float((got - want).abs().max())
        raise AssertionError(f"{what}: differs from the dense model by up to {diff:.3g}")


def _counts(what: str, calls: list[dict], want: dict[tuple[str, str], int]) -> None:
    got: dict[tuple[str, str], int] = {}
    for call in calls:
        key = (call["phase"], call["function"])
        got[key] = got.get(key, 0) + 1
    for key in sorted(set(got) | set(want)):
        if got.get(key, 0) != want.get(key, 0):
            phase, function = key
            raise AssertionError(
                f"{what}: {got.get(key, 0)} call(s) of md.{function} in the {phase}, which is wrong"
            )


def operators_check(what: str, spec: dict):
    def check(reports: list[dict]) -> None:
        p = spec["world_size"]
        xs = [workers.tensor(spec, "x", r) for r in range(p)]
        ups = [workers.tensor(spec, "up", r) for r in range(p)]
        for r, report in enumerate(reports):
            _close(f"{what}, rank {r}: f's forward", report["f_out"], xs[r])
            _close(f"{what}, rank {r}: f's backward (the gradient of x)", report["f_grad"], sum(ups))
            _close(f"{what}, rank {r}: g's forward", report["g_out"], sum(xs))
            _close(f"{what}, rank {r}: g's backward (the gradient of x)", report["g_grad"], ups[r])
            _close(f"{what}, rank {r}: x after f and g (it must not change)", report["x_after"], xs[r])
            want = {("f forward", "allreduce"): 0, ("f backward", "allreduce"): 1}
            want.update({("g forward", "allreduce"): 1, ("g backward", "allreduce"): 0})
            _counts(f"{what}, rank {r}", report["calls"], {k: v for k, v in want.items() if v})
            # and what they carry: this rank's upstream gradient, this rank's x (not a sum rebuilt
            # from the other ranks' inputs, not zeros)
            wanted = [("f backward", "allreduce", ups[r]), ("g forward", "allreduce", xs[r])]
            _calls(f"{what}, rank {r}", report["calls"], wanted)

    return check


def _calls(where: str, calls: list[dict], want: list[tuple[str, str, torch.Tensor]], bias_free=()) -> None:
    """Each collective of ``want`` (phase, function, the tensor it must be handed), in order, among
    the collectives a rank called: a collective of zeros or of a dense result is not this rank's
    share. Others besides are tolerated here (the count tests count them). For the phases in
    ``bias_free``, the tensor may differ from the wanted one by the same vector in every row
    (a bias added before the sum: the value tests catch that, not this)."""
    position = 0
    for phase, function, given in want:
        error = f"no md.{function} in the {phase}"
        while position < len(calls):
            call = calls[position]
            position += 1
            if (call["phase"], call["function"]) != (phase, function):
                continue
            got = call["given"]
            if phase in bias_free and torch.is_tensor(got) and tuple(got.shape) == tuple(given.shape):
                offset = (got.to(given.dtype) - given).reshape(-1, given.shape[-1])
                got = got.to(given.dtype) - offset[:1].reshape(given.shape[-1])
            try:
                _close(f"{where}: the tensor given to md.{function} in the {phase}", got, given)
            except AssertionError as mismatch:
                error = str(mismatch)
                continue
            break
        else:
            raise AssertionError(
                f"{where}: {error} (it should be this rank's share, computed from its shard)"
                if error.startswith("no ")
                else f"{error}; it should be this rank's share, computed from its shard"
            )


def nudged_linear(spec: dict):
    """The dense weight and bias with every rank's nudge (``workers.nudge``) put in its shard."""
    p, kind = spec["world_size"], spec["kind"]
    weight, bias, x, upstream = workers.dense_linear(spec)
    for r in range(p):
        if kind == "column":
            rows = slice(r * spec["d_out"] // p, (r + 1) * spec["d_out"] // p)
            weight[rows] += workers.nudge(spec, "weight", r, weight[rows].shape)
            if bias is not None:
                bias[rows] += workers.nudge(spec, "bias", r, bias[rows].shape)
        else:
            cols = slice(r * spec["d_in"] // p, (r + 1) * spec["d_in"] // p)
            weight[:, cols] += workers.nudge(spec, "weight", r, weight[:, cols].shape)
    if kind == "row" and bias is not None:
        bias += workers.nudge(spec, "bias", -1, bias.shape)
    return weight, bias, x, upstream


def linear_check(what: str, spec: dict):
    """Column- or row-parallel against ``F.linear`` with the dense weight (the grader's nudges in
    every shard), every shard's gradient, and the collectives: which, and what each was given."""

    def check(reports: list[dict]) -> None:
        p, kind = spec["world_size"], spec["kind"]
        weight, bias, x, upstream = nudged_linear(spec)
        weight.requires_grad_()
        if bias is not None:
            bias.requires_grad_()
        x = x.clone().requires_grad_()
        out = F.linear(x, weight, bias)
        (out * upstream).sum().backward()
        for r, report in enumerate(reports):
            where = f"{what}, rank {r}"
            if kind == "column":
                rows = slice(r * spec["d_out"] // p, (r + 1) * spec["d_out"] // p)
                local = out.detach() if spec["gather_output"] else out.detach()[..., rows]
                _close(f"{where}: the output", report["out"], local)
                _close(f"{where}: the weight's gradient", report["weight_grad"], weight.grad[rows])
                if bias is not None:
                    _close(f"{where}: the bias's gradient", report["bias_grad"], bias.grad[rows])
                _close(f"{where}: the input's gradient", report["x_grad"], x.grad)
                w_r = weight.detach()[rows]
                want = [("backward", "allreduce", upstream[..., rows] @ w_r)]
                if spec["gather_output"]:
                    b_r = None if bias is None else bias.detach()[rows]
                    want.insert(0, ("forward", "allgather", F.linear(x.detach(), w_r, b_r)))
            else:
                cols = slice(r * spec["d_in"] // p, (r + 1) * spec["d_in"] // p)
                _close(f"{where}: the output", report["out"], out.detach())
                _close(f"{where}: the weight's gradient", report["weight_grad"], weight.grad[:, cols])
                if bias is not None:
                    _close(f"{where}: the bias's gradient", report["bias_grad"], bias.grad)
                x_grad = x.grad if not spec["input_is_parallel"] else x.grad[..., cols]
                _close(f"{where}: the input's gradient", report["x_grad"], x_grad)
                w_r = weight.detach()[:, cols]
                want = [("forward", "allreduce", F.linear(x.detach()[..., cols], w_r))]
                if not spec["input_is_parallel"]:
                    want.append(("backward", "allgather", upstream @ w_r))
            _calls(where, report["calls"], want)

    return check


def nudged_mlp(spec: dict):
    """The dense MLP with every rank's nudge (``workers.nudge``) put in its shard."""
    mlp, p, ffn = workers.dense_mlp(spec), spec["world_size"], spec["ffn"]
    with torch.no_grad():
        for r in range(p):
            rows = slice(r * ffn // p, (r + 1) * ffn // p)
            mlp.up.weight[rows] += workers.nudge(spec, "up.weight", r, mlp.up.weight[rows].shape)
            mlp.up.bias[rows] += workers.nudge(spec, "up.bias", r, mlp.up.bias[rows].shape)
            mlp.down.weight[:, rows] += workers.nudge(spec, "down.weight", r, mlp.down.weight[:, rows].shape)
        mlp.down.bias += workers.nudge(spec, "down.bias", -1, mlp.down.bias.shape)
    return mlp


def dense_mlp_run(spec: dict):
    mlp = nudged_mlp(spec)
    x = workers.mlp_input(spec).requires_grad_()
    out = mlp(x)
    (out * workers.mlp_upstream(spec)).sum().backward()
    return mlp, x, out.detach()


def mlp_partials(spec: dict, mlp, r: int):
    """Rank r's share: its partial output (what its forward allreduce sums) and its partial
    input gradient (what its backward allreduce sums)."""
    p, ffn = spec["world_size"], spec["ffn"]
    rows = slice(r * ffn // p, (r + 1) * ffn // p)
    x = workers.mlp_input(spec).requires_grad_()
    with torch.no_grad():
        wu, bu, wd = mlp.up.weight[rows].clone(), mlp.up.bias[rows].clone(), mlp.down.weight[:, rows].clone()
    part = F.linear(F.gelu(F.linear(x, wu, bu)), wd)
    (part * workers.mlp_upstream(spec)).sum().backward()
    return part.detach(), x.grad


def mlp_check(what: str, spec: dict):
    def check(reports: list[dict]) -> None:
        p, ffn = spec["world_size"], spec["ffn"]
        mlp, x, out = dense_mlp_run(spec)
        for r, report in enumerate(reports):
            where = f"{what}, rank {r}"
            rows = slice(r * ffn // p, (r + 1) * ffn // p)
            _close(f"{where}: the output", report["out"], out)
            _close(f"{where}: the input's gradient", report["x_grad"], x.grad)
            grads = report["grads"]
            expected = {
                "up.weight": mlp.up.weight.grad[rows],
                "up.bias": mlp.up.bias.grad[rows],
                "down.weight": mlp.down.weight.grad[:, rows],
                "down.bias": mlp.down.bias.grad,
            }
            if sorted(grads) != sorted(expected):
                raise AssertionError(
                    f"{where}: parameters {sorted(grads)}; want up.weight/bias, down.weight/bias"
                )
            for name, want in expected.items():
                _close(f"{where}: the gradient of {name}", grads[name], want)
            part, part_grad = mlp_partials(spec, mlp, r)
            _calls(
                where, report["calls"], [("forward", "allreduce", part), ("backward", "allreduce", part_grad)]
            )

    return check


def mlp_count_check(what: str, spec: dict):
    """One allreduce forward and one backward per call, of this rank's partial output and
    partial input gradient; nothing else."""

    def check(reports: list[dict]) -> None:
        numel = spec["batch"] * spec["seq"] * spec["d"]
        mlp = nudged_mlp(spec)
        for r, report in enumerate(reports):
            calls = report["calls"]
            part, part_grad = mlp_partials(spec, mlp, r)
            for step in range(spec["calls"]):
                mine = [c for c in calls if c["step"] == step]
                _counts(
                    f"{what}, rank {r}, call {step + 1}",
                    mine,
                    {("forward", "allreduce"): 1, ("backward", "allreduce"): 1},
                )
                for c in mine:
                    if c["numel"] != numel:
                        raise AssertionError(
                            f"{what}, rank {r}: an allreduce of {c['numel']} elements; one activation "
                            f"(batch x seq x d) is the only thing to reduce"
                        )
                _calls(
                    f"{what}, rank {r}, call {step + 1}",
                    mine,
                    [("forward", "allreduce", part), ("backward", "allreduce", part_grad)],
                    bias_free=("forward",),
                )
            if any(c["step"] is None for c in calls):
                raise AssertionError(
                    f"{what}, rank {r}: a collective outside the forward and backward (construction?)"
                )

    return check


# --- schedules ------------------------------------------------------------------------------------
def schedule_exact_check(what: str, cases: list[list[int]]):
    def check(reports: list[list]) -> None:
        for (p, m), got in zip(cases, reports[0], strict=True):
            if as_actions(got) != one_f_one_b(p, m):
                raise AssertionError(
                    f"{what}: one_f_one_b({p}, {m}) is not the 1F1B schedule of the docstring"
                )

    return check


def schedule_valid_check(what: str, cases: list[list[int]]):
    def check(reports: list[list]) -> None:
        for (p, m), got in zip(cases, reports[0], strict=True):
            try:
                check_schedule(as_actions(got), p, m)
            except AssertionError as error:
                raise AssertionError(f"{what}: one_f_one_b({p}, {m}): {error}") from None

    return check


def bubble_check(what: str, cases: list[list[int]]):
    def check(reports: list[list]) -> None:
        for (p, m), got in zip(cases, reports[0], strict=True):
            schedule = as_actions(got)
            check_schedule(schedule, p, m)
            bubble = simulate(schedule)
            if abs(bubble - bubble_formula(p, m)) > 1e-9:
                raise AssertionError(
                    f"{what}: one_f_one_b({p}, {m}) idles {bubble:.4f} of the time "
                    "(F = 1, B = 2), not (p-1)/(m+p-1)"
                )

    return check


def peak_check(what: str, cases: list[list[int]]):
    def check(reports: list[list]) -> None:
        for (p, m), got in zip(cases, reports[0], strict=True):
            schedule = as_actions(got)
            check_schedule(schedule, p, m)
            held = peaks(schedule)
            for r, peak in enumerate(held):
                if peak > min(p - r, m):
                    raise AssertionError(
                        f"{what}: one_f_one_b({p}, {m}) holds {peak} microbatches on stage {r}; "
                        f"1F1B holds at most p - r (GPipe holds all m)"
                    )

    return check


# --- the executor -------------------------------------------------------------------------------
def one_process(spec: dict):
    """The model in one piece: the mean loss over the microbatches, every stage's gradients, and
    at every stage boundary the activation and its gradient (of the mean loss) per microbatch:
    ``boundary[r][j]`` is stage r's output for microbatch j, ``boundary_grad[r][j]`` its gradient."""
    stages = workers.make_stages(spec)
    xs, ys = workers.microbatches(spec)
    p, m = spec["world_size"], spec["m"]
    boundary: list[list[torch.Tensor]] = [[] for _ in range(p - 1)]
    losses = []
    for x, y in zip(xs, ys):
        for r, stage in enumerate(stages):
            x = stage(x)
            if r < p - 1:
                x.retain_grad()
                boundary[r].append(x)
        losses.append(F.cross_entropy(x, y))
    loss = sum(losses) / m
    loss.backward()
    grads = [[p.grad for p in stage.parameters()] for stage in stages]
    activations = [[a.detach() for a in row] for row in boundary]
    gradients = [[a.grad for a in row] for row in boundary]
    return float(loss.detach()), grads, activations, gradients


def _sent_check(where: str, sent: list, want: list[torch.Tensor], what: str) -> None:
    """The tensors a rank sent to one peer, in order, against what microbatch j's should be."""
    if len(sent) != len(want):
        raise AssertionError(f"{where}: {len(sent)} messages of {what}; one per microbatch")
    for j, (got, expected) in enumerate(zip(sent, want, strict=True)):
        _close(f"{where}: the {what} sent for microbatch {j}", got, expected, atol=1e-6, rtol=1e-5)


def _stage_checks(what: str, spec: dict, reports: list[dict], check_messages: bool, order_check=None) -> None:
    """What every run of the stage step must get right, whatever the schedule: the loss, every
    gradient (the grader's stage's own), no stray forward, then ``order_check(where, r, report)``
    (the order and the peak the grader logged), the peak it reports equal to the one the grader
    counted, and the messages (their count, bytes and contents); stage by stage, in this order."""
    p = spec["world_size"]
    loss, grads, activations, gradients = one_process(spec)
    for r, report in enumerate(reports):
        where = f"{what}, stage {r}"
        if r == p - 1:
            got = report["loss"]
            if not isinstance(got, (int, float)) or abs(got - loss) > 1e-6 * max(1.0, abs(loss)):
                raise AssertionError(f"{where}: the loss {got} is not the mean over the microbatches")
        elif report["loss"] is not None:
            raise AssertionError(
                f"{where}: loss {report['loss']}; only the last stage has a loss (None elsewhere)"
            )
        if report["stray"] != 0:
            raise AssertionError(
                f"{where}: the stage's layers ran {report['stray']} time(s) without going through "
                "the stage you were given; call stage(x) for every forward"
            )
        if len(report["grads"]) != len(grads[r]):
            raise AssertionError(f"{where}: {len(report['grads'])} gradients for {len(grads[r])} parameters")
        for i, (got, want) in enumerate(zip(report["grads"], grads[r])):
            if got is None:
                raise AssertionError(f"{where}: parameter {i} has no gradient (was its backward run?)")
            _close(f"{where}: the gradient of parameter {i}", got, want, atol=1e-6, rtol=1e-5)
        if order_check is not None:
            order_check(where, r, report)
        if report["peak"] != report["measured_peak"]:
            raise AssertionError(
                f"{where}: peak_in_flight is {report['peak']}, "
                f"but the grader counted {report['measured_peak']}"
            )
        if check_messages:
            _traffic_check(where, spec, r, report, activations, gradients)


def executor_check(what: str, spec: dict, check_messages: bool = True):
    want_peaks = peaks(spec["schedule"])

    def order_check(where: str, r: int, report: dict) -> None:
        order = [(str(kind), int(j)) for kind, j in report["order"]]
        if order != [(kind, int(j)) for kind, j in spec["schedule"][r]]:
            raise AssertionError(
                f"{where}: the forwards and backwards (and their microbatches) did not run in "
                "the order of the schedule"
            )
        if report["measured_peak"] != want_peaks[r]:
            raise AssertionError(
                f"{where}: {report['measured_peak']} microbatches were held at once, "
                "which is wrong for this schedule"
            )

    def check(reports: list[dict]) -> None:
        _stage_checks(what, spec, reports, check_messages, order_check)

    return check


def measured_check(what: str, spec: dict):
    """The measured test: the student's ``fast_schedule`` run by the student's ``run_stage`` on
    the grader's stages. Right (the stage checks), within the cap (at most p microbatches held on
    every stage, counted by the grader's stages), and then timed: the order the grader's stages
    logged, on the emulated clock (``emulated_time``), over the ideal (``ideal_time``). Returns
    that ratio; what the student's code reports about itself (its schedule, its peak) is not used."""

    def check(reports: list[dict]) -> float:
        p, m = spec["world_size"], spec["m"]
        orders = [[(str(kind), int(j)) for kind, j in report["order"]] for report in reports]
        try:
            check_executed(orders, p, m)
        except AssertionError as error:
            raise AssertionError(f"{what}: {error}") from None
        for r, report in enumerate(reports):
            if report["measured_peak"] > p:
                raise AssertionError(
                    f"{what}, stage {r}: {report['measured_peak']} microbatches held at once; "
                    f"the cap is p = {p} on every stage"
                )
        _stage_checks(what, spec, reports, check_messages=True)
        return emulated_time(orders) / ideal_time(m)

    return check


def _traffic_check(where: str, spec: dict, r: int, report: dict, activations, gradients) -> None:
    """Per peer: m messages of one activation to r + 1, m of one gradient to r - 1, nothing else;
    and what was sent is the activation / input gradient of microbatch 0, 1, ... in order."""
    p, m, size = spec["world_size"], spec["m"], spec["activation_bytes"]
    traffic = report["traffic"]
    for peer in range(p):
        sends = m if peer in (r - 1, r + 1) else 0
        got_messages, got_bytes = traffic["sent_messages"][peer], traffic["sent_bytes"][peer]
        if got_messages != sends or got_bytes != sends * size:
            raise AssertionError(
                f"{where}: {got_messages} messages ({got_bytes} bytes) sent to rank {peer} for "
                f"{m} microbatches; one activation forward and one gradient backward per "
                "microbatch and stage boundary"
            )
    sent = report["sent"]
    if r < p - 1:
        _sent_check(f"{where}, to rank {r + 1}", sent.get(str(r + 1), []), activations[r], "activation")
    if r > 0:
        _sent_check(f"{where}, to rank {r - 1}", sent.get(str(r - 1), []), gradients[r - 1], "input gradient")

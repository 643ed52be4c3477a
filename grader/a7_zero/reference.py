"""The trusted side of assignment 7: one process, the shard layout, and the checks. Instructors only.

Everything here runs in the grader's process on what the ranks reported (plain data): the dense
stack trained by ``torch.optim.AdamW`` on the whole batch (``one_process``), the flat padded
layout of the shards written a second time (``unit_shards``), the counts of collectives and
bytes the algorithm fixes, and the measured peak computed from the profiler's raw events.
"""

from __future__ import annotations

import pytest
import torch

from . import workers

TOLERANCE = 1e-9  # float64: N ranks and one process differ by rounding only
TOLERANCE_32 = 1e-3  # the measured run is float32 (AdamW's first steps amplify rounding)


def padded(numel: int, world: int) -> int:
    return -(-numel // world) * world


def unit_sizes(spec: dict) -> list[int]:
    widths, hidden = spec["widths"], spec["hidden"]
    return [a * h + h + h * b + b for a, h, b in zip(widths[:-1], hidden, widths[1:])]


def one_process(spec: dict, dtype=torch.float64) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The dense stack after ``steps`` AdamW steps on the whole batch: (parameters, first-step gradients)."""
    blocks = workers.make_blocks(spec, dtype=dtype)
    params = [p for b in blocks for p in b.parameters()]
    opt = torch.optim.AdamW(params, foreach=False, **workers.ADAMW)
    first = None
    for step in range(spec["steps"]):
        x, y = workers.batch(spec, step, dtype)
        for b in blocks:
            x = b(x)
        opt.zero_grad()
        workers.loss_of(x, y).backward()
        if step == 0:
            first = [p.grad.detach().clone() for p in params]
        opt.step()
    return [p.detach() for p in params], first


def unit_flats(spec: dict, tensors: list[torch.Tensor], world: int) -> list[torch.Tensor]:
    """Each unit's tensors flattened, concatenated and padded to a multiple of ``world``."""
    flats, i = [], 0
    for size in unit_sizes(spec):
        pieces, n = [], 0
        while n < size:
            pieces.append(tensors[i].reshape(-1))
            n += tensors[i].numel()
            i += 1
        flat = torch.cat(pieces)
        flats.append(torch.cat([flat, flat.new_zeros(padded(size, world) - size)]))
    return flats


def _close(got, want: torch.Tensor, what: str, tolerance: float = TOLERANCE) -> None:
    if not isinstance(got, torch.Tensor):
        pytest.fail(f"{what}: got {type(got).__name__}, expected a tensor", pytrace=False)
    if tuple(got.shape) != tuple(want.shape):
        pytest.fail(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}", pytrace=False)
    difference = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    if not difference <= tolerance:
        pytest.fail(f"{what} differs from one process by {difference:.3g}", pytrace=False)


# --- task 1 ----------------------------------------------------------------------------------
def _flat(tensors: list[torch.Tensor], total: int) -> torch.Tensor:
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    return torch.cat([flat, flat.new_zeros(total - flat.numel())])


def zero2_trajectory(spec: dict) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """What ZeRO-2's collectives carry, step by step, from one process: per step, each rank's
    gradient of its own rows at that step's parameters (flat, padded); per step, the parameters
    after it (flat, padded). The steps themselves are ``one_process``'s."""
    world = spec["ranks"]
    total = padded(sum(unit_sizes(spec)), world)
    blocks = workers.make_blocks(spec)
    params = [p for b in blocks for p in b.parameters()]
    opt = torch.optim.AdamW(params, foreach=False, **workers.ADAMW)
    local_grads, after = [], []

    def gradient(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        for b in blocks:
            x = b(x)
        workers.loss_of(x, y).backward()

    for step in range(spec["steps"]):
        ranks = []
        for rank in range(world):
            gradient(*workers.local(spec, rank, step))
            ranks.append(_flat([p.grad for p in params], total))
        local_grads.append(ranks)
        gradient(*workers.batch(spec, step))
        opt.step()
        after.append(_flat(list(params), total))
    return local_grads, after


def own_trajectory(spec: dict, outs: list[dict]) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """``zero2_trajectory`` along each rank's *own* parameters (what it reported after each step,
    right or wrong): per step, each rank's gradient of its own rows at its parameters before the
    step; per step, its parameters after it. What its collectives must carry whatever it computed."""
    world = spec["ranks"]
    total = padded(sum(unit_sizes(spec)), world)
    blocks = workers.make_blocks(spec)
    params = [p for b in blocks for p in b.parameters()]
    start = torch.cat([p.detach().reshape(-1) for p in params])
    grads: list[list[torch.Tensor]] = [[] for _ in range(spec["steps"])]
    after: list[list[torch.Tensor]] = [[] for _ in range(spec["steps"])]
    for rank, out in enumerate(outs):
        reported = out.get("after")
        if not isinstance(reported, list) or len(reported) != spec["steps"]:
            pytest.fail(f"rank {rank}: no parameters reported after each step", pytrace=False)
        for step, flat in enumerate(reported):
            if not isinstance(flat, torch.Tensor) or flat.shape != start.shape or flat.dtype != start.dtype:
                pytest.fail(f"rank {rank}: malformed parameters after step {step}", pytrace=False)
        for step in range(spec["steps"]):
            flat = start if step == 0 else reported[step - 1]
            with torch.no_grad():
                offset = 0
                for p in params:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
            for p in params:
                p.grad = None
            x, y = workers.local(spec, rank, step)
            for b in blocks:
                x = b(x)
            workers.loss_of(x, y).backward()
            grads[step].append(_flat([p.grad for p in params], total))
            after[step].append(_flat([reported[step]], total))
    return grads, after


def _check_zero2_contents(spec: dict, trajectory, outs: list[dict], whose: str = "one process") -> None:
    """The reduce-scatter of step k carries this rank's gradient of its own rows (or that / N,
    for ``op="sum"`` on a pre-divided gradient), flat in the parameters' order, padded; the
    allgather carries this rank's shard of the parameters after step k -- along ``trajectory``:
    one process's (``zero2_trajectory``, the values tests) or the rank's own (``own_trajectory``,
    the communication test, right values or not). A rank that trains on data it was not given,
    or a full AdamW on every rank, sends something else."""
    local_grads, after = trajectory
    world = spec["ranks"]
    size = sum(unit_sizes(spec))
    shard = padded(size, world) // world
    for rank, out in enumerate(outs):
        for step in range(spec["steps"]):
            calls = {c["function"]: c for c in reversed(out["calls"]) if c["step"] == step}
            where = f"rank {rank}, step {step}"
            scatter, gather = calls.get("reduce_scatter"), calls.get("allgather")
            if scatter is None or gather is None or "input" not in scatter or "input" not in gather:
                pytest.fail(f"{where}: expected a reduce_scatter and an allgather in step()", pytrace=False)
            mine = local_grads[step][rank]
            got = scatter["input"]
            where += f" (along {whose} parameters)" if whose == "its own" else ""
            if got.shape != mine.shape or not any(
                (got - want).abs().max().item() <= TOLERANCE for want in (mine, mine / world)
            ):
                pytest.fail(
                    f"{where}: the reduce_scatter did not carry this rank's gradient of its own rows "
                    "(the parameters' gradients in their order, flattened, zeros to pad)",
                    pytrace=False,
                )
            lo, hi = rank * shard, min((rank + 1) * shard, size)
            want = (after[step][rank] if whose == "its own" else after[step])[lo:hi]
            got = gather["input"]
            if got.numel() != shard or (hi > lo and (got[: hi - lo] - want).abs().max().item() > TOLERANCE):
                pytest.fail(
                    f"{where}: the allgather did not carry this rank's shard of the updated parameters "
                    f"(flat positions {lo}..{hi} after the step)",
                    pytrace=False,
                )


def check_zero2_values(spec: dict):
    want, _ = one_process(spec)
    trajectory = zero2_trajectory(spec)

    def check(outs: list[dict]) -> None:
        for rank, out in enumerate(outs):
            got = out["params"]
            if len(got) != len(want):
                message = f"rank {rank} reported {len(got)} parameters, expected {len(want)}"
                pytest.fail(message, pytrace=False)
            for i, (g, w) in enumerate(zip(got, want)):
                _close(g, w, f"rank {rank}, parameter {i} after {spec['steps']} steps")
        _check_zero2_contents(spec, trajectory, outs)

    return check


def check_zero2_communication(spec: dict):
    world = spec["ranks"]
    total = padded(sum(unit_sizes(spec)), world)
    shard = total // world
    per_step = 2 * shard * (world - 1) * 8

    def check(outs: list[dict]) -> None:
        for rank, out in enumerate(outs):
            for step in range(spec["steps"]):
                calls = [(c["function"], c["numel"]) for c in out["calls"] if c["step"] == step]
                want = [("reduce_scatter", total), ("allgather", shard)]
                if calls != want:
                    pytest.fail(
                        f"rank {rank}, step {step}: the collectives called in step() were {calls}, "
                        f"expected one reduce_scatter of the padded gradient ({total} elements) "
                        f"and one allgather of the shard ({shard})",
                        pytrace=False,
                    )
            if out["bytes"] != [per_step] * spec["steps"]:
                pytest.fail(
                    f"rank {rank}: the transport sent {out['bytes']} bytes per step(), expected "
                    f"2 x {total} x ({world}-1)/{world} x 8 = {per_step}",
                    pytrace=False,
                )
            if out["grads_left"]:
                pytest.fail(
                    f"rank {rank}: {out['grads_left']} parameters still had a .grad after step() "
                    "(ZeRO-2 keeps only the shard's averaged gradient)",
                    pytrace=False,
                )
        _check_zero2_contents(spec, own_trajectory(spec, outs), outs, "its own")

    return check


# --- task 2 ----------------------------------------------------------------------------------
def _gathered_params(spec: dict, outs: list[dict], key: str, what: str) -> list[list[torch.Tensor]]:
    """Each unit's full flat vector from the ranks' shards (rank order)."""
    world = spec["ranks"]
    sizes = unit_sizes(spec)
    units = []
    for i, size in enumerate(sizes):
        pieces = []
        for rank, out in enumerate(outs):
            shards = out[key]
            if shards is None or len(shards) != len(sizes) or shards[i] is None:
                pytest.fail(f"rank {rank}: {what}: expected one shard per unit ({len(sizes)})", pytrace=False)
            want = padded(size, world) // world
            if tuple(shards[i].shape) != (want,):
                pytest.fail(
                    f"rank {rank}: {what}: unit {i}'s shard has shape {tuple(shards[i].shape)}, expected "
                    f"({want},) (the unit's {size} elements padded to a multiple of {world}, / {world})",
                    pytrace=False,
                )
            pieces.append(shards[i])
        units.append(torch.cat(pieces))
    return units


def check_zero3_values(spec: dict):
    want, first = one_process(spec)
    world = spec["ranks"]
    want_units = unit_flats(spec, want, world)
    first_units = unit_flats(spec, first, world)

    def check(outs: list[dict]) -> None:
        got = _gathered_params(spec, outs, "first_grads", "the shards' .grad after the first backward")
        for i, (g, w) in enumerate(zip(got, first_units)):
            _close(g, w, f"unit {i}'s gradient (its shards after the first backward, averaged over ranks)")
        got = _gathered_params(spec, outs, "shards", "the shards")
        for i, (g, w) in enumerate(zip(got, want_units)):
            _close(g, w, f"unit {i}'s weights (its shards after {spec['steps']} steps)")

    return check


def check_zero3_communication(spec: dict):
    world = spec["ranks"]
    sizes = unit_sizes(spec)
    units = len(sizes)
    shard = [padded(s, world) // world for s in sizes]
    per_step = 3 * sum(shard) * (world - 1) * 8

    def check(outs: list[dict]) -> None:
        for rank, out in enumerate(outs):
            where = f"rank {rank}"
            for step in range(spec["steps"]):
                calls = [c for c in out["calls"] if c["step"] == step]
                gathers = sorted(c["numel"] for c in calls if c["function"] == "allgather")
                scatters = sorted(c["numel"] for c in calls if c["function"] == "reduce_scatter")
                others = sorted({c["function"] for c in calls} - {"allgather", "reduce_scatter"})
                want_scatters = sorted(padded(s, world) for s in sizes)
                if others or gathers != sorted(shard * 2) or scatters != want_scatters:
                    pytest.fail(
                        f"{where}, step {step}: {len(gathers)} allgathers, {len(scatters)} reduce-scatters"
                        f"{' and ' + ', '.join(others) if others else ''}; expected one allgather of each "
                        f"unit's shard in forward and one in backward, one reduce-scatter of each unit's "
                        f"padded gradient ({units} units), nothing else",
                        pytrace=False,
                    )
                events = [e for e in out["census"] if e[4] == step]
                forwards = [e for e in events if e[0] == "F"][:units]
                for kind, index, holding, _issued, _ in events:
                    if holding > 2:
                        pytest.fail(
                            f"{where}, step {step}: {holding} blocks held their weights at block {index}'s "
                            f"{'forward' if kind == 'F' else 'backward'} (at most 2: the one computing "
                            "and the one prefetched)",
                            pytrace=False,
                        )
                for _kind, index, _holding, issued, _ in forwards:
                    if index + 1 < units and issued < index + 2:
                        pytest.fail(
                            f"{where}, step {step}: when block {index} ran forward, {issued} allgathers had "
                            f"been issued in the step: block {index + 1}'s was not yet (prefetch one ahead)",
                            pytrace=False,
                        )
                backwards = [e for e in events if e[0] == "B"]
                for _kind, index, _holding, issued, _ in backwards:
                    if index > 0 and issued < units + (units - index) + 1:
                        pytest.fail(
                            f"{where}, step {step}: when block {index}'s backward began, block "
                            f"{index - 1}'s allgather had not been issued (prefetch one ahead)",
                            pytrace=False,
                        )
            if out["between"] != [0] * spec["steps"] or out["after"] != [0] * spec["steps"]:
                pytest.fail(
                    f"{where}: blocks holding weights after forward {out['between']}, after backward "
                    f"{out['after']}; expected none",
                    pytrace=False,
                )
            if out["bytes"] != [per_step] * spec["steps"]:
                pytest.fail(
                    f"{where}: the transport sent {out['bytes']} bytes per step, expected "
                    f"3 x {sum(shard)} x ({world}-1) x 8 = {per_step}",
                    pytrace=False,
                )

    return check


# --- task 3: measured ------------------------------------------------------------------------
def peak_bytes(events: torch.Tensor, window: list[int]) -> int:
    """The most bytes alive at once inside ``window``, counting every allocation since the
    profiler started (a free matched to its allocation by address; frees of tensors allocated
    before the profiler started are not subtracted)."""
    start, end = int(window[0]), int(window[1])
    live: dict[int, int] = {}
    total = peak = 0
    for t, size, ptr in events.tolist():
        if size > 0:
            live[ptr] = live.get(ptr, 0) + size
            total += size
        elif ptr in live:
            total -= live.pop(ptr)
        if start <= t <= end:
            peak = max(peak, total)
    return peak


def model_states(spec: dict) -> float:
    """ZeRO-3's fp32 AdamW model states per rank: 16 bytes x Psi / N (Psi padded per unit)."""
    world = spec["ranks"]
    return 16 * sum(padded(s, world) for s in unit_sizes(spec)) / world


def check_peak(spec: dict):
    want, _ = one_process(spec, torch.float32)
    world = spec["ranks"]
    want_units = unit_flats(spec, want, world)

    def check(outs: list[dict]) -> float:
        got = _gathered_params(spec, outs, "shards", "the shards")
        for i, (g, w) in enumerate(zip(got, want_units)):
            _close(g, w, f"unit {i}'s weights after the measured steps", TOLERANCE_32)
        peaks = []
        for rank, out in enumerate(outs):
            window = out["window"]
            if len(window) != 2 or window[0] < 0 or out["events"].shape[0] == 0:
                pytest.fail(f"rank {rank}: the profiler recorded no steps", pytrace=False)
            peaks.append(peak_bytes(out["events"], window))
            if peaks[-1] < model_states(spec):  # the shards, their gradients and AdamW's two moments
                pytest.fail(
                    f"rank {rank}: the profiler saw at most {peaks[-1]:,} bytes alive, below the "
                    f"{model_states(spec):,.0f} that the shards, their gradients and AdamW's moments "
                    "alone take (16 Psi / N): allocations the profiler does not see (another thread?)",
                    pytrace=False,
                )
        return max(peaks) / model_states(spec)

    return check

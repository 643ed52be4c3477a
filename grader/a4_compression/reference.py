"""The trusted side of assignment 4's hidden tests: DGC written a second time, and the checks.

Nothing here runs next to student code, and nothing here uses the library's compressor
(``minidist.parallel.compression``) or the solution: DGC is written again from the stub's
specification, in plain Python where the order matters (the threshold, the choice among the
chosen, the tie-break), so that a bug in the library or the solution is not graded as right.
``tests/grader/test_grade_a4.py`` checks this reference against the library on random data.

Each ``*_check`` returns a function of the ranks' reports (read back as data) that raises
``AssertionError`` with a message a student may read (``grading.redact`` removes the expected
values).
"""

from __future__ import annotations

import math

import torch

from . import workers

RTOL, ATOL = 1e-10, 1e-12  # float64 sequences: the same operations in the same order
RTOL32, ATOL32 = 1e-5, 1e-6  # float32 training: rounding only


# --- DGC, the second time ----------------------------------------------------------------------
def sparsity(step: int, config: dict) -> float:
    stage_steps = config.get("warmup_stage_steps", 0)
    stages = list(config.get("warmup_sparsities", (0.75, 0.9375, 0.984375, 0.996))) if stage_steps else []
    stage = step // stage_steps if stage_steps else 0
    return float(stages[stage]) if stage < len(stages) else float(config.get("sparsity", 0.999))


def slots(numel: int, sparsity_: float) -> int:
    return max(1, min(numel, math.ceil(numel * (1.0 - sparsity_) - 1e-9)))


def clipped(grad: torch.Tensor, clip_norm: float, world_size: int) -> torch.Tensor:
    threshold = clip_norm * math.sqrt(world_size)  # the paper's clip_norm / sqrt(N) on grad / N
    norm = torch.linalg.vector_norm(grad)
    return grad * (threshold / norm) if norm > threshold else grad.clone()


def chosen_indices(values: torch.Tensor, k: int, config: dict, generator: torch.Generator) -> list[int]:
    """The stub's recipe, in Python lists (ascending indices)."""
    n = values.numel()
    if k >= n:
        return list(range(n))
    magnitude = values.abs()
    size = min(n, max(config.get("min_sample", 256), math.ceil(config.get("sample_ratio", 0.01) * n)))
    if size == n:
        sample = magnitude.tolist()
    else:
        sample = magnitude[torch.randint(n, (size,), generator=generator)].tolist()
    ks = max(1, math.ceil(size * k / n))
    threshold = sorted(sample, reverse=True)[ks - 1]
    m = magnitude.tolist()
    chosen = [i for i in range(n) if m[i] >= threshold]
    if len(chosen) > k:
        chosen = sorted(sorted(chosen, key=lambda i: (-m[i], i))[:k])
    return chosen


class Compressor:
    """One rank's DGC state for one bucket; ``step(grad)`` -> (indices list, values tensor)."""

    def __init__(self, numel: int, config: dict, world_size: int, generator: torch.Generator, dtype) -> None:
        self.u = torch.zeros(numel, dtype=dtype)
        self.v = torch.zeros(numel, dtype=dtype)
        self.t = 0
        self.config, self.world_size, self.generator = config, world_size, generator

    def step(self, grad: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        config = self.config
        g = grad
        if config.get("clip_norm") is not None:
            g = clipped(grad, config["clip_norm"], self.world_size)
        self.u = self.u * config.get("momentum", 0.9) + g
        self.v = self.v + self.u
        k = slots(grad.numel(), sparsity(self.t, config))
        chosen = chosen_indices(self.v, k, config, self.generator)
        where = torch.tensor(chosen, dtype=torch.long)
        values = self.v[where].clone()
        self.v[where] = 0.0
        self.u[where] = 0.0
        self.t += 1
        return chosen, values


def sequence(spec: dict) -> dict:
    grads = workers.gradient_sequence(spec)
    generator = torch.Generator().manual_seed(spec["sample_seed"])
    comp = Compressor(spec["n"], spec["config"], spec["world_size"], generator, torch.float64)
    steps = [comp.step(grad) for grad in grads]
    return {"steps": steps, "velocity": comp.u, "accumulated": comp.v, "step": comp.t}


def simulate(spec: dict) -> tuple[dict, float]:
    """DDP with DGC on ``spec["ranks"]`` ranks, simulated in one process (one bucket: the whole
    model, its parameters in the order DDP fills a bucket, last first; rank r samples with a
    generator seeded ``config.seed * 1000 + r``, as the hook's): every rank's local gradient,
    compressed with its own state; the sparse vectors added in rank order, divided by N; SGD.
    Returns (parameters, final loss)."""
    model = workers.make_model(spec)
    x, y = workers.make_data(spec)
    params = [p for _, p in reversed(list(model.named_parameters()))]
    numel = sum(p.numel() for p in params)
    ranks = spec["ranks"]
    comps = [
        Compressor(
            numel,
            spec["config"],
            ranks,
            torch.Generator().manual_seed(spec["config"].get("seed", 0) * 1000 + r),
            torch.float32,
        )
        for r in range(ranks)
    ]
    for step in range(spec["steps"]):
        dense = torch.zeros(numel, dtype=torch.float32)
        for rank in range(ranks):
            rows = workers.batch_rows(spec, step, rank)
            model.zero_grad(set_to_none=True)
            workers.loss_of(model, x[rows], y[rows]).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            chosen, values = comps[rank].step(flat)
            dense.index_add_(0, torch.tensor(chosen, dtype=torch.long), values)
        dense.div_(ranks)
        with torch.no_grad():
            offset = 0
            for p in params:
                p.add_(dense[offset : offset + p.numel()].view_as(p), alpha=-spec["lr"])
                offset += p.numel()
    with torch.no_grad():
        loss = float(workers.loss_of(model, x, y))
    return {name: p.detach().clone() for name, p in model.named_parameters()}, loss


def dense_momentum_sgd(spec: dict) -> float:
    """The final loss of plain momentum SGD on the same global batches (one process)."""
    model = workers.make_model(spec)
    x, y = workers.make_data(spec)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=spec["lr"], momentum=spec["config"].get("momentum", 0.9)
    )
    per_step = spec["ranks"] * spec["local_batch"]
    for step in range(spec["steps"]):
        start = (step * per_step) % spec["rows"]
        optimizer.zero_grad(set_to_none=True)
        workers.loss_of(model, x[start : start + per_step], y[start : start + per_step]).backward()
        optimizer.step()
    with torch.no_grad():
        return float(workers.loss_of(model, x, y))


def initial_loss(spec: dict) -> float:
    x, y = workers.make_data(spec)
    with torch.no_grad():
        return float(workers.loss_of(workers.make_model(spec), x, y))


# --- comparing ---------------------------------------------------------------------------------
def assert_close(where: str, got, expected: torch.Tensor, rtol: float = RTOL, atol: float = ATOL) -> None:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{where}: expected a tensor, got {type(got).__name__}")
    if got.shape != expected.shape:
        raise AssertionError(f"{where}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    got = got.to(expected.dtype)
    bad = ~torch.isclose(got, expected, rtol=rtol, atol=atol)
    if bad.any():
        index = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{where}: element {index} is {got[index].item():.10g}, expected {expected[index].item():.10g} "
            f"({int(bad.sum())} of {expected.numel()} elements differ)"
        )


def _as_index_list(where: str, got) -> list[int]:
    if not isinstance(got, torch.Tensor) or got.dim() != 1 or got.dtype.is_floating_point:
        raise AssertionError(f"{where}: expected a 1-d integer tensor of indices, got {got!r:.80}")
    return [int(i) for i in got.tolist()]


def _same_indices(where: str, got: list[int], expected: list[int]) -> None:
    if got == expected:
        return
    if got != sorted(got):
        raise AssertionError(f"{where}: the indices are not in ascending order")
    extra, missing = sorted(set(got) - set(expected)), sorted(set(expected) - set(got))
    raise AssertionError(
        f"{where}: {len(got)} indices chosen, the recipe chooses {len(expected)}; "
        f"{len(extra)} chosen that the recipe does not choose (e.g. {extra[:3]}), {len(missing)} "
        "the recipe chooses are missing (sampled threshold, >=, stable tie-break: see the docstring)"
    )


def schedule_check(what: str, cases: list[dict]):
    expected = [[sparsity(step, c["config"]) for step in c["steps"]] for c in cases]

    def check(outs: list) -> None:
        got = outs[0]
        for index, (case, mine, right) in enumerate(zip(cases, got, expected)):
            for step, a, b in zip(case["steps"], mine, right):
                if a != b:
                    raise AssertionError(
                        f"{what}, case {index} (warmup_stage_steps={case['config']['warmup_stage_steps']}, "
                        f"sparsity={case['config']['sparsity']}): step {step} gives {a}, expected {b}"
                    )

    return check


def clip_check(what: str, cases: list[dict]):
    def check(outs: list) -> None:
        for index, (case, out) in enumerate(zip(cases, outs[0])):
            grad = workers.vector(case) * case["scale"]
            where = f"{what}, case {index} (clip_norm={case['clip_norm']}, world_size={case['world_size']})"
            if out["same_object"]:
                raise AssertionError(f"{where}: returned the input itself; return a new tensor")
            assert_close(f"{where}, the input after the call (must not change)", out["input"], grad)
            assert_close(where, out["clipped"], clipped(grad, case["clip_norm"], case["world_size"]))

    return check


def select_check(what: str, cases: list[dict]):
    def check(outs: list) -> None:
        for index, (case, got) in enumerate(zip(cases, outs[0])):
            generator = torch.Generator().manual_seed(case["sample_seed"])
            expected = chosen_indices(workers.vector(case), case["k"], case["config"], generator)
            where = f"{what}, case {index} (n={case['n']}, k={case['k']})"
            _same_indices(where, _as_index_list(where, got), expected)

    return check


def sequence_check(what: str, spec: dict):
    def check(outs: list) -> None:
        expected, got = sequence(spec), outs[0]
        for step, ((chosen, values), mine) in enumerate(zip(expected["steps"], got["steps"])):
            where = f"{what}: step {step}"
            if not mine["grad_unchanged"]:
                raise AssertionError(f"{where}: compress_step modified grad; leave it as it is")
            _same_indices(where, _as_index_list(where, mine["indices"]), chosen)
            assert_close(f"{where}, the values sent", mine["values"], values)
        assert_close(f"{what}: velocity u after {spec['steps']} steps", got["velocity"], expected["velocity"])
        assert_close(
            f"{what}: accumulation v after {spec['steps']} steps", got["accumulated"], expected["accumulated"]
        )
        if got["step"] != expected["step"]:
            raise AssertionError(f"{what}: state.step is {got['step']} after {spec['steps']} steps")

    return check


def feedback_check(what: str, spec: dict):
    """Error feedback loses nothing: with momentum 0 and no clipping, everything sent plus the
    final accumulation equals the sum of the gradients (whatever was chosen). So that sending
    nothing does not pass: every step sends between 1 and k distinct indices (k of that step),
    and something nonzero is sent over the sequence."""

    def check(outs: list) -> None:
        got = outs[0]
        total = torch.stack(workers.gradient_sequence(spec)).sum(0)
        if not isinstance(got["accumulated"], torch.Tensor) or got["accumulated"].shape != total.shape:
            raise AssertionError(f"{what}: state.accumulated is not a tensor of shape {tuple(total.shape)}")
        delivered = got["accumulated"].to(torch.float64).clone()
        sent_something = False
        for step, mine in enumerate(got["steps"]):
            where = f"{what}: step {step}"
            chosen = _as_index_list(where, mine["indices"])
            k = slots(spec["n"], sparsity(step, spec["config"]))
            if not 1 <= len(chosen) <= k or len(set(chosen)) != len(chosen):
                raise AssertionError(
                    f"{where}: {len(chosen)} indices ({len(set(chosen))} distinct); send between 1 and "
                    f"k = {k} distinct indices"
                )
            if not all(0 <= i < spec["n"] for i in chosen):
                raise AssertionError(f"{where}: an index outside 0..{spec['n'] - 1}")
            values = mine["values"]
            if not isinstance(values, torch.Tensor) or values.shape != (len(chosen),):
                raise AssertionError(f"{where}: expected one value per index")
            sent_something = sent_something or bool((values != 0).any())
            indices = torch.tensor(chosen, dtype=torch.long)
            delivered.index_add_(0, indices, values.to(torch.float64))
        if not sent_something:
            raise AssertionError(f"{what}: every value sent was 0; send v at the chosen indices")
        assert_close(f"{what}: (everything sent) + (what is left in v)", delivered, total, 1e-9, 1e-12)

    return check


def simulation_check(what: str, spec: dict):
    def check(outs: list) -> None:
        params, _ = simulate(spec)
        applied_check(what, spec, outs)
        for rank, out in enumerate(outs):
            for name, value in params.items():
                where = f"{what}: rank {rank}, '{name}' after {spec['steps']} SGD steps"
                assert_close(where, out["params"][name], value, RTOL32, ATOL32)

    return check


def _check_payload_sizes(where: str, out: dict) -> None:
    """The payloads' logged extents tile the logged payload tensor exactly, in order: the sizes
    come from the tensor the grader reads here, not from a count made in the worker (a review's
    torch-function mode made the worker's ``numel()`` report 2 k for a dense payload)."""
    at = 0
    for c in out["calls"]:
        if "payload" in c:
            start, length = c["payload"]
            if start != at or length < 0:
                raise AssertionError(f"{where}: the logged payloads do not follow each other")
            at += length
    if not isinstance(out.get("payloads"), torch.Tensor) or out["payloads"].numel() != at:
        raise AssertionError(f"{where}: the logged payloads' sizes do not add up to what was logged")


def _check_sends(where: str, out: dict, step: int, config: dict) -> list[int]:
    """One rank, one step: the hook ran, and every collective in backward is an asynchronous
    allgather of 8 k bytes, one per hook call (k of that bucket and step). Returns those sizes."""
    hooks = [h for h in out["hooks"] if h[0] == step]
    if not hooks:
        raise AssertionError(f"{where}: DDP never called the hook")
    expected = sorted(8 * slots(numel, sparsity(step, config)) for _, _, numel in hooks)
    calls = [c for c in out["calls"] if c["phase"] == step]
    others = sorted({c["function"] for c in calls if c["function"] != "allgather"})
    if others:
        raise AssertionError(f"{where}: the hook called {others}; DGC sends by one allgather per bucket only")
    _check_payload_sizes(where, out)
    for c in calls:  # the logged size is the logged payload's: int32, 4 bytes an element
        payload = c.get("payload")
        if not isinstance(payload, list) or len(payload) != 2 or 4 * payload[1] != c["bytes"]:
            raise AssertionError(f"{where}: an allgather whose logged size is not its int32 payload's")
    got = sorted(c["bytes"] for c in calls)
    if got != expected:
        raise AssertionError(
            f"{where} (sparsity {sparsity(step, config)}): allgathers of {got} bytes, expected one per "
            f"bucket of 8 k bytes: {expected}"
        )
    if not all(c["async_op"] for c in calls):
        raise AssertionError(
            f"{where}: an allgather with async_op=False blocks backward; launch it with "
            "async_op=True and wait in SparseWork.wait()"
        )
    return expected


# --- what SGD applied: the mean of what was allgathered ----------------------------------------
EPS32 = torch.finfo(torch.float32).eps


def unpacked(where: str, payload: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The grader's own reading of one payload in the wire format of ``pack``, int32
    ``[value bits (k) | indices (k)]``: (indices as int64, values as float32).

    It must be what the compressor writes: a 1-d int32 tensor of 2 k slots whose pairs, padding
    (index 0, value bits 0) aside, lie at distinct indices of the bucket (0 .. numel - 1).
    """
    if payload.dtype != torch.int32 or payload.dim() != 1 or payload.numel() % 2:
        raise AssertionError(f"{where}: the payload is not pack's wire format (1-d int32, 2 k slots)")
    k = payload.numel() // 2
    bits, indices = payload[:k], payload[k:].long()
    real = indices[(bits != 0) | (indices != 0)]
    if ((real < 0) | (real >= numel)).any():
        raise AssertionError(f"{where}: the payload holds an index outside the bucket (0..{numel - 1})")
    if real.unique().numel() != real.numel():
        raise AssertionError(f"{where}: the payload holds an index twice; send each chosen index once")
    return indices, bits.view(torch.float32)


def _same_bits(a, b) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _hooks_by_step(where: str, out: dict, steps: int) -> list[list[tuple[int, int, int]]]:
    """Each step's hook calls as (bucket index, elements, where its bucket starts in ``applied``)."""
    by_step: list[list[tuple[int, int, int]]] = [[] for _ in range(steps)]
    at = 0
    for step, bucket, numel in out["hooks"]:
        if step is not None and 0 <= step < steps:
            by_step[step].append((bucket, numel, at))
            at += numel
    if out["applied"].numel() != at:
        raise AssertionError(f"{where}: the buckets' gradients after backward were not all recorded")
    return by_step


def applied_check(what: str, spec: dict, outs: list) -> None:
    """What every rank's SGD applied is the mean of what the ranks allgathered, and nothing else.

    (a) every rank's final parameters are equal, bit for bit;
    (b) every step, every bucket: the gradient DDP applied (its buffer once backward is over) is
        the mean of the allgathered payloads -- the copies the transport carried, logged on
        every rank and read with the grader's own ``unpacked`` -- added in rank order, divided
        by N (up to the rounding of adding the N rows in another order);
    (c) each payload is in the compressor's wire format (``unpacked``);
    and SGD replayed here from those gradients ends at each rank's final parameters (nothing
    changed them between the record and the step).

    The allgathers of a step are paired with its hook calls in order (the j-th allgather of every
    rank carries the j-th bucket): so data that reached a rank by any other way (files, shared
    memory, a point-to-point message) cannot be in its update.
    """
    steps, ranks = spec["steps"], len(outs)
    names = {name for name, _ in workers.make_model(spec).named_parameters()}
    for rank, out in enumerate(outs):
        if not isinstance(out["params"], dict) or set(out["params"]) != names:
            raise AssertionError(f"{what}: rank {rank}: the parameters' names differ from the model's")
    hooks = [_hooks_by_step(f"{what}: rank {rank}", out, steps) for rank, out in enumerate(outs)]
    for rank, out in enumerate(outs[1:], start=1):
        for name, value in outs[0]["params"].items():
            if not _same_bits(value, out["params"].get(name)):
                raise AssertionError(
                    f"{what}: after {spec['steps']} steps rank {rank}'s '{name}' differs from rank 0's; "
                    "every rank must apply the same update, the mean of what the ranks allgathered"
                )
    for step in range(steps):
        gathers = [
            [c for c in out["calls"] if c["phase"] == step and c["function"] == "allgather"] for out in outs
        ]
        for rank in range(ranks):
            where = f"{what}: rank {rank}, step {step}"
            _check_payload_sizes(where, outs[rank])
            if [h[:2] for h in hooks[rank][step]] != [h[:2] for h in hooks[0][step]]:
                raise AssertionError(f"{where}: DDP called the hook for other buckets than on rank 0")
            if len(gathers[rank]) != len(hooks[rank][step]):
                raise AssertionError(
                    f"{where}: {len(gathers[rank])} allgathers for {len(hooks[rank][step])} buckets; "
                    "send each bucket by one allgather: its update is the mean of what that carries"
                )
        for j, (bucket, numel, _) in enumerate(hooks[0][step]):
            mean = torch.zeros(numel, dtype=torch.float32)
            size = torch.zeros(numel, dtype=torch.float32)
            for rank, out in enumerate(outs):
                where = f"{what}: rank {rank}, step {step}, bucket {bucket}"
                call = gathers[rank][j]
                if not isinstance(call.get("payload"), list):
                    raise AssertionError(
                        f"{where}: the payload is {call.get('dtype', 'no tensor')}, not pack's int32 "
                        "wire format"
                    )
                start, length = call["payload"]
                indices, values = unpacked(where, out["payloads"][start : start + length], numel)
                mean.index_add_(0, indices, values)
                size.index_add_(0, indices, values.abs())
            mean.div_(ranks)
            slack = 2 * EPS32 * size  # the N rows added in another order (0 where nothing was sent)
            for rank, out in enumerate(outs):
                at = hooks[rank][step][j][2]
                got = out["applied"][at : at + numel]
                bad = ~((got == mean) | ((got - mean).abs() <= slack) | (got.isnan() & mean.isnan()))
                if bad.any():
                    i = int(bad.nonzero()[0])
                    raise AssertionError(
                        f"{what}: rank {rank}, step {step}, bucket {bucket}: the gradient DDP applied is "
                        f"not the mean of the payloads the {ranks} ranks allgathered: element {i} is "
                        f"{got[i].item():.6g}, expected {mean[i].item():.6g} ({int(bad.sum())} of {numel} "
                        "elements differ). SparseWork.wait must return the allgathered rows, unpacked, "
                        "added in rank order and divided by N: the update is what was sent, nothing else"
                    )
    for rank, out in enumerate(outs):
        model = workers.make_model(spec)
        named = list(model.named_parameters())
        optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"])
        for step in range(steps):
            calls = hooks[rank][step]
            for (name, p), place in zip(named, out["places"][step]):
                j, offset = place if place is not None else (-1, -1)
                if not (0 <= j < len(calls) and 0 <= offset <= calls[j][1] - p.numel()):
                    raise AssertionError(f"{what}: rank {rank}, step {step}: '{name}'.grad is in no bucket")
                start = calls[j][2] + offset
                p.grad = out["applied"][start : start + p.numel()].view_as(p).clone()
            optimizer.step()
        for name, p in named:
            assert_close(
                f"{what}: rank {rank}, '{name}' after {steps} steps, against SGD with the gradients "
                "DDP applied",
                out["params"][name],
                p.detach(),
                RTOL32,
                ATOL32,
            )


def bytes_check(what: str, spec: dict):
    """Every rank, every step: one asynchronous allgather of 8 k bytes per hook call (k of that
    step), no other collective in backward, and the transport sent (N - 1) * 8 k bytes per bucket;
    and what was applied is the mean of what was allgathered (``applied_check``)."""
    ranks = spec["ranks"]

    def check(outs: list) -> None:
        for rank, out in enumerate(outs):
            for step in range(spec["steps"]):
                where = f"{what}: rank {rank}, step {step}"
                expected = _check_sends(where, out, step, spec["config"])
                wire = (ranks - 1) * sum(expected)
                if out["sent"][step] != wire:
                    raise AssertionError(
                        f"{where}: the transport sent {out['sent'][step]} bytes in "
                        f"backward, expected {wire} ((N-1) x 8 k per bucket, the ring allgather)"
                    )
        applied_check(what, spec, outs)

    return check


def loss_of_params(spec: dict, params) -> float:
    """The loss on the whole data set of ``make_model(spec)`` holding ``params`` (a rank's
    report), computed here; raises ``AssertionError`` if they are not the model's parameters
    (names, shapes) or not finite."""
    model = workers.make_model(spec)
    own = dict(model.named_parameters())
    if not isinstance(params, dict) or set(params) != set(own):
        raise AssertionError("the parameters' names differ from the model's")
    with torch.no_grad():
        for name, p in own.items():
            value = params[name]
            if not isinstance(value, torch.Tensor) or value.shape != p.shape:
                raise AssertionError(f"'{name}' is not a tensor of shape {tuple(p.shape)}")
            if not torch.isfinite(value).all():
                raise AssertionError(f"'{name}' holds NaN or inf")
            p.copy_(value.to(p.dtype))
        x, y = workers.make_data(spec)
        return float(torch.nn.functional.cross_entropy(model(x), y))


def convergence_check(what: str, spec: dict, factor: float):
    """Something was compressed (every step: the collectives of ``bytes_check``, one
    asynchronous allgather of 8 k bytes per bucket, nothing else), what was applied is the mean
    of what was allgathered (``applied_check``), and every rank's final parameters reach a loss,
    computed here from them, at most ``factor`` times dense momentum SGD's (same batches)."""

    def check(outs: list) -> None:
        for rank, out in enumerate(outs):
            for step in range(spec["steps"]):
                _check_sends(f"{what}: rank {rank}, step {step}", out, step, spec["config"])
        losses = []
        for rank, out in enumerate(outs):
            try:
                losses.append(loss_of_params(spec, out["params"]))
            except AssertionError as error:
                raise AssertionError(f"{what}: rank {rank}: {error}") from None
        applied_check(what, spec, outs)
        dense, start = dense_momentum_sgd(spec), initial_loss(spec)
        for rank, loss in enumerate(losses):
            if not loss <= factor * dense:
                raise AssertionError(
                    f"{what}: rank {rank}: after {spec['steps']} steps the loss is {loss:.4g} (it started "
                    f"at {start:.4g}); it must be at most {factor:g} x the loss dense momentum SGD reaches "
                    "on the same batches (missing error feedback or momentum correction shows here)"
                )

    return check


# --- the measured test: bytes to a target loss ----------------------------------------------
def dense_ring_bytes(numel: int, ranks: int) -> int:
    """What one rank sends in a float32 ring allreduce of ``numel`` entries: 2 (N-1)/N x 4 n."""
    return round(2 * (ranks - 1) / ranks * 4 * numel)


def dense_steps_to(spec: dict, target: float) -> int | None:
    """Momentum SGD on the same global batches, one process (the dense run the measured test
    compares with): the first step after which the whole data set's loss is at most ``target``."""
    model = workers.make_model(spec)
    x, y = workers.make_data(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=spec["dense_momentum"])
    per_step = spec["ranks"] * spec["local_batch"]
    for step in range(spec["steps"]):
        start = (step * per_step) % spec["rows"]
        optimizer.zero_grad(set_to_none=True)
        workers.loss_of(model, x[start : start + per_step], y[start : start + per_step]).backward()
        optimizer.step()
        with torch.no_grad():
            if float(workers.loss_of(model, x, y)) <= target:
                return step
    return None


def first_at_most(losses: list[float], target: float) -> int | None:
    return next((step for step, loss in enumerate(losses) if loss <= target), None)


def measured_check(what: str, spec: dict):
    """The measured test: the student's ``measured_hook()`` trains ``spec``'s MLP; the value is
    dense bytes / the student's bytes, each counted up to the step whose loss first reaches
    ``spec["target"]``. Everything is measured here:

    * the student's run: every step, one asynchronous allgather of an int32 payload in pack's
      format per bucket (one bucket: ``bucket_mb`` holds the model) and no other collective;
      the update is replayed here from the payloads alone (their mean, read with ``unpacked``,
      times the learning rate), and the loss on the whole data set computed after every step;
      every rank's final parameters must be the replay's (so the ranks applied what was sent);
    * its bytes: the transport's own count per backward, which must equal (N - 1) x the bytes
      of the logged payloads, and nothing sent in the loop outside backward;
    * dense: momentum SGD on the same batches in this process; its bytes a float32 ring
      allreduce of the model per step (``dense_ring_bytes``).

    Not reaching the target in ``spec["steps"]`` steps fails the test."""
    ranks, target = spec["ranks"], spec["target"]

    def check(outs: list) -> float:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # small matrices: faster, and the same arithmetic in every grading
        try:
            return measure(outs)
        finally:
            torch.set_num_threads(threads)

    def measure(outs: list) -> float:
        model = workers.make_model(spec)
        x, y = workers.make_data(spec)
        params = [p for _, p in reversed(list(model.named_parameters()))]  # DDP's one bucket
        numel = sum(p.numel() for p in params)
        for rank, out in enumerate(outs[1:], start=1):
            for name, value in outs[0]["params"].items():
                if not _same_bits(value, out["params"].get(name)):
                    raise AssertionError(
                        f"{what}: rank {rank}'s '{name}' differs from rank 0's at the end; every rank "
                        "must apply the same update, the mean of what the ranks allgathered"
                    )
        losses, wire = [], []
        for step in range(spec["steps"]):
            mean = torch.zeros(numel, dtype=torch.float32)
            for rank, out in enumerate(outs):
                where = f"{what}: rank {rank}, step {step}"
                hooks = [h for h in out["hooks"] if h[0] == step]
                if [h[1:] for h in hooks] != [[0, numel]]:
                    raise AssertionError(f"{where}: expected one hook call, for the one bucket of {numel}")
                calls = [c for c in out["calls"] if c["phase"] == step]
                if [c["function"] for c in calls] != ["allgather"] or not calls[0]["async_op"]:
                    raise AssertionError(
                        f"{where}: the hook must send its bucket by ONE asynchronous md.allgather and "
                        f"nothing else; it called {[c['function'] for c in calls]}"
                    )
                if not isinstance(calls[0].get("payload"), list):
                    raise AssertionError(f"{where}: the payload is not pack's int32 wire format")
                begin, length = calls[0]["payload"]
                indices, values = unpacked(where, out["payloads"][begin : begin + length], numel)
                mean.index_add_(0, indices, values)
                carried = (ranks - 1) * 4 * length  # a ring allgather: N - 1 blocks of the payload
                if out["sent"][step] != carried:
                    raise AssertionError(
                        f"{where}: the transport sent {out['sent'][step]} bytes in backward, expected "
                        f"{carried} ((N-1) x the payload's bytes): nothing but the allgather may travel"
                    )
                if rank == 0:
                    wire.append(carried)
            mean.div_(ranks)
            with torch.no_grad():
                offset = 0
                for p in params:
                    p.add_(mean[offset : offset + p.numel()].view_as(p), alpha=-spec["lr"])
                    offset += p.numel()
                losses.append(float(workers.loss_of(model, x, y)))
        for rank, out in enumerate(outs):
            if any(c["phase"] is None for c in out["calls"]) or out["sent_in_training"] != sum(out["sent"]):
                raise AssertionError(
                    f"{what}: rank {rank} communicated outside backward; only the hook's allgathers may"
                )
        for name, p in model.named_parameters():
            assert_close(
                f"{what}: rank 0, '{name}' at the end, against SGD replayed from the mean of the payloads",
                outs[0]["params"][name],
                p.detach(),
                RTOL32,
                ATOL32,
            )
        reached = first_at_most(losses, target)
        if reached is None:
            raise AssertionError(
                f"{what}: the loss never reached {target:g} in {spec['steps']} steps (lowest "
                f"{min(losses):.4g}); send more, or send better"
            )
        dense = dense_steps_to(spec, target)
        if dense is None:  # the grader's own setting is wrong
            raise RuntimeError(f"{what}: dense momentum SGD does not reach {target:g}")
        return (dense + 1) * dense_ring_bytes(numel, ranks) / sum(wire[: reached + 1])

    return check

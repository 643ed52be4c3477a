"""The trusted side of assignment 3's hidden tests: references computed in one process, and checks.

Nothing here runs next to student code. ``workers.py`` builds the models and data from a JSON
spec; so does this module, and trains them in one process on the whole batch (every rank's
rows): the DDP run must give the same gradients after the first step's backward and the same
parameters after the last AdamW step (double precision: they differ by rounding only). The
bucket rule is written here a second time (``reference_buckets``), not taken from the
solution. Each ``*_check(what, spec)`` returns a function of the ranks' reports (read back as
data) that raises ``AssertionError`` with a message a student may read (``grading.redact``
removes the expected values).
"""

from __future__ import annotations

import torch

from . import workers

MIB = 1 << 20
RTOL, ATOL = 1e-7, 1e-10  # double precision; the sum over ranks is only re-associated


def reference_buckets(named, bucket_mb: float) -> list[list[str]]:
    """Trainable parameters once each (first name), reversed, cut greedily at bucket_mb MiB."""
    seen, order = set(), []
    for name, param in named:
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            order.append((name, param.numel() * param.element_size()))
    buckets, size = [], 0
    for name, nbytes in reversed(order):
        if buckets and buckets[-1] and size + nbytes <= bucket_mb * MIB:
            buckets[-1].append(name)
            size += nbytes
        else:
            buckets.append([name])
            size = nbytes
    return buckets


def expected_buckets(spec: dict) -> tuple[list[list[str]], list[int]]:
    """The spec's model's buckets and each bucket's number of elements."""
    model = workers.make_model(spec)
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    buckets = reference_buckets(list(model.named_parameters()), spec["bucket_mb"])
    return buckets, [sum(sizes[name] for name in bucket) for bucket in buckets]


def one_process(spec: dict) -> tuple[dict, dict]:
    """(gradients after the first step's backward, parameters after the last step) in one process."""
    model = workers.make_model(spec, 0)
    optimizer = workers.optimizer_for(spec, model.parameters())
    first = None
    for step in range(spec["steps"]):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(spec.get("accumulate", 1)):
            inputs, target = workers.make_batch(spec, step, micro)
            workers.loss_of(spec, model(inputs), target).backward()
        if step == 0:
            first = workers.named_grads(model)
        optimizer.step()
    return first, workers.named_params(model)


# --- comparing ---------------------------------------------------------------------------------
def _tensor(value, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise AssertionError(f"{where}: expected a tensor, got {type(value).__name__}")
    return value


def assert_close(where: str, got, expected: torch.Tensor) -> None:
    got = _tensor(got, where)
    if got.shape != expected.shape:
        raise AssertionError(f"{where}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    got = got.to(expected.dtype)
    bad = ~torch.isclose(got, expected, rtol=RTOL, atol=ATOL)
    if bad.any():
        index = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{where}: element {index} is {got[index].item():.8g}, expected {expected[index].item():.8g} "
            f"({int(bad.sum())} of {expected.numel()} elements differ)"
        )


def _same_tensors(where: str, got: dict, expected: dict) -> None:
    if not isinstance(got, dict) or set(got) != set(expected):
        raise AssertionError(f"{where}: the parameters' names differ from the model's")
    for name, value in expected.items():
        if value is None:
            if got[name] is not None:
                raise AssertionError(
                    f"{where}: '{name}' got no gradient in one process (frozen or unused), but has "
                    "one here: leave .grad of such parameters None"
                )
            continue
        if got[name] is None:
            raise AssertionError(f"{where}: '{name}' has no gradient (None), but one process gives it one")
        assert_close(f"{where}, '{name}'", got[name], value)


def equivalence_check(what: str, spec: dict):
    """Every rank: the first step's gradients and the final parameters equal one process's
    (trained when the check runs: listing the tests stays cheap)."""

    def check(outs: list) -> None:
        grads, params = one_process(spec)
        for rank, out in enumerate(outs):
            steps = spec["steps"]
            _same_tensors(f"{what}: rank {rank}, gradient after the first backward", out["grads"], grads)
            _same_tensors(f"{what}: rank {rank}, parameter after {steps} AdamW steps", out["params"], params)

    return check


def _calls_in(out: dict, phase: list[int]) -> list[dict]:
    return [c for c in out["calls"] if c["phase"] == phase]


def count_check(what: str, spec: dict):
    """Every rank, every step: one allreduce per bucket (the buckets' sizes) in the backward
    that synchronises, none in those inside no_sync."""
    _, numels = expected_buckets(spec)
    last = spec.get("accumulate", 1) - 1

    def check(outs: list) -> None:
        for rank, out in enumerate(outs):
            for step in range(spec["steps"]):
                for micro in range(last):
                    calls = _calls_in(out, [step, micro])
                    if calls:
                        raise AssertionError(
                            f"{what}: rank {rank}, step {step}: {len(calls)} allreduce call(s) in backward "
                            f"{micro} inside no_sync(); there must be none"
                        )
                calls = _calls_in(out, [step, last])
                got = sorted(c["numel"] for c in calls)
                if len(calls) != len(numels):
                    raise AssertionError(
                        f"{what}: rank {rank}, step {step}: {len(calls)} allreduce calls in the "
                        f"backward that synchronises; there must be one per bucket ({len(numels)} buckets)"
                    )
                if got != sorted(numels):
                    raise AssertionError(
                        f"{what}: rank {rank}, step {step}: the allreduces carried {got} elements, "
                        f"expected one per bucket, {sorted(numels)}"
                    )

    return check


def overlap_check(what: str, spec: dict):
    """Every rank, every step: all allreduces asynchronous, and every bucket launched as soon as
    it is complete.

    The order of events is the workers' sequence numbers (the grader's hooks, the student's and
    the allreduce calls run on one thread; the grader's hook of a parameter runs before the
    student's). A bucket is complete at its last gradient; its *deadline* is the next event of
    the grader's after that: the next gradient's notification, or, for the last, the grader's
    end-of-backward callback (queued before the student's, so it runs first). The k-th bucket
    to complete must find at least k allreduces launched before its deadline -- the student's
    hook for that gradient is the only code that runs in between. Calls are counted, not
    matched to buckets (two buckets may have the same size): launching bucket 0 early and the
    rest when backward ends fails at the second bucket. A bucket with a parameter that got no
    gradient (unused) completes at no gradient and is not counted."""
    buckets, _ = expected_buckets(spec)
    last = spec.get("accumulate", 1) - 1

    def check(outs: list) -> None:
        for rank, out in enumerate(outs):
            for step in range(spec["steps"]):
                phase = [step, last]
                where = f"{what}: rank {rank}, step {step}"
                calls = _calls_in(out, phase)
                ready = sorted((seq, name) for p, name, _, seq in out["ready"] if p == phase)
                ends = [seq for p, seq in out["ends"] if p == phase]
                if not calls or not ready or len(ends) != 1:
                    raise AssertionError(f"{where}: no allreduce in backward")
                if not all(c["async_op"] for c in calls):
                    raise AssertionError(
                        f"{where}: an allreduce with async_op=False blocks backward until it is "
                        "done; launch them with async_op=True"
                    )
                at = {name: seq for seq, name in ready}
                events = sorted([seq for seq, _ in ready] + ends)
                launches = sorted(c["seq"] for c in calls)
                done = sorted(
                    (max(at[name] for name in bucket), index)
                    for index, bucket in enumerate(buckets)
                    if all(name in at for name in bucket)
                )
                for k, (complete, index) in enumerate(done, start=1):
                    deadline = next(seq for seq in events if seq > complete)
                    launched = sum(1 for seq in launches if seq < deadline)
                    if launched < k:
                        raise AssertionError(
                            f"{where}: bucket {index} (in launch order) was complete, but when the "
                            f"next gradient arrived (or backward ended) {launched} allreduce(s) had "
                            f"been launched, fewer than the {k} buckets complete by then: nothing "
                            "overlaps backward (launch each bucket as soon as it is complete, from "
                            "the hook of its last gradient)"
                        )

    return check


def trace_check(what: str, spec: dict):
    """Every rank, every step: one span per bucket, "allreduce bucket <i>", cat "comm", its
    bytes, begun and ended within the backward that synchronises."""
    buckets, numels = expected_buckets(spec)
    itemsize = torch.empty(0, dtype=workers.DTYPE).element_size()
    expected = sorted((f"allreduce bucket {i}", n * itemsize) for i, n in enumerate(numels))
    last = spec.get("accumulate", 1) - 1

    def check(outs: list) -> None:
        for rank, out in enumerate(outs):
            for step in range(spec["steps"]):
                phase = [step, last]
                spans = [s for s in out["spans"] if s["phase"] == phase and s["cat"] == "comm"]
                got = sorted((s["name"], s["bytes"]) for s in spans)
                if got != expected:
                    raise AssertionError(
                        f"{what}: rank {rank}, step {step}: the recorder got comm spans {got}, expected "
                        f"one per bucket: {expected}"
                    )
                backward = next(b for b in out["backward"] if b["phase"] == phase)
                for span in spans:
                    if span["end_ns"] is None:
                        raise AssertionError(f"{what}: rank {rank}, step {step}: {span['name']} never ended")
                    if not backward["begin_ns"] <= span["begin_ns"] <= span["end_ns"] <= backward["end_ns"]:
                        raise AssertionError(
                            f"{what}: rank {rank}, step {step}: {span['name']} does not lie within the "
                            "backward pass (begin it at the launch, end it when wait() returns)"
                        )

    return check


def no_sync_check(what: str, spec: dict):
    """Accumulation: the same result as one process, and no allreduce inside no_sync."""
    same, counted = equivalence_check(what, spec), count_check(what, spec)

    def check(outs: list) -> None:
        counted(outs)
        same(outs)

    return check


def buckets_check(what: str, cases: list[dict]):
    """``assign_buckets`` returns the reference's buckets on every case."""
    expected = [reference_buckets(workers.case_parameters(case), case["bucket_mb"]) for case in cases]

    def check(outs: list) -> None:
        got = outs[0]
        if not isinstance(got, list) or len(got) != len(cases):
            raise AssertionError(f"{what}: expected one list of buckets per case")
        for index, (case, mine, right) in enumerate(zip(cases, got, expected)):
            if mine != right:
                names = [entry[0] for entry in case["params"]]
                raise AssertionError(
                    f"{what}, case {index} (parameters {names} in registration order, bucket_mb "
                    f"{case['bucket_mb']:.6g}): the buckets are {mine}, expected {right}"
                )

    return check

"""The trusted side of assignment 3's hidden tests: references computed in one process, and checks.

Nothing here runs next to student code. ``workers.py`` builds the models and data from a JSON
spec; so does this module, and trains them in one process on the whole batch (every rank's
rows): the DDP run must give the same gradients after the first step's backward and the same
parameters after the last AdamW step (double precision: they differ by rounding only). The
bucket rule is written here a second time (``reference_buckets``), not taken from the
solution; tasks 2-4 are checked against the student's own buckets when valid (``own_buckets``).
``communication`` ties what was counted to what was carried: each allreduce's logged copy must
be the rank's local bucket gradient, recomputed here, and the transport's own count must be the
allreduces'. Each ``*_check(what, spec)`` returns a function of the ranks' reports (read back as
data) that raises ``AssertionError`` with a message a student may read (``grading.redact``
removes the expected values).
"""

from __future__ import annotations

import torch

from minidist.collectives import cost_model

from . import workers

MIB = 1 << 20
RTOL, ATOL = 1e-7, 1e-10  # double precision; the sum over ranks is only re-associated


def reference_buckets(named, bucket_mb: float) -> list[list[str]]:
    """Trainable parameters once each (first name), reversed; a bucket is closed once it holds at
    least bucket_mb MiB, and before a parameter of another dtype (lecture 5's and the library's
    rule, PyTorch's)."""
    seen, order = set(), []
    for name, param in named:
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            order.append((name, param.numel() * param.element_size(), param.dtype))
    buckets: list[list[str]] = []
    open_, size, dtype = False, 0, None
    for name, nbytes, kind in reversed(order):
        if not open_ or kind != dtype:
            buckets.append([])
            open_, size, dtype = True, 0, kind
        buckets[-1].append(name)
        size += nbytes
        if size >= bucket_mb * MIB:
            open_ = False
    return buckets


def expected_buckets(spec: dict) -> tuple[list[list[str]], list[int]]:
    """The spec's model's buckets and each bucket's number of elements."""
    model = workers.make_model(spec)
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    buckets = reference_buckets(list(model.named_parameters()), spec["bucket_mb"])
    return buckets, [sum(sizes[name] for name in bucket) for bucket in buckets]


def own_buckets(spec: dict, reported) -> tuple[list[list[str]], str]:
    """The buckets the checks of tasks 2-4 hold a rank to: its own (``ddp.buckets``) when they
    are a partition of the trainable parameters into buckets of one dtype, each closed by the
    cap (everything but its last parameter under ``bucket_mb``), else the reference's. Task 1's
    test alone judges the bucket rule, so a slip there costs only its points. Names are the
    first name of each parameter (a tied weight may be reported under either name). Returns
    (buckets, which ones they are, for messages)."""
    model = workers.make_model(spec)
    first = {id(p): name for name, p in model.named_parameters()}
    by_name = dict(model.named_parameters(remove_duplicate=False))
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    seen: set[int] = set()
    buckets = []
    valid = isinstance(reported, list) and bool(reported)
    for bucket in reported if valid else []:
        if not isinstance(bucket, list) or not bucket:
            valid = False
            break
        params = [by_name.get(name) if isinstance(name, str) else None for name in bucket]
        if any(p is None or id(p) not in trainable or id(p) in seen for p in params):
            valid = False
            break
        if len(set(map(id, params))) != len(params):
            valid = False
            break
        seen.update(map(id, params))
        if len({p.dtype for p in params}) > 1:
            valid = False
            break
        if sum(p.numel() * p.element_size() for p in params[:-1]) >= spec["bucket_mb"] * MIB:
            valid = False
            break
        buckets.append([first[id(p)] for p in params])
    if valid and seen == trainable:
        return buckets, "its buckets (ddp.buckets)"
    reference, _ = expected_buckets(spec)
    return reference, (
        "the reference's buckets (ddp.buckets is not a partition of the trainable parameters into "
        "buckets of one dtype, each closed once it holds at least bucket_mb)"
    )


def local_model(spec: dict, rank: int, step: int, flat) -> torch.nn.Module:
    """The spec's model holding ``flat`` (a rank's parameters at the start of ``step``, as its
    worker reported them), after this rank's backward passes of that step on its own rows:
    its ``.grad`` are what this rank's buckets must carry in the step's last backward."""
    model = workers.make_model(spec)
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    if not isinstance(flat, torch.Tensor) or flat.numel() != total:
        raise AssertionError(f"rank {rank}, step {step}: the parameters were not reported")
    with torch.no_grad():
        offset = 0
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p).to(p.dtype))
            offset += p.numel()
    for micro in range(spec.get("accumulate", 1)):
        inputs, target = workers.local_rows(spec, rank, workers.make_batch(spec, step, micro))
        workers.loss_of(spec, model(inputs), target).backward()
    return model


def bucket_gradient(model: torch.nn.Module, names: list[str]) -> torch.Tensor:
    """One bucket's flat gradient in its layout (``Bucket.of``): its parameters' gradients in the
    bucket's order, each flattened; a parameter without one (unused) counts as zeros."""
    by_name = dict(model.named_parameters())
    parts = []
    for name in names:
        param = by_name[name]
        grad = torch.zeros_like(param) if param.grad is None else param.grad
        parts.append(grad.detach().reshape(-1))
    return torch.cat(parts)


def allreduce_traffic(spec: dict, rank: int, call: dict) -> tuple[int, int]:
    """(bytes, messages) the transport sends on ``rank`` for one logged allreduce: the
    library's algorithm choice for ``"auto"`` (the shm transport: its shared workspace, no
    message at all; otherwise the cost model's fastest), its exact byte count
    (``cost_model.bytes_sent``) and its messages (star: the root p-1, the others 1; tree: the
    binomial tree's; ring: 2(p-1); butterfly: one per halving and doubling step, plus the fold)."""
    p, numel, itemsize = spec["ranks"], call["numel"], call["itemsize"]
    algorithm = call["algorithm"]
    if algorithm == "auto":
        algorithm = (
            "shm"
            if spec["transport"] == "shm"
            else cost_model.fastest_allreduce(p, numel * itemsize, cost_model.DEFAULTS.get(spec["transport"]))
        )
    if algorithm not in ("star", "tree", "ring", "butterfly") or p == 1 or numel < 0:
        return 0, 0  # shm: no message; an unknown algorithm raised in the rank, sending nothing
    sent = cost_model.bytes_sent(algorithm, p, rank, numel, itemsize)
    if algorithm == "star":
        return sent, p - 1 if rank == 0 else 1
    if algorithm == "tree":
        return sent, cost_model.tree_sends(p, rank, True) + cost_model.tree_sends(p, rank, False)
    if algorithm == "ring":
        return sent, 2 * (p - 1)
    q = 1 << (p.bit_length() - 1)  # butterfly
    extra = p - q
    if rank < 2 * extra and rank % 2 == 0:
        return sent, 1
    return sent, 2 * (q.bit_length() - 1) + (1 if rank < 2 * extra else 0)


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


def _carries(call: dict, gradient: torch.Tensor, ranks: int) -> bool:
    """The call carried ``gradient`` (or ``gradient / ranks``: averaging before the sum is
    averaging too), element for element, in the bucket's layout."""
    carried = call.get("carried")
    if not isinstance(carried, torch.Tensor) or carried.shape != gradient.shape:
        return False
    carried = carried.to(gradient.dtype)
    return any(
        bool(torch.isclose(carried, expected, rtol=RTOL, atol=ATOL).all())
        for expected in (gradient, gradient / ranks)
    )


def communication(where: str, spec: dict, out: dict, rank: int) -> tuple[list, str, list[list[dict]]]:
    """What a rank's gradients can have come from: the allreduces of its buckets' gradients only.

    * no library collective but ``md.allreduce`` once the DDP is built (its constructor's
      broadcast is not logged), every one on the communicator the DDP was given, and no message
      sent or received point-to-point on that communicator;
    * in every step's synchronising backward, each bucket's gradient -- this rank's local
      gradients of its parameters, in its layout, recomputed here from the parameters the
      rank held at the start of the step and its own rows -- carried by an allreduce, copied
      when it was called (``_carries``);
    * the transport (``comm.stats``, which the student's code never gets) sent, during
      training, exactly the bytes and messages of the allreduces logged (``allreduce_traffic``):
      nothing travelled past the log.

    Returns the buckets (``own_buckets``), which they are, and per step each bucket's allreduce
    (the first that carried its gradient)."""
    buckets, whose = own_buckets(spec, out["buckets"])
    calls = out["calls"]
    others = sorted({c["function"] for c in calls if c["function"] != "allreduce"})
    if others:
        raise AssertionError(
            f"{where}: md.{', md.'.join(others)} called during training; DDP communicates by one "
            "md.allreduce per bucket only (md.broadcast belongs to the constructor)"
        )
    p2p = out["point_to_point"]
    if p2p["sent_messages"] or p2p["received_messages"]:
        raise AssertionError(
            f"{where}: {p2p['sent_messages']} message(s) sent and {p2p['received_messages']} received "
            "point-to-point on the communicator during training; DDP communicates by one md.allreduce "
            "per bucket only"
        )
    if not all(c["given_comm"] for c in calls):
        raise AssertionError(f"{where}: an allreduce on a communicator other than the one DDP was given")
    last = spec.get("accumulate", 1) - 1
    matched = []
    for step in range(spec["steps"]):
        starts = out["start_params"]
        model = local_model(spec, rank, step, starts[step] if step < len(starts) else None)
        left = sorted(_calls_in(out, [step, last]), key=lambda c: c["seq"])
        mine = []
        for index, names in enumerate(buckets):
            gradient = bucket_gradient(model, names)
            call = next((c for c in left if _carries(c, gradient, spec["ranks"])), None)
            if call is None:
                raise AssertionError(
                    f"{where}, step {step}: no allreduce carried bucket {index}'s gradient ({names}, "
                    f"{gradient.numel()} elements; {whose}): each bucket's allreduce must carry this "
                    "rank's gradients of its parameters, in the bucket's layout, when it is launched"
                )
            left.remove(call)
            mine.append(call)
        matched.append(mine)
    wire = [allreduce_traffic(spec, rank, c) for c in calls]
    expected = {"bytes_sent": sum(b for b, _ in wire), "messages_sent": sum(m for _, m in wire)}
    if out["transport"] != expected:
        got = out["transport"]
        raise AssertionError(
            f"{where}: the transport sent {got['bytes_sent']} bytes in {got['messages_sent']} messages "
            f"during training, but the {len(calls)} allreduce(s) logged send {expected['bytes_sent']} bytes "
            f"in {expected['messages_sent']} messages: something communicated past md.allreduce"
        )
    return buckets, whose, matched


def count_check(what: str, spec: dict):
    """Every rank, every step: one allreduce per bucket in the backward that synchronises, each
    carrying that bucket's gradient (``communication``), and none anywhere else (inside
    no_sync, or outside backward)."""
    last = spec.get("accumulate", 1) - 1

    def check(outs: list) -> None:
        for rank, out in enumerate(outs):
            buckets, whose = own_buckets(spec, out["buckets"])
            steps = [[step, micro] for step in range(spec["steps"]) for micro in range(last + 1)]
            stray = [c for c in out["calls"] if c["phase"] not in steps]
            if stray:
                raise AssertionError(
                    f"{what}: rank {rank}: {len(stray)} allreduce call(s) outside forward and backward; "
                    "DDP communicates in backward only"
                )
            for step in range(spec["steps"]):
                for micro in range(last):
                    calls = _calls_in(out, [step, micro])
                    if calls:
                        raise AssertionError(
                            f"{what}: rank {rank}, step {step}: {len(calls)} allreduce call(s) in backward "
                            f"{micro} inside no_sync(); there must be none"
                        )
                calls = _calls_in(out, [step, last])
                if len(calls) != len(buckets):
                    raise AssertionError(
                        f"{what}: rank {rank}, step {step}: {len(calls)} allreduce calls in the "
                        f"backward that synchronises; there must be one per bucket ({len(buckets)} "
                        f"buckets: {whose})"
                    )
            communication(f"{what}: rank {rank}", spec, out, rank)

    return check


def overlap_check(what: str, spec: dict):
    """Every rank, every step: all allreduces asynchronous, the buckets' own allreduces
    (``communication``: the one that carried each bucket's gradient) launched strictly in bucket
    order, and each as soon as the launch order lets it go.

    The order of events is the workers' sequence numbers (the grader's hooks, the student's and
    the allreduce calls run on one thread; the grader's hook of a parameter runs before the
    student's). Bucket k may go once it and buckets 0..k-1 are complete (lecture 5, Li et al.
    2020 section 3.2.3: a bucket that completes early waits for the ones before it); from that
    moment its *deadline* is the next event of the grader's: the next gradient's notification,
    or, for the last, the grader's end-of-backward callback (queued before the student's, so it
    runs first). Its allreduce must come before the deadline -- the student's hook for that
    gradient is the only code that runs in between. A bucket with a parameter that got no
    gradient (unused) completes at no gradient: it and the buckets after it are checked for
    their order only."""
    last = spec.get("accumulate", 1) - 1

    def check(outs: list) -> None:
        for rank, out in enumerate(outs):
            buckets, _, matched = communication(f"{what}: rank {rank}", spec, out, rank)
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
                launched = [call["seq"] for call in matched[step]]
                for index in range(1, len(launched)):
                    if launched[index] < launched[index - 1]:
                        raise AssertionError(
                            f"{where}: bucket {index} (in launch order) was launched before bucket "
                            f"{index - 1}: launch strictly in bucket order (every rank must issue its "
                            "collectives in the same order; a bucket that completes early waits)"
                        )
                at = {name: seq for seq, name in ready}
                events = sorted([seq for seq, _ in ready] + ends)
                may_go = -1  # the moment buckets 0..index are all complete
                for index, bucket in enumerate(buckets):
                    if not all(name in at for name in bucket):
                        break
                    may_go = max(may_go, max(at[name] for name in bucket))
                    deadline = next(seq for seq in events if seq > may_go)
                    if launched[index] > deadline:
                        raise AssertionError(
                            f"{where}: bucket {index} (in launch order) could go, but its allreduce "
                            "was launched only after the next gradient arrived (or backward ended): "
                            "nothing overlaps backward (launch each bucket from the hook that lets it "
                            "go: its own last gradient's, or that of the bucket before it)"
                        )

    return check


def trace_check(what: str, spec: dict):
    """Every rank, every step: one span per bucket, "allreduce bucket <i>", cat "comm", its
    bytes, begun and ended within the backward that synchronises -- spans of real allreduces
    (``communication``)."""
    itemsize = torch.empty(0, dtype=workers.DTYPE).element_size()
    last = spec.get("accumulate", 1) - 1

    def check(outs: list) -> None:
        for rank, out in enumerate(outs):
            buckets, _, _ = communication(f"{what}: rank {rank}", spec, out, rank)
            model = workers.make_model(spec)
            sizes = {name: p.numel() for name, p in model.named_parameters()}
            expected = sorted(
                (f"allreduce bucket {i}", sum(sizes[name] for name in bucket) * itemsize)
                for i, bucket in enumerate(buckets)
            )
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
                            "backward pass (begin it at the launch, end it when the allreduce completes)"
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


# --- the measured test: the step on the emulated clock ------------------------------------------
def ring_seconds(nbytes: float, ranks: int) -> float:
    """A ring allreduce of ``nbytes`` on ``ranks`` ranks over the 1 Gbit/s link (lecture 2's
    alpha-beta model, as lecture 5's prediction: no gamma)."""
    link = workers.LINK_1G
    model = cost_model.AlphaBeta(alpha=link["alpha_s"], beta=1 / link["bandwidth_Bps"], gamma=0.0)
    return cost_model.predict("ring", ranks, nbytes, model)


def lower_bound(spec: dict) -> float:
    """max(compute, communication): forward and backward, or one allreduce of every gradient."""
    forward, backward = workers.timed_seconds()
    total = sum(numel for _, numel, _ in workers.timed_layout()) * 4  # float32
    return max(forward + sum(backward.values()), ring_seconds(total, spec["ranks"]))


def emulated_step(spec: dict, out: dict, phase: list[int], where: str) -> float:
    """One step of a rank on the emulated clock, replayed from the events the grader noted.

    The training thread: the forward takes ``forward`` seconds; then, event by event in the
    order of their sequence numbers, each gradient's notification comes after that parameter's
    backward seconds; an allreduce is launched at the thread's present moment; a ``wait()`` (or
    an ``is_completed()`` that said True) makes the thread wait for that allreduce's completion.
    The link carries one allreduce at a time, in launch order: each starts when launched or when
    the link is free, whichever is later, and takes ``ring_seconds`` of its bytes. The step ends
    when the thread is done and the last allreduce has completed. Nothing here reads a clock."""
    forward, backward = workers.timed_seconds()
    events = [(seq, "ready", name) for p, name, _, seq in out["ready"] if p == phase]
    names = [name for _, _, name in events]
    if sorted(names) != sorted(backward):
        raise AssertionError(f"{where}: every parameter's gradient once per backward was expected")
    events += [(c["seq"], "call", c["numel"] * c["itemsize"]) for c in out["calls"] if c["phase"] == phase]
    events += [(seq, "wait", call) for p, call, seq in out["waits"] if p == phase]
    clock, link_free, done = forward, 0.0, {}
    for seq, kind, what in sorted(events):
        if kind == "ready":
            clock += backward[what]
        elif kind == "call":
            link_free = max(clock, link_free) + ring_seconds(what, spec["ranks"])
            done[seq] = link_free
        else:
            clock = max(clock, done.get(what, clock))
    return max([clock, *done.values()])


def step_time_check(what: str, spec: dict):
    """The measured test: right (the first step's gradients the average of the ranks' local
    ones, recomputed here; each bucket's
    allreduce carried its gradient and nothing else communicated, every allreduce asynchronous),
    then the slowest rank's slowest step on the emulated clock over ``lower_bound``: returned,
    to be graded in tiers. Computed here from the grader's records of the order of events (its
    hooks, its wrapper of ``md.allreduce``, its handles' ``wait``), never from the student's."""
    last = spec.get("accumulate", 1) - 1

    def check(outs: list) -> float:
        starts = [out["start_params"][0] if out["start_params"] else None for out in outs]
        local = [local_model(spec, rank, 0, start) for rank, start in enumerate(starts)]
        grads = [{name: p.grad for name, p in model.named_parameters()} for model in local]
        average = {name: sum(g[name] for g in grads) / len(grads) for name in grads[0]}
        worst = 0.0
        for rank, out in enumerate(outs):
            where = f"{what}: rank {rank}"
            own = {**spec, "bucket_mb": out["bucket_mb"]}  # the cap tuned_bucket_mb returned
            communication(where, own, out, rank)
            if not all(c["async_op"] for c in out["calls"]):
                raise AssertionError(f"{where}: an allreduce with async_op=False blocks backward")
            for name, value in average.items():
                got = out["grads"].get(name) if isinstance(out["grads"], dict) else None
                if not isinstance(got, torch.Tensor) or not torch.allclose(got, value, rtol=1e-5, atol=1e-9):
                    raise AssertionError(f"{where}: '{name}' after the first backward is not the average")
            for step in range(spec["steps"]):
                worst = max(worst, emulated_step(spec, out, [step, last], f"{where}, step {step}"))
        return worst / lower_bound(spec)

    return check

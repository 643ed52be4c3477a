"""The trusted side of assignment 8: one process, written plainly, and the checks. Instructors only.

Everything here runs in the grader's process on what the ranks reported (plain data). It does not
import the library's experts or its all-to-all: the reference is this file's own loops -- the
transpose of pieces, the router with its queues counted one choice at a time in priority order
(by position: token, then choice), and the mixture computed token by token -- so grading does not
move when the library does.
"""

from __future__ import annotations

import math

import pytest
import torch

from . import workers

TOLERANCE = 1e-9  # float64: p ranks and one process differ by rounding only


def _fail(message: str) -> None:
    pytest.fail(message, pytrace=False)


def _tensor(got, want: torch.Tensor, what: str, tolerance: float = 0.0) -> None:
    """``got`` equals ``want``: same shape and dtype, and exactly equal (or within ``tolerance``)."""
    if not isinstance(got, torch.Tensor):
        _fail(f"{what}: got {type(got).__name__}, expected a tensor")
    if tuple(got.shape) != tuple(want.shape):
        _fail(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    if got.dtype != want.dtype:
        _fail(f"{what}: dtype {got.dtype}, expected {want.dtype}")
    if not want.numel():
        return
    if tolerance == 0.0:
        wrong = int((got != want).sum())
        if wrong:
            _fail(f"{what}: {wrong} of {want.numel()} elements differ from the reference")
        return
    difference = (got.double() - want.double()).abs().max().item()
    if not difference <= tolerance:
        _fail(f"{what} differs from one process by {difference:.3g}")


# --- task 1: the transpose and its bytes -----------------------------------------------------------
def check_equal(spec: dict, world: int):
    inputs = [
        [workers.equal_input(spec, i, r, world) for r in range(world)] for i in range(len(spec["pieces"]))
    ]

    def check(outs: list[dict]) -> None:
        for rank, out in enumerate(outs):
            for index, rows in enumerate(inputs):
                what = f"rank {rank}, all_to_all of a {tuple(rows[0].shape)} {rows[0].dtype} tensor"
                _tensor(out["inputs_after"][index], rows[rank], f"{what}: the input after the call")
                _tensor(out["outs"][index], torch.stack([rows[i][rank] for i in range(world)]), what)
                budget = (world - 1) * rows[rank][0].numel() * rows[rank].element_size()
                got = out["traffic"][index][0]
                if got != budget:
                    _fail(
                        f"{what}: the transport carried {got} bytes from this rank, expected {budget} "
                        f"((p-1)/p of the input)"
                    )

    return check


def check_uneven(spec: dict):
    world = len(spec["rows"])
    pieces = [workers.uneven_input(spec, r) for r in range(world)]

    def check(outs: list[dict]) -> None:
        for rank, out in enumerate(outs):
            want = [pieces[i][rank] for i in range(world)]
            data = sum(pieces[rank][j].numel() * 4 for j in range(world) if j != rank)
            for key, extra in (("exchanged", 8 * (world - 1)), ("given", 0)):
                what = f"rank {rank}, all_to_all of uneven pieces ({'sizes ' + key})"
                got = out[key]
                if not isinstance(got, (list, tuple)) or len(got) != world:
                    _fail(f"{what}: expected a list of {world} tensors, got {type(got).__name__}")
                for i in range(world):
                    _tensor(got[i], want[i], f"{what}, entry {i}")
                carried = out["traffic"][0 if key == "exchanged" else 1][0]
                if carried != data + extra:
                    _fail(
                        f"{what}: the transport carried {carried} bytes from this rank, expected "
                        f"{data + extra} (the pieces for the other ranks"
                        f"{', and one int64 size to each' if extra else ''})"
                    )

    return check


# --- task 2: routing, dispatch, combine ------------------------------------------------------------
def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float | None) -> int:
    return tokens if capacity_factor is None else math.ceil(capacity_factor * tokens * top_k / num_experts)


def route(logits: torch.Tensor, top_k: int, capacity_factor: float | None):
    """(experts, gates, slots) by the rules of the stub, counted one choice at a time."""
    tokens, num_experts = logits.shape
    probs = torch.softmax(logits, dim=-1)
    top, chosen = probs.topk(top_k, dim=-1)
    gates = top / top.sum(dim=-1, keepdim=True) if top_k > 1 else top
    limit = capacity(tokens, top_k, num_experts, capacity_factor)
    slots = torch.full((tokens, top_k), -1, dtype=torch.int64)
    queue = [0] * num_experts
    for t in range(tokens):  # by position: the earlier token first
        for j in range(top_k):  # then a token's choices in order
            e = int(chosen[t, j])
            if queue[e] < limit:
                slots[t, j] = queue[e]
            queue[e] += 1
    return chosen, gates, slots


def check_routing(spec: dict):
    def check(outs: list[dict]) -> None:
        out = outs[0]
        for index, problem in enumerate(spec["problems"]):
            logits = workers.draw([problem["tokens"], problem["experts"]], "float64", spec["seed"], index)
            logits = (logits * problem["scale"]).requires_grad_(True)
            chosen, gates, slots = route(logits, problem["top_k"], problem["capacity_factor"])
            weights = workers.draw(gates.shape, "float64", spec["seed"], index, 1)
            (grad,) = torch.autograd.grad((gates * weights).sum(), logits)
            what = (
                f"route on {problem['tokens']} tokens, {problem['experts']} experts, "
                f"top_k={problem['top_k']}, "
                f"capacity_factor={problem['capacity_factor']}"
            )
            got = out["results"][index]
            _tensor(got["experts"], chosen, f"{what}: experts")
            _tensor(got["slots"], slots, f"{what}: slots")
            _tensor(got["gates"], gates.detach(), f"{what}: gates", TOLERANCE)
            _tensor(
                got["grad"], grad, f"{what}: the gradient of the gates with respect to the logits", TOLERANCE
            )

    return check


def dispatch_combine(problem: dict, keys: tuple[int, ...]):
    """The buffer, the output and the gradients of the dispatching job, token by token."""
    chosen, slots, gates = workers.synthetic_routing(problem, *keys)
    e, c, d = problem["experts"], problem["capacity"], problem["width"]
    x = workers.draw([problem["tokens"], d], "float64", *keys, 1).requires_grad_(True)
    expert_out = workers.draw([e, c, d], "float64", *keys, 2).requires_grad_(True)
    gates.requires_grad_(True)
    rows = [[x.new_zeros(d) for _ in range(c)] for _ in range(e)]
    outputs = []
    for t in range(problem["tokens"]):
        total = x.new_zeros(d)
        for j in range(problem["top_k"]):
            if slots[t, j] >= 0:
                rows[chosen[t, j]][slots[t, j]] = x[t]
                total = total + gates[t, j] * expert_out[chosen[t, j], slots[t, j]]
        outputs.append(total)
    buffer = torch.stack([torch.stack(r) for r in rows])
    y = torch.stack(outputs)
    loss = (buffer * workers.draw([e, c, d], "float64", *keys, 3)).sum()
    loss = loss + (y * workers.draw(x.shape, "float64", *keys, 4)).sum()
    grads = torch.autograd.grad(loss, [x, expert_out, gates])
    return buffer.detach(), y.detach(), grads


def check_dispatching(spec: dict):
    def check(outs: list[dict]) -> None:
        out = outs[0]
        for index, problem in enumerate(spec["problems"]):
            buffer, y, grads = dispatch_combine(problem, (spec["seed"], index))
            what = (
                f"{problem['tokens']} tokens, {problem['experts']} experts "
                f"of capacity {problem['capacity']}, "
                f"top_k={problem['top_k']}"
            )
            got = out["results"][index]
            _tensor(got["buffer"], buffer, f"dispatch, {what}")
            _tensor(got["y"], y, f"combine, {what}", TOLERANCE)
            for name, g_got, g_want in zip(("x", "expert_out", "gates"), got["grads"], grads):
                if g_got is None:
                    _fail(f"{what}: no gradient reached {name} (is the result built from it differentiably?)")
                _tensor(g_got, g_want, f"{what}: the gradient with respect to {name}", TOLERANCE)

    return check


# --- tasks 3 and 4: expert parallel ------------------------------------------------------------
def mixture(x, router, experts, top_k: int, capacity_factor: float | None) -> torch.Tensor:
    """One process: every kept choice of every token through its expert, weighted by its gate."""
    chosen, gates, slots = route(router(x), top_k, capacity_factor)
    rows = []
    for t in range(x.shape[0]):
        total = x.new_zeros(x.shape[1])
        for j in range(top_k):
            if slots[t, j] >= 0:
                total = total + gates[t, j] * experts[int(chosen[t, j])](x[t : t + 1])[0]
        rows.append(total)
    return torch.stack(rows)


def one_process(spec: dict, world: int) -> list[dict]:
    """Per rank: the output, the gradient of its tokens and of its router copy, after the backward
    of the sum of every rank's loss; the experts' gradients (every rank's tokens) under "experts"."""
    experts = workers.make_experts(spec)
    results = []
    total = 0.0
    for rank in range(world):
        router = workers.make_router(spec)  # one copy per rank, as on the ranks
        x = workers.tokens(spec, rank).requires_grad_(True)
        y = mixture(x, router, experts, spec["top_k"], spec["capacity_factor"])
        total = total + (y * workers.output_weights(spec, rank)).sum()
        results.append({"x": x, "router": router, "y": y.detach()})
    total.backward()
    for result in results:
        result["x_grad"] = result.pop("x").grad
        result["router_grad"] = result.pop("router").weight.grad
    local = spec["experts"] // world
    for rank, result in enumerate(results):
        mine = experts[rank * local : (rank + 1) * local]
        result["expert_grads"] = [
            [torch.zeros_like(q) if q.grad is None else q.grad for q in e.parameters()] for e in mine
        ]
    return results


def dropped(spec: dict, world: int) -> int:
    """How many choices the capacity drops, over every rank's tokens."""
    count = 0
    for rank in range(world):
        logits = workers.make_router(spec)(workers.tokens(spec, rank))
        count += int((route(logits.detach(), spec["top_k"], spec["capacity_factor"])[2] < 0).sum())
    return count


def starved(spec: dict, world: int) -> bool:
    """Whether no token of any rank chooses an expert of the last rank."""
    local = spec["experts"] // world
    for rank in range(world):
        logits = workers.make_router(spec)(workers.tokens(spec, rank)).detach()
        if (route(logits, spec["top_k"], spec["capacity_factor"])[0] >= spec["experts"] - local).any():
            return False
    return True


def _check_expert_parallel(want: list[dict], outs: list[dict]) -> None:
    for rank, (out, ref) in enumerate(zip(outs, want)):
        where = f"rank {rank}"
        _tensor(out["y"], ref["y"], f"{where}: the layer's output", TOLERANCE)
        for key, what in (("x_grad", "the tokens' gradient"), ("router_grad", "the router's gradient")):
            if out[key] is None:
                _fail(f"{where}: {what} is None (did the backward reach it?)")
            _tensor(out[key], ref[key], f"{where}: {what}", TOLERANCE)
        if len(out["expert_grads"]) != len(ref["expert_grads"]):
            _fail(
                f"{where}: reported {len(out['expert_grads'])} experts, expected {len(ref['expert_grads'])}"
            )
        for e, (got, wanted) in enumerate(zip(out["expert_grads"], ref["expert_grads"])):
            for i, (g, w) in enumerate(zip(got, wanted)):
                name = f"{where}: local expert {e}'s parameter {i} gradient"
                if g is None:
                    g = torch.zeros_like(w)  # an expert no token chose: no gradient is zero
                _tensor(g, w, name, TOLERANCE)


def check_rows_travelled(spec: dict, world: int, outs: list[dict]) -> None:
    """Expert parallelism moves the tokens to the experts: in the forward (the layer's construction
    included), every token's row -- its d float64s as they are, contiguous in some message -- went
    from its rank to every other rank that holds one of its kept choices, and every message a rank
    sent another in the forward was received there. A layer that rebuilds the other ranks' tokens
    from their seeds, or ships the experts to the tokens instead, fails here."""
    local = spec["experts"] // world
    for q, out in enumerate(outs):
        for r in range(world):
            if r != q and outs[r]["forward_messages"][q] != out["forward_received"][r]:
                _fail(
                    f"rank {r} sent rank {q} {outs[r]['forward_messages'][q]} messages in the forward, "
                    f"rank {q} received {out['forward_received'][r]} of them"
                )
    for r in range(world):
        x = workers.tokens(spec, r)
        chosen, _, slots = route(
            workers.make_router(spec)(x).detach(), spec["top_k"], spec["capacity_factor"]
        )
        owner = chosen // local
        for q in range(world):
            if q == r:
                continue
            sent = outs[r]["forward_sent"][q]
            if not isinstance(sent, torch.Tensor) or sent.dtype != torch.uint8:
                _fail(f"rank {r}: its record of what it sent rank {q} is malformed")
            blob = sent.numpy().tobytes()
            for t in ((owner == q) & (slots >= 0)).any(1).nonzero().flatten().tolist():
                if x[t].numpy().tobytes() not in blob:
                    _fail(
                        f"rank {r}'s token {t} has a kept choice among rank {q}'s experts, but its row "
                        f"never reached rank {q} in the forward: expert parallelism sends each token "
                        "to the ranks of its experts (lecture 10), as d float64s in a row"
                    )


def check_expert_parallel(spec: dict, world: int):
    def check(outs: list[dict]) -> None:
        _check_expert_parallel(one_process(spec, world), outs)
        check_rows_travelled(spec, world, outs)

    return check


def rows_per_token(spec: dict, outs: list[dict]) -> float:
    """Bytes the transport carried from the layer's construction to the end of one forward and
    backward, every rank, per token, in rows of d float64s: the measured value."""
    carried = sum(out["forward"][0] + out["backward"][0] for out in outs)
    return carried / (len(outs) * spec["tokens"] * spec["width"] * 8)


def levels(spec: dict, world: int) -> dict[str, float]:
    """The three layouts' rows per token on this spec, from the routing alone (nothing dropped):

    * padded (GShard): every rank sends (p-1)/p of its E x C slots, in each of the four exchanges
      (dispatch, combine, and their backward): 4 (p-1)/p E C / T;
    * routed: each kept choice of an expert on another rank travels as one row, four times:
      4 x remote choices / T;
    * once per rank: each token travels once to each other rank that holds any of its kept
      choices, four times: 4 x (token, other rank) pairs / T.

    Excluded: a layout's small extras (sizes, which expert a row is for, the gates).
    """
    local = spec["experts"] // world
    remote = pairs = 0
    for rank in range(world):
        logits = workers.make_router(spec)(workers.tokens(spec, rank)).detach()
        chosen, _, slots = route(logits, spec["top_k"], spec["capacity_factor"])
        owner = chosen // local
        away = (slots >= 0) & (owner != rank)
        remote += int(away.sum())
        pairs += sum(int((away & (owner == q)).any(1).sum()) for q in range(world) if q != rank)
    tokens = world * spec["tokens"]
    slots_c = capacity(spec["tokens"], spec["top_k"], spec["experts"], spec["capacity_factor"])
    return {
        "padded": 4 * (world - 1) / world * spec["experts"] * slots_c / spec["tokens"],
        "routed": 4 * remote / tokens,
        "once per rank": 4 * pairs / tokens,
    }


def check_bytes(spec: dict, world: int):
    def check(outs: list[dict]) -> float:
        _check_expert_parallel(one_process(spec, world), outs)
        check_rows_travelled(spec, world, outs)
        return rows_per_token(spec, outs)

    return check

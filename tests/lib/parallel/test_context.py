"""Context parallel attention (``minidist.parallel.context``): ring and Ulysses against one process.

One ``md.launch`` per world size (2, 3, 4) runs every case (``context_workers.all_checks``:
float64 and float32 x causal or not x contiguous and zig-zag layouts, ring and Ulysses, forward
and backward); the tests below read its results. References, in this process on the full
sequence: torch's ``scaled_dot_product_attention`` and its autograd (outputs and the gradients
of q, k and v); the formulas of ``context.costs`` (bytes, messages, tiles) and
``memory.ring_attention_saved_bytes`` (what the ring keeps for backward).

Tolerance: float64 1e-12 (exactness: the merge and the tile backward are the same maths in
another order); float32 1e-5 (the online softmax adds in another order than one softmax).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import context_workers as w
import minidist as md
from minidist import memory
from minidist.bench import context as bench
from minidist.clock import GPUSpec
from minidist.parallel import context

pytestmark = pytest.mark.timeout(180)

WORLD_SIZES = (2, 3, 4)
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


@pytest.fixture(scope="module")
def case():
    return w.make_case(seed=0)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda p: f"p{p}")
def run(request, case):
    p = request.param
    return p, md.launch(w.all_checks, p, args=(case,), timeout=120, threads_per_worker=1)


def cases(outs, kind):
    return [(key, [o[key] for o in outs]) for key in outs[0] if key != "errors" and key[0] == kind]


def full_attention(case, dtype, causal):
    """torch's attention on the whole sequence in one process: out and the grads of q, k, v."""
    q, k, v = (case[n, dtype].clone().requires_grad_(True) for n in ("q", "k", "v"))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(case["grad_out", dtype])
    return out.detach(), (q.grad, k.grad, v.grad)


def close(got, want, dtype, what):
    tol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


# --- one process: the merge rule and the layouts ---------------------------------------------
def test_merge_of_partial_attentions_equals_attention_over_the_union():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 5, 4, generator=gen, dtype=torch.float64)  # 5 queries, 11 keys
    k, v = (torch.randn(2, 3, 11, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    scale = 0.5
    whole_out, whole_lse = context.attend_tile(q, k, v, scale)
    scores = q @ k.transpose(-2, -1) * scale
    torch.testing.assert_close(whole_out, torch.softmax(scores, -1) @ v, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(whole_lse, torch.logsumexp(scores, -1), atol=1e-12, rtol=1e-12)
    parts = [
        context.attend_tile(q, k[..., s, :], v[..., s, :], scale)
        for s in (slice(0, 2), slice(2, 9), slice(9, 11))
    ]
    left = context.merge(*context.merge(*parts[0], *parts[1]), *parts[2])  # (A + B) + C
    right = context.merge(*parts[2], *context.merge(*parts[1], *parts[0]))  # C + (B + A)
    for out, lse in (left, right):
        torch.testing.assert_close(out, whole_out, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(lse, whole_lse, atol=1e-12, rtol=1e-12)


def test_layouts_shard_and_gather_back_and_zigzag_pairs_early_with_late_blocks():
    x = torch.arange(2 * 16).reshape(1, 2, 16, 1)
    for p in (2, 4):
        for layout in context.LAYOUTS:
            shards = [context.shard_sequence(x, r, p, layout) for r in range(p)]
            assert torch.equal(context.gather_sequence(shards, layout), x)
    zig = [context.positions(r, 4, 16, "zigzag").tolist() for r in range(4)]
    assert zig == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]  # blocks r and 2p-1-r
    assert context.positions(1, 4, 16, "contiguous").tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="pad it to a multiple of 8"):
        context.shard_sequence(torch.zeros(1, 1, 12, 1), 0, 4, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        context.shard_sequence(x, 0, 2, "striped")


def test_calculator_layer_with_cp_divides_by_cp_and_keeps_no_score_matrix():
    """Korthikanti's layer, 34 sbh + 5 as^2 b without recomputation; with ring attention the
    5 as^2 b attention core is never kept and the lse (4 bytes a query row and head) is."""
    s, b, h, a = 4096, 2, 1024, 16
    one = memory.activation_bytes_per_layer_cp(s, b, h, a, cp=1)
    assert one == memory.activation_bytes_per_layer(s, b, h, a) - 5 * a * s * s * b + 4 * a * s * b
    for cp in (2, 4, 8):
        assert memory.activation_bytes_per_layer_cp(s, b, h, a, cp=cp) * cp == pytest.approx(one)
    with pytest.raises(ValueError, match="divide the sequence"):
        memory.ring_attention_saved_bytes(1, 1, 10, 4, cp=4)


def test_alpha_beta_ring_time_in_closed_form():
    """``ring_time`` walks the schedule; against the closed forms. Compute-bound (free link):
    contiguous causal takes as long as non-causal (rank p-1 computes a full tile every step),
    zig-zag causal (2p+1)/4 of it (3 half-size tiles at step 0, then 2 a step). Link-bound:
    (p-1) hops of alpha + 2B/bw, then the last step's compute."""
    b, a, s, d, p = 1, 4, 1024, 64, 4
    gpu = GPUSpec("test", 1e12, 1.0)
    tile = gpu.seconds(4 * b * a * (s // p) ** 2 * d)  # one (S/p)^2 tile
    free = (0.0, 1e30)
    non = context.ring_time(b, a, s, d, p, *free, gpu, causal=False, layout="contiguous")
    assert non == pytest.approx(p * tile)
    assert context.ring_time(b, a, s, d, p, *free, gpu, causal=True, layout="contiguous") == pytest.approx(
        p * tile
    )
    assert context.ring_time(b, a, s, d, p, *free, gpu, causal=True, layout="zigzag") == pytest.approx(
        (2 * p + 1) / 4 * tile
    )
    alpha, bw = 1e-3, 1e3  # a K/V shard takes far longer than a tile
    hop = alpha + 2 * b * a * (s // p) * d * 4 / bw
    last = tile / 2  # zig-zag causal, a step after the first: 2 tiles of (S/2p)^2
    assert context.ring_time(b, a, s, d, p, alpha, bw, gpu, causal=True, layout="zigzag") == pytest.approx(
        (p - 1) * hop + last
    )
    u = context.ulysses_time(b, a, s, d, p, alpha, bw, gpu)
    assert u == pytest.approx(4 * (p - 1) * (alpha + b * a * (s // p) * d * 4 / p / bw) + p * tile)


# --- p ranks against one process -------------------------------------------------------------
def test_ring_attention_equals_full_attention_forward_and_backward(run, case):
    p, outs = run
    checked = 0
    for (_, dtype, causal, layout), results in cases(outs, "ring"):
        want_out, want_grads = full_attention(case, dtype, causal)
        what = f"ring p={p} {dtype} causal={causal} {layout}"
        close(context.gather_sequence([r["out"] for r in results], layout), want_out, dtype, what + " out")
        for i, name in enumerate("qkv"):
            got = context.gather_sequence([r["grads"][i] for r in results], layout)
            close(got, want_grads[i], dtype, f"{what} d{name}")
        checked += 1
    assert checked == 8


def test_ulysses_attention_equals_full_attention_forward_and_backward(run, case):
    p, outs = run
    checked = 0
    for (_, dtype, causal, layout), results in cases(outs, "ulysses"):
        want_out, want_grads = full_attention(case, dtype, causal)
        what = f"ulysses p={p} {dtype} causal={causal} {layout}"
        close(context.gather_sequence([r["out"] for r in results], layout), want_out, dtype, what + " out")
        for i, name in enumerate("qkv"):
            got = context.gather_sequence([r["grads"][i] for r in results], layout)
            close(got, want_grads[i], dtype, f"{what} d{name}")
        checked += 1
    assert checked == 8


def test_bytes_and_messages_sent_equal_the_formulas(run):
    """Ring: (p-1) 2B forward, (p-1) 2B + p 2B backward; Ulysses: 4 (p-1) B/p each way."""
    p, outs = run
    for kind, formula in (("ring", context.ring_bytes), ("ulysses", context.ulysses_bytes)):
        for (_, dtype, causal, layout), results in cases(outs, kind):
            size = torch.tensor([], dtype=dtype).element_size()
            want = formula(w.BATCH, w.HEADS, w.SEQ, w.HEAD_DIM, p, size)
            for rank, r in enumerate(results):
                what = f"{kind} p={p} rank {rank} {dtype} causal={causal} {layout}"
                assert r["bytes"] == (want["forward"], want["backward"]), what
                assert r["messages"] == (want["forward_messages"], want["backward_messages"]), what


def test_tiles_per_rank_balanced_by_zigzag_and_one_tile_pair_at_a_time(run):
    """Counted tiles = ``tiles_per_rank``; zig-zag causal: 2p+1 on every rank; contiguous causal:
    rank r does r+1, rank p-1 p times rank 0. No score matrix beyond one block x block tile."""
    p, outs = run
    for (_, _dtype, causal, layout), results in cases(outs, "ring"):
        counters = [r["counter"] for r in results]
        tiles = [c.tiles_forward for c in counters]
        assert tiles == [context.tiles_per_rank(r, p, layout, causal) for r in range(p)]
        assert [c.tiles_backward for c in counters] == tiles  # backward revisits the same tiles
        blk = context.block_size(w.SEQ, p, layout)
        assert all(c.largest_tile == (blk, blk) for c in counters)
        assert all(
            c.flops_forward == t * 4 * blk * blk * w.HEAD_DIM * w.BATCH * w.HEADS
            for c, t in zip(counters, tiles)
        )
        if causal and layout == "zigzag":
            assert tiles == [2 * p + 1] * p
        if causal and layout == "contiguous":
            assert tiles == list(range(1, p + 1)) and tiles[-1] == p * tiles[0]


def test_ring_keeps_one_pth_of_the_activations_the_calculator_says(run):
    p, outs = run
    for (_, dtype, causal, layout), results in cases(outs, "ring"):
        size = torch.tensor([], dtype=dtype).element_size()
        want = memory.ring_attention_saved_bytes(w.BATCH, w.HEADS, w.SEQ, w.HEAD_DIM, cp=p, element_size=size)
        one_rank = memory.ring_attention_saved_bytes(
            w.BATCH, w.HEADS, w.SEQ, w.HEAD_DIM, cp=1, element_size=size
        )
        assert want * p == one_rank
        assert [r["saved_bytes"] for r in results] == [want] * p, (dtype, causal, layout)


def test_bad_shapes_get_errors_that_say_what_to_do(run):
    p, outs = run
    errors = outs[0]["errors"]
    assert f"pad the sequence to a multiple of 2p = {2 * p}" in errors["ring_odd"]
    assert f"{p + 1} heads" in errors["ulysses_heads"] and "ring_attention" in errors["ulysses_heads"]


def test_emulated_clock_time_is_at_least_the_alpha_beta_prediction(run):
    """The benchmark's short point (``python -m minidist.bench context``), on 4 ranks: the
    predictions equal the formulas written out again here, and the emulated forward (slowest
    rank) takes at least the predicted time -- the clock only adds (compute waits and link
    delays cannot be skipped). How far above is load, not a property: no upper bound here
    (``python -m minidist.bench context`` prints the ratio)."""
    p, outs = run
    if p != 4:
        pytest.skip("measured on 4 ranks only")
    pt = w.SHORT_POINT
    shard = pt.batch * pt.heads * (pt.seq // p) * pt.head_dim * 4  # B: one rank's q, fp32
    step = 4 * pt.batch * pt.heads * (pt.seq // p) ** 2 * pt.head_dim / 1e7  # one tile, 10 MFLOP/s
    hop = pt.alpha_s + 2 * shard / pt.bandwidth_Bps
    want = {
        "ring": (p - 1) * max(step, hop) + step,
        "ulysses": 4 * (p - 1) * (pt.alpha_s + shard / p / pt.bandwidth_Bps) + p * step,
    }
    predicted = bench.predict(pt, p)
    for method, seconds in want.items():
        assert predicted[method] == pytest.approx(seconds)
        emulated = max(o["emulated"][pt.name, method][0] for o in outs)
        assert emulated >= 0.95 * seconds, (method, emulated, seconds)

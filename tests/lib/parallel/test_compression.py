"""Gradient compression hooks: DGC's parts one by one, then through DDP against references.

References: exact top-k (torch.topk), the conservation law of error feedback, the
warm-up table of the paper, a dense sum of the sparse vectors built in one process,
one-process momentum SGD, one-process emulations of bf16 and sign compression, and
the byte formulas of ``compression.traffic``.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

import compression_workers as cw
import ddp_workers as w
import minidist as md
from minidist.parallel.compression import baselines, dgc, traffic

pytestmark = pytest.mark.timeout(180)


def assert_states_close(got: dict, want: dict, atol: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")


def dense_of(indices: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    out = torch.zeros(numel)
    out[indices] = values
    return out


# --- top-k by a sampled threshold -------------------------------------------------------


def test_sampled_threshold_selects_about_k_entries():
    """The share above the threshold is Beta(k_s, s - k_s + 1): with s = 2000 samples and
    k_s = 20 its relative spread is about 22%; the mean over 40 seeds is within 10% of k
    (more than 4 standard errors) and no single draw is off by 3x."""
    n, k = 200_000, 2_000
    magnitude = cw.rank_vector(0, n).abs()
    counts = []
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        threshold = dgc.sampled_threshold(magnitude, k, sample_ratio=0.01, generator=gen)
        counts.append(int((magnitude >= threshold).sum()))
    assert abs(statistics.mean(counts) / k - 1) < 0.10, counts
    assert all(k / 3 < c < 3 * k for c in counts), counts


@pytest.mark.parametrize("k", [1, 37, 500])
def test_sample_of_everything_gives_exact_topk(k):
    values = cw.rank_vector(1, 5000)
    chosen = dgc.select_indices(values, k, sample_ratio=1.0, generator=None)
    want = torch.topk(values.abs(), k).indices.sort().values
    assert torch.equal(chosen, want)


def test_too_many_selected_are_rethresholded_to_the_k_largest():
    """A sample of 4 entries gives a low threshold (k_s = 1 of 4 is about the 75th
    percentile): thousands pass; the re-threshold keeps exactly the k largest of them."""
    values = cw.rank_vector(2, 10_000)
    gen = torch.Generator().manual_seed(0)
    threshold = dgc.sampled_threshold(
        values.abs(), 10, 0.0004, torch.Generator().manual_seed(0), min_sample=4
    )
    assert int((values.abs() >= threshold).sum()) > 10  # the estimate alone picks too many
    chosen = dgc.select_indices(values, 10, 0.0004, gen, min_sample=4)
    assert torch.equal(chosen, torch.topk(values.abs(), 10).indices.sort().values)


def test_slots_and_warmup_schedule_follow_the_paper():
    config = dgc.DGCConfig(sparsity=0.999, warmup_stage_steps=3)
    got = [dgc.sparsity_at(step, config) for step in range(16)]
    want = [0.75] * 3 + [0.9375] * 3 + [0.984375] * 3 + [0.996] * 3 + [0.999] * 4
    assert got == want
    assert [dgc.slots_for(100_000, s) for s in (0.75, 0.9375, 0.984375, 0.996, 0.999)] == [
        25_000,
        6_250,
        1_563,
        400,
        100,
    ]
    assert dgc.sparsity_at(0, dgc.DGCConfig(sparsity=0.999)) == 0.999  # no warm-up
    assert dgc.slots_for(10, 0.999) == 1 and dgc.slots_for(10, 0.0) == 10


@pytest.mark.parametrize("bad", [dict(sparsity=1.0), dict(sample_ratio=0.0), dict(clip_norm=-1.0)])
def test_bad_config_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="must be"):
        dgc.DGCConfig(**bad)


# --- the per-rank state: error feedback, momentum, masking, clipping ------------------


@pytest.mark.parametrize("momentum_correction", [False, True])
def test_error_feedback_conserves_mass_exactly(momentum_correction):
    """sent + residual == what was accumulated (bit for bit), step after step."""
    n = 3000
    config = dgc.DGCConfig(sparsity=0.99, momentum_correction=momentum_correction, sample_ratio=0.05)
    state, gen = dgc.DGCState.zeros_like(torch.zeros(n)), torch.Generator().manual_seed(0)
    for step in range(5):
        grad = cw.rank_vector(0, n, seed=step)
        velocity = state.velocity * config.momentum + grad if momentum_correction else grad
        accumulated = state.accumulated + velocity
        indices, values = dgc.compress_step(state, grad, config, 1, gen)
        assert 0 < indices.numel() <= dgc.slots_for(n, 0.99)
        assert torch.equal(dense_of(indices, values, n) + state.accumulated, accumulated)
        assert torch.all(state.accumulated[indices] == 0)


def test_without_error_feedback_nothing_is_kept():
    config = dgc.DGCConfig(sparsity=0.99, error_feedback=False, momentum_correction=False)
    state = dgc.DGCState.zeros_like(torch.zeros(1000))
    dgc.compress_step(state, cw.rank_vector(0, 1000), config, 1, torch.Generator().manual_seed(0))
    assert torch.count_nonzero(state.accumulated) == 0


@pytest.mark.parametrize("masking", [True, False])
def test_momentum_factor_masking_clears_the_velocity_of_sent_entries(masking):
    n, m = 2000, 0.9
    config = dgc.DGCConfig(sparsity=0.95, momentum=m, momentum_masking=masking, sample_ratio=1.0)
    state, gen = dgc.DGCState.zeros_like(torch.zeros(n)), torch.Generator().manual_seed(0)
    dgc.compress_step(state, cw.rank_vector(0, n, seed=0), config, 1, gen)
    velocity_before = state.velocity.clone()
    grad = cw.rank_vector(0, n, seed=1)
    indices, _ = dgc.compress_step(state, grad, config, 1, gen)
    expected = velocity_before * m + grad
    if masking:
        expected[indices] = 0.0
    assert torch.equal(state.velocity, expected)


def test_local_clipping_clips_the_rank_gradient_at_sqrt_n_times_the_threshold():
    grad = cw.rank_vector(3, 500) * 100
    clipped = dgc.clip_local(grad, clip_norm=2.0, world_size=4)
    torch.testing.assert_close(torch.linalg.vector_norm(clipped), torch.tensor(4.0))  # 2 * sqrt(4)
    torch.testing.assert_close(clipped / torch.linalg.vector_norm(clipped), grad / grad.norm())
    small = grad / grad.norm() * 3.9
    assert torch.equal(dgc.clip_local(small, clip_norm=2.0, world_size=4), small)
    # in compress_step: with sparsity 0 and no momentum, what is sent is the clipped gradient
    config = dgc.DGCConfig(sparsity=0.0, momentum_correction=False, clip_norm=2.0)
    state = dgc.DGCState.zeros_like(grad)
    indices, values = dgc.compress_step(state, grad, config, 4, None)
    assert torch.equal(dense_of(indices, values, 500), clipped)


@pytest.mark.parametrize("world_size", [2, 3])
def test_first_update_with_local_clipping_is_the_papers(world_size):
    """Lin et al. 2018, Algorithm 1 and section 3.2: node k's gradient already carries the 1/N of
    the average, G_k = grad_k / N, and is clipped at clip_norm * N^-1/2; the update is the sum
    of the clipped G_k. A one-layer least-squares model whose every rank's gradient is longer
    than the threshold (so every step clips); DGC sends every entry (sparsity 0). The paper's
    first update is computed here by formula, the gradient in closed form (2/b X^T (X w - y));
    with clipping off the update is the average gradient, as it always was."""
    clip_norm, lr = 0.5, 0.1
    config = dict(sparsity=0.0, momentum=0.9, clip_norm=clip_norm)
    configs = [config, {**config, "clip_norm": None}]
    outs = md.launch(cw.one_layer_first_update, world_size, args=(configs, lr), timeout=90)
    weight = cw.ONE_LAYER_WEIGHT.double()
    paper, average = torch.zeros_like(weight), torch.zeros_like(weight)
    for rank in range(world_size):
        x, y = (t.double() for t in cw.one_layer_data(rank))
        grad = 2.0 / len(x) * x.T @ (x @ weight - y)  # d/dw of mean((x w - y)^2)
        share, threshold = grad / world_size, clip_norm / math.sqrt(world_size)
        assert share.norm() > 10 * threshold  # every rank clips
        paper += share * (threshold / share.norm())
        average += share
    for clipped, plain in outs:
        torch.testing.assert_close(clipped.double(), lr * paper, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(plain.double(), lr * average, rtol=1e-5, atol=1e-6)
    # the issue-26 bug, clipping grad_k at clip_norm / sqrt(N) before dividing by N, moved 1/N of this
    assert not torch.allclose(outs[0][0].double(), lr * paper / world_size, rtol=0.1)


def test_pack_unpack_and_sparse_sum_equal_a_dense_reference():
    n, k = 1000, 40
    payloads, want = [], torch.zeros(n)
    for rank in range(3):
        values = cw.rank_vector(rank, n)
        indices = dgc.select_indices(values, k - rank * 5, 1.0, None)  # fewer than k: padding
        payloads.append(dgc.pack(indices, values[indices], k))
        want += dense_of(indices, values[indices], n)
    assert torch.equal(dgc.sum_sparse(torch.stack(payloads), n), want)
    with pytest.raises(TypeError, match="float32"):
        dgc.pack(torch.arange(3), torch.ones(3, dtype=torch.float64), 3)


def test_sign_bits_round_trip_and_error_feedback():
    values = cw.rank_vector(4, 1001)
    assert torch.equal(
        baselines.unpack_signs(baselines.pack_signs(values), 1001), torch.where(values >= 0, 1.0, -1.0)
    )
    error = torch.zeros(1001)
    message = baselines.sign_compress(error, values)
    assert message.dtype == torch.uint8 and message.numel() == 4 + math.ceil(1001 / 8)
    sent = baselines.sign_decompress_sum(message[None], 1001)
    torch.testing.assert_close(sent + error, values, rtol=0, atol=1e-6)
    torch.testing.assert_close(sent.abs(), torch.full((1001,), values.abs().mean().item()))


# --- through the communicator and DDP ------------------------------------------------------


@pytest.mark.parametrize("transport", ["shm", "pipe"])
def test_sparse_allgather_equals_a_dense_reference_sum(transport):
    """3 ranks, 3 steps, sampled thresholds: every rank's averaged result equals the average of
    the per-rank compress_step outputs, replayed in one process with the same generators."""
    n, p, steps = 5000, 3, 3
    config = dgc.DGCConfig(sparsity=0.99, warmup_stage_steps=1, sample_ratio=0.05, seed=3)
    outs = md.launch(cw.dgc_hook_steps, p, args=(n, config, steps), transport=transport, timeout=90)
    states = [dgc.DGCState.zeros_like(torch.zeros(n)) for _ in range(p)]
    gens = [torch.Generator().manual_seed(config.seed * 1000 + r) for r in range(p)]
    for step in range(steps):
        want = torch.zeros(n)
        for rank in range(p):
            indices, values = dgc.compress_step(
                states[rank], cw.rank_vector(rank, n, seed=step), config, p, gens[rank]
            )
            want += dense_of(indices, values, n)
        for rank in range(p):
            torch.testing.assert_close(outs[rank][step], want / p, rtol=0, atol=1e-7)


@pytest.mark.parametrize(("transport", "bucket_mb"), [("shm", w.SEVERAL_BUCKETS_MB), ("pipe", math.inf)])
def test_dgc_sparsity_zero_with_momentum_correction_equals_momentum_sgd(transport, bucket_mb):
    """Everything sent (sparsity 0, no masking): u is momentum SGD's buffer per rank, and the
    average of the ranks' u is the momentum of the average gradient. DDP on 2 ranks with plain
    SGD == one process with SGD(momentum=0.9), up to float rounding (with several buckets,
    launched while backward runs, each with its own state)."""
    cfg = w.config(steps=4, lr=0.05, bucket_mb=bucket_mb)
    config = dgc.DGCConfig(sparsity=0.0, momentum=0.9, momentum_masking=False)
    outs = md.launch(cw.train_with_hook, 2, args=(cfg, "dgc", 0.0, config), transport=transport, timeout=90)
    want = cw.train_single_sgd(cfg, momentum=0.9)
    for out in outs:
        assert_states_close(out, want)
    plain = cw.train_single_sgd(cfg, momentum=0.0)  # the test can fail: momentum matters here
    assert not torch.allclose(want["head.weight"], plain["head.weight"], atol=1e-4)


def test_bytes_on_the_wire_equal_the_formulas():
    """pipe transport (every byte is a message): per rank, DGC's allgather (N-1) k 8 and sign's
    (N-1)(4 + n/8) for every rank; the ring allreduce's 2(N-1)/N n itemsize on average."""
    n, sparsity = 10_007, 0.99
    k = dgc.slots_for(n, sparsity)
    dgc_bytes = {}
    for p in (2, 3, 4):
        outs = md.launch(cw.bytes_per_hook, p, args=(n, sparsity), transport="pipe", timeout=90)
        for out in outs:
            assert out["dgc"] == traffic.sparse_allgather_bytes(k, p) == (p - 1) * k * 8
            assert out["sign"] == traffic.sign_allgather_bytes(n, p)
        assert statistics.mean(o["dense"] for o in outs) == pytest.approx(traffic.dense_ring_bytes(n, p))
        assert statistics.mean(o["bf16"] for o in outs) == pytest.approx(traffic.dense_ring_bytes(n, p, 2))
        dgc_bytes[p] = outs[0]["dgc"]
    assert dgc_bytes[4] == 3 * dgc_bytes[2]  # the allgather's traffic grows with N


@pytest.mark.parametrize(("kind", "transport"), [("bf16", "pipe"), ("sign", "shm")])
def test_bf16_and_sign_hooks_equal_a_single_process_emulation(kind, transport):
    cfg = w.config(steps=3, lr=0.05, bucket_mb=math.inf)
    outs = md.launch(cw.train_with_hook, 2, args=(cfg, kind, 0.9), transport=transport, timeout=90)
    want = cw.emulate_compressed(cfg, kind, momentum=0.9)
    for out in outs:
        assert_states_close(out, want)
    exact = cw.train_single_sgd(cfg, momentum=0.9)  # the compression changes the result
    assert not all(torch.allclose(want[name], exact[name], atol=1e-5) for name in want)


def test_dgc_with_every_component_keeps_the_ranks_identical_and_differs_from_dense():
    """Warm-up, clipping, masking, sampled thresholds through DDP on 2 ranks: every rank
    applies the same averaged sparse gradient, so the replicas stay bit-identical."""
    cfg = w.config(steps=3, lr=0.05, bucket_mb=math.inf)
    config = dgc.DGCConfig(sparsity=0.9, warmup_stage_steps=1, clip_norm=1.0)
    outs = md.launch(cw.train_with_hook, 2, args=(cfg, "dgc", 0.0, config), transport="pipe", timeout=90)
    for name in outs[0]:
        assert torch.equal(outs[0][name], outs[1][name]), name
    dense = cw.train_single_sgd(cfg, momentum=0.9)
    assert not torch.allclose(outs[0]["hidden.weight"], dense["hidden.weight"], atol=1e-5)


@pytest.mark.timeout(300)
def test_bench_experiment_counts_bert_bytes_against_the_formulas():
    """Lecture 6's experiment on BERT tiny, 3 steps, 2 ranks (no timing run): measured bytes per
    step equal the formulas, and DGC at 99.9% sends >= 100x fewer bytes than dense."""
    from minidist.models.bert_compression import compare_hooks
    from minidist.parallel.compression.ablation import ROWS, CompressionBench

    cfg = CompressionBench(batch=2, seq=16, steps=3, warmup_stage_steps=0, loss_window=2)
    rows = (ROWS[0], ROWS[1], ROWS[-1])  # dense, DGC, sign EF
    result = compare_hooks(cfg, rows=rows, timing=False)
    by_label = {r["label"]: r for r in result["rows"]}
    for r in result["rows"]:
        assert r["bytes_per_step"] == pytest.approx(r["formula_bytes"]), r["label"]
        assert math.isfinite(r["loss"])
    assert by_label["DGC"]["ratio"] >= 100
    assert by_label["dense"]["formula_bytes"] == traffic.dense_ring_bytes(result["numel"], 2)


def test_dgc_step_sparse_sum_and_sign_bits_on_cuda_equal_cpu():
    """The compressors are device-agnostic tensor code: on a GPU they give the CPU's result."""
    n, config = 20_000, dgc.DGCConfig(sparsity=0.99, sample_ratio=1.0)
    cpu, gpu = dgc.DGCState.zeros_like(torch.zeros(n)), dgc.DGCState.zeros_like(torch.zeros(n, device="cuda"))
    for step in range(3):
        grad = cw.rank_vector(0, n, seed=step)
        indices, values = dgc.compress_step(cpu, grad, config, 2, None)
        indices_gpu, values_gpu = dgc.compress_step(gpu, grad.cuda(), config, 2, None)
        assert torch.equal(indices, indices_gpu.cpu())
        torch.testing.assert_close(values, values_gpu.cpu())
        k = dgc.slots_for(n, 0.99)
        payload = torch.stack([dgc.pack(indices_gpu, values_gpu, k)] * 2)
        torch.testing.assert_close(dgc.sum_sparse(payload, n).cpu(), 2 * dense_of(indices, values, n))
    signs = cw.rank_vector(1, 1001)
    packed = baselines.pack_signs(signs.cuda())
    assert torch.equal(packed.cpu(), baselines.pack_signs(signs))
    assert torch.equal(baselines.unpack_signs(packed, 1001).cpu(), torch.where(signs >= 0, 1.0, -1.0))

"""Choosing a layout (``memory.layout``, ``memory.step_time``, ``memory.cluster``, ``bench.layout``).

Each formula against an independent reference (``memory.flops_per_token``, ``cost_model``'s ring,
``pipeline.bubble_formula``, ``memory.estimate``, the numbers written out by hand), and the two
published thresholds students meet: data parallelism compute-bound above C/W tokens a device
(Austin et al., "How to Scale Your Model", part 5: 2,550 for TPU v5p) and TP's collapse across
nodes by the links' bandwidth ratio. None of these launches; the last test runs
``python -m minidist.bench layout`` once (in this process), small (3 layouts of the tiny decoder on 4 ranks).
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from minidist import memory
from minidist.bench.__main__ import main
from minidist.bench.layout import parse_layout
from minidist.memory import step_time as st
from minidist.memory.cluster import LAPTOP_1G, Batch, Cluster, h100_cluster, laptop_cluster
from minidist.memory.layout import (
    Layout,
    dp_critical_tokens,
    enumerate_layouts,
    predict,
    stage_flops_per_token,
    tp_collapse_factor,
)
from minidist.models import decoder
from minidist.parallel import pipeline as pp
from minidist.transport.emulated import LinkSpec

MINI = decoder.CONFIGS["mini"]
# attention adds s/(6d) ~ 0.3% to the FLOPs; the embedding (synchronised after backward) 0.3% of the weights
WIDE = decoder._decoder(2, 4096, 32, vocab=512, positions=64)
LINK = LinkSpec(alpha_s=1e-5, bandwidth_Bps=1e9)


@pytest.mark.parametrize(
    "name", ["mini", "gpt3-175b", "bloom-176b", "moe-tiny", "mixtral-8x7b", "deepseek-v3"]
)
@pytest.mark.parametrize("stages", [1, 2])
def test_stage_flops_add_up_to_flops_per_token(name, stages):
    cfg = decoder.CONFIGS[name]
    total = sum(stage_flops_per_token(cfg, 512, stages, s) for s in range(stages))
    assert total == pytest.approx(memory.flops_per_token(cfg, 512), rel=1e-12)


def test_moe_flops_count_top_k_experts_not_all():
    """A MoE block costs its router and top_k experts a token (``counting``'s active count)."""
    cfg = decoder.CONFIGS["moe-tiny"]
    dense = dataclasses.replace(cfg, num_experts=0)
    d, width = cfg.hidden_size, cfg.moe_d_ffn or cfg.ffn_size
    expert = 3 * d * width  # swiglu, no bias: up, gate, down
    extra = cfg.n_layers * 6 * ((cfg.top_k - 1) * expert + d * cfg.num_experts)
    assert stage_flops_per_token(cfg, 128) - stage_flops_per_token(dense, 128) == extra


def test_collective_times_are_the_ring_formulas():
    n, p, a, w = 3e6, 4, LINK.alpha_s, LINK.bandwidth_Bps
    assert st.allreduce_s(n, p, LINK) == pytest.approx(2 * (p - 1) * a + 2 * (p - 1) / p * n / w)
    assert st.allgather_s(n, p, LINK) == pytest.approx((p - 1) * a + (p - 1) / p * n / w)
    assert st.allreduce_s(n, 1, LINK) == 0 == st.allgather_s(n, 1, LINK)
    assert st.tensor_parallel_s(100, 64, 3, 2, 2, LINK) == pytest.approx(12 * (2 * a + 100 * 64 * 2 / w))
    assert st.data_parallel_s(n, p, LINK, 3) == pytest.approx(1.5 * st.data_parallel_s(n, p, LINK, 1))
    assert st.data_parallel_s(n, p, LINK, 2) == st.data_parallel_s(n, p, LINK, 0)
    # CP: 3 (c-1) ring steps a layer, K and V of this rank's tokens, split over tp heads
    assert st.context_parallel_s(256, 64, 2, 4, 2, 2, LINK) == pytest.approx(
        2 * 9 * (a + 2 * 256 * 64 * 2 / 2 / w)
    )
    # EP: 4 all-to-alls a MoE layer, (e-1) messages, (e-1)/e of the top-k routed vectors
    assert st.expert_parallel_s(256, 64, 2, 4, 2, 2, LINK) == pytest.approx(
        8 * (3 * a + 0.75 * 256 * 2 * 64 * 2 / w)
    )
    assert (
        st.context_parallel_s(256, 64, 2, 1, 1, 2, LINK)
        == 0
        == st.expert_parallel_s(256, 64, 2, 1, 2, 2, LINK)
    )


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 8), (4, 1)])
def test_pipeline_time_gives_the_bubble_of_the_schedules(stages, microbatches):
    t = 0.3
    total = st.pipeline_s([t] * stages, microbatches)
    assert total == pytest.approx((microbatches + stages - 1) * t)
    assert 1 - microbatches * t / total == pytest.approx(pp.bubble_formula(stages, microbatches))
    # unequal stages: the slowest sets the pace
    assert st.pipeline_s([1.0, 3.0], 5) == pytest.approx(1 + 3 + 4 * 3)


def test_dp_threshold_is_the_scaling_books_number():
    """Austin et al., "How to Scale Your Model" (2025), part 5 "Data Parallelism": TPU v5p,
    C = 4.6e14 FLOP/s, W = 2 x 9e10 B/s (bidirectional ICI ring): "our batch size per chip must be
    at least 2,550 to avoid being communication-bound"."""
    assert dp_critical_tokens(flops_per_s=4.6e14, bandwidth_Bps=2 * 9e10) == pytest.approx(2550, rel=0.005)
    # the presets: C = 989 TFLOP/s x 0.4 over one node's NVLink (450 GB/s) or 2 nodes' NICs (50 GB/s)
    assert dp_critical_tokens(h100_cluster(1)) == pytest.approx(395.6e12 / 450e9)
    assert dp_critical_tokens(h100_cluster(2)) == pytest.approx(395.6e12 / 50e9)
    # fp32 gradients double it; a ring of q ranks sends (q-1)/q of them
    assert dp_critical_tokens(flops_per_s=4.6e14, bandwidth_Bps=2 * 9e10, grad_bytes=4, ranks=4) == (
        pytest.approx(2 * 0.75 * 4.6e14 / 1.8e11)
    )


def _dp_exposed(cfg, cluster, dp, tokens_per_device, precision="mixed"):
    seq = 64
    batch = Batch(dp * max(1, round(tokens_per_device / seq)), seq)
    return predict(cfg, cluster, batch, Layout(dp=dp), precision=precision).parts["dp"]


@pytest.mark.parametrize(
    "cluster,dp,precision,threshold",
    [
        (h100_cluster(1), 8, "mixed", 769.2),
        (h100_cluster(2), 16, "mixed", 7417.5),
        (LAPTOP_1G, 4, "fp32", 600),
    ],
    ids=["8xH100-NVLink", "2x8xH100-IB", "laptop-1G"],
)
def test_predicted_dp_crossover_sits_at_the_threshold(cluster, dp, precision, threshold):
    """The course's presets, b* = (q-1)/q x g/2 x C/W: 395.6 TFLOP/s (989 at mfu 0.4) over NVLink's
    450 GB/s, 8 ranks: 7/8 x 879 = 769 tokens; over 50 GB/s InfiniBand, 16 ranks: 15/16 x 7,912 =
    7,418; the laptop (50 GFLOP/s, 1 Gbit/s, fp32 gradients, 4 ranks): 3/4 x 2 x 400 = 600. The
    step model exposes the allreduce below the threshold and hides it above (5% either side)."""
    grad_bytes = 4 if precision == "fp32" else 2
    link = cluster.link(dp)
    b = dp_critical_tokens(flops_per_s=cluster.flops_per_s, bandwidth_Bps=link.bandwidth_Bps,
                           grad_bytes=grad_bytes, ranks=dp)  # fmt: skip
    assert b == pytest.approx(threshold, rel=1e-4)
    words = (512 + 64 + (2 if WIDE.embedding_layernorm else 0)) * 4096  # words, positions (, LayerNorm)
    embedding = st.data_parallel_s(words * grad_bytes, dp, link)  # after backward, always exposed
    assert _dp_exposed(WIDE, cluster, dp, 0.95 * b, precision) > embedding * 1.01
    assert _dp_exposed(WIDE, cluster, dp, 1.05 * b, precision) == pytest.approx(embedding)


def test_tp_across_nodes_collapses_by_the_bandwidth_ratio():
    """NVLink 450 GB/s against one 400 Gbit/s NIC a GPU (50 GB/s): 9 x (15/16)/(7/8) = 9.64 for
    TP 16 over 2 nodes against TP 8 in one (Narayanan et al. 2021, sec. 3.3, keep TP in a server)."""
    two = h100_cluster(2)
    assert tp_collapse_factor(two) == pytest.approx(9 * (15 / 16) / (7 / 8))
    cfg = decoder.CONFIGS["gpt3-175b"]
    batch = Batch(64, 2048)  # large messages: alpha is 0.7% of an allreduce on NVLink
    across = predict(cfg, two, batch, Layout(tp=16))
    inside = predict(cfg, two, batch, Layout(tp=8, dp=2))
    # the same tokens per TP group: across sees all 64 sequences, inside 32 per group
    ratio = across.parts["tp"] / inside.parts["tp"]
    assert ratio == pytest.approx(2 * tp_collapse_factor(two), rel=0.01)
    assert across.step_s > 2 * inside.step_s  # half the compute each, and still far slower


def test_enumeration_covers_every_factorisation_and_ranks_them():
    plans = enumerate_layouts(MINI, LAPTOP_1G, Batch(8, 128), precision="fp32", zero_stages=(0,))
    layouts = [p.layout for p in plans]
    # (dp, tp, pp, cp) with product 4 = 2^2: two factors of 2 among 4 slots, C(5, 3) = 10 ways;
    # heads 4, layers 4, seq 128 and batch 8 allow every one
    assert len(layouts) == len(set(layouts)) == math.comb(5, 3)
    assert all(lay.devices == 4 and lay.ep == 1 for lay in layouts)
    steps = [p.step_s for p in plans]
    assert steps == sorted(steps)
    for plan in plans:
        assert sum(plan.parts.values()) == pytest.approx(plan.step_s)
        assert plan.tokens_per_s == pytest.approx(8 * 128 / plan.step_s)


def test_enumeration_respects_divisibility_and_zero_needs_a_data_parallel_group():
    cfg = decoder._decoder(6, 96, 3, vocab=600, positions=64)  # 3 heads, 6 layers
    plans = enumerate_layouts(cfg, laptop_cluster(4), Batch(6, 60))
    for plan in plans:
        lay = plan.layout
        assert cfg.n_heads % lay.tp == 0 and cfg.n_layers % lay.pp == 0 and 60 % lay.cp == 0
        assert 6 % lay.dp == 0
        assert lay.zero == 0 or lay.dp * lay.cp > 1
    assert {p.layout.tp for p in plans} == {1}  # 3 heads: neither 2 nor 4 divides them


def test_memory_is_the_calculators_and_layouts_over_memory_rank_last():
    cfg = decoder.CONFIGS["opt-175b"]  # 50,272 words: no padding for tp 8
    cluster = h100_cluster(8)
    batch = Batch(64, 2048)
    plans = enumerate_layouts(cfg, cluster, batch, zero_stages=(0, 1))
    fits = [p.fits for p in plans]
    assert any(fits) and not all(fits)
    assert fits == sorted(fits, reverse=True)  # every layout that fits before any that does not
    plan = next(p for p in plans if p.layout == Layout(dp=1, tp=8, pp=8, zero=0))
    want = memory.estimate(cfg, batch=1, seq=2048, dp=1, tp=8, pp=8, stage=7)  # the fuller stage
    assert plan.memory["total"] == max(
        want["total"], memory.estimate(cfg, batch=1, seq=2048, tp=8, pp=8)["total"]
    )
    assert plan.fits == (plan.memory["total"] <= 80e9)
    cp = predict(cfg, cluster, batch, Layout(dp=1, tp=8, pp=2, cp=4))  # ring attention: its own formula
    per_layer = memory.activation_bytes_per_layer_cp(2048, 1, cfg.hidden_size, cfg.n_heads, cp=4, tp=8)
    assert cp.memory["activations"] == round(per_layer * 48 * 2)  # stage 0: 48 layers, 2 microbatches held
    one = predict(cfg, cluster, batch, Layout(dp=64))  # 175B on every GPU: 2.8 TB of states
    assert not one.fits and one.memory["total"] > 16 * 174e9


def test_moe_layouts_split_experts_over_data_parallel_ranks():
    """EP inside DP (ep divides dp and the experts), no TP for a MoE config (``estimate``'s limit);
    memory is ``estimate(ep=)``'s; the all-to-alls are charged only with ep > 1."""
    cfg, batch = decoder.CONFIGS["moe-tiny"], Batch(8, 128)
    plans = enumerate_layouts(cfg, LAPTOP_1G, batch, precision="fp32", zero_stages=(0,))
    eps = {(p.layout.dp, p.layout.ep) for p in plans}
    assert {(4, 4), (4, 2), (2, 2), (4, 1)} <= eps and all(dp % ep == 0 for dp, ep in eps)
    assert all(p.layout.tp == 1 for p in plans)
    assert all(p.layout.ep == 1 for p in enumerate_layouts(MINI, LAPTOP_1G, batch, zero_stages=(0,)))
    split = predict(cfg, LAPTOP_1G, batch, Layout(dp=4, ep=4), precision="fp32")
    whole = predict(cfg, LAPTOP_1G, batch, Layout(dp=4, ep=1), precision="fp32")
    want = memory.estimate(cfg, batch=2, seq=128, dp=4, ep=4, precision="fp32")
    assert split.memory == want
    assert whole.memory["params"] - split.memory["params"] == 4 * 3 / 4 * want["expert_params_count"] * 4
    assert split.parts["ep"] > 0 and whole.parts["ep"] == 0
    # EP: 4 all-to-alls a MoE layer of the rank's 256 tokens, top-2, d = 64, fp32
    link = LAPTOP_1G.intra
    assert split.parts["ep"] == pytest.approx(st.expert_parallel_s(256, 64, 2, 4, 2, 4, link))


def test_bad_input_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="mfu"):
        Cluster("x", 8, 1, 80e9, 1e15, LINK, LINK, mfu=0)
    with pytest.raises(ValueError, match="sequences"):
        Batch(0, 128)


def test_layout_bench_runs_the_layouts_and_sends_the_predicted_bytes(tmp_path, capsys):
    """Tiny decoder, 4 ranks, DP4 / TP2xDP2 / PP2xDP2, one timed step: every row printed with
    its ratio; the bytes each rank sent equal the formulas (the real model's parameters, TP's
    4 allreduces a layer, PP's activations), so the timed ranks hold and move what the layout
    would. No timing threshold: the ratio is printed, not asserted."""
    layouts = ["DP4", "TP2xDP2", "PP2xDP2"]
    args = [
        "layout",
        "--model",
        "tiny",
        "--sequences",
        "4",
        "--seq",
        "32",
        "--steps",
        "1",
        "--layouts",
        *layouts,
    ]
    main([*args, "--out", str(tmp_path)])  # python -m minidist.bench layout ..., in this process
    printed = capsys.readouterr().out
    for name in layouts:
        assert any(line.strip().startswith(name) for line in printed.splitlines()), name
    assert "pred/emul" in printed and "Spearman" in printed
    rows = json.loads((tmp_path / "layout.json").read_text())["batches"]["4"]["rows"]
    cfg, batch = decoder.CONFIGS["tiny"], Batch(4, 32)
    with torch.device("meta"):
        numel = sum(p.numel() for p in decoder.DecoderLM(cfg).parameters())
    act = 32 * cfg.hidden_size * 4  # one sequence's activations, fp32
    want = {
        "DP4": [2 * 3 / 4 * numel * 4] * 4,  # ring allreduce of the gradients
        "TP2xDP2": [4 * cfg.n_layers * 2 * act + memory.stage_parameter_count(cfg, tp=2) * 4] * 4,
        "PP2xDP2": [
            2 * (act + 64) + memory.stage_parameter_count(cfg, pp=2, stage=s) * 4 for s in (0, 0, 1, 1)
        ],
    }
    for name, row in rows.items():
        plan = predict(cfg, LAPTOP_1G, batch, parse_layout(name), precision="fp32")
        assert row["predicted_s"] == pytest.approx(plan.step_s)
        assert row["ratio"] == pytest.approx(row["predicted_s"] / row["emulated_s"])
        assert row["bytes_sent"] == pytest.approx(want[name], rel=1e-4), name

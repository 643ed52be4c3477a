"""``memory.estimate`` for mixtures of experts and expert parallelism (``memory.experts``).

Parameters against models built here (a moe-tiny decoder whose MoE layers are swapped for the
``ExpertParallelMoE`` of one rank, Mixtral 8x7B on the meta device), ZeRO and activations
against the formulas written out by hand.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from minidist import memory
from minidist.memory.experts import moe_activation_bytes_per_layer
from minidist.models import decoder
from minidist.parallel.experts import ExpertParallelMoE, MoELayer


def ep_rank_model(cfg, ep: int, rank: int) -> decoder.DecoderLM:
    """The model one EP rank holds: every MoE layer keeps its E/ep experts (built on meta)."""
    with torch.device("meta"):
        model = decoder.DecoderLM(cfg)
        comm = SimpleNamespace(rank=rank, world_size=ep)  # the layer reads only these at build time
        for block in model.transformer.blocks:
            if isinstance(block.mlp, MoELayer):
                block.mlp = ExpertParallelMoE(block.mlp, comm)
    return model


@pytest.mark.parametrize("name", ["moe-tiny", "mixtral-8x7b"])
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_parameters_on_an_ep_rank_equal_the_built_model(name, ep):
    cfg = decoder.CONFIGS[name]
    model = ep_rank_model(cfg, ep, rank=ep - 1)
    held = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    est = memory.estimate(cfg, batch=1, seq=16, dp=ep, ep=ep, precision="mixed")
    assert est["params_count"] == held and est["expert_params_count"] == experts
    assert est["params"] == 2 * held and est["grads"] == 2 * held and est["optimizer"] == 12 * held
    if ep == 1:
        assert held == decoder.parameter_count(cfg)


def test_zero_shards_dense_over_dp_and_experts_over_dp_over_ep():
    cfg = decoder.CONFIGS["mixtral-8x7b"]
    d, v, f = 4096, 32000, 14336
    dense = (
        2 * v * d + 32 * (2 * d * d + 2 * d * 1024 + d * 8 + 2 * d) + d
    )  # embeddings, head, attention, routers, norms
    experts_per_rank = 32 * (8 // 4) * 3 * d * f  # ep = 4: 2 of the 8 experts of every layer
    est = memory.estimate(cfg, batch=1, seq=16, dp=16, ep=4, zero_stage=3)
    shard = -(-dense // 16) + -(-experts_per_rank // 4)  # experts replicated on dp / ep = 4 ranks
    assert est["params_count"] == dense + experts_per_rank
    assert (est["params"], est["grads"], est["optimizer"]) == (2 * shard, 2 * shard, 12 * shard)
    one = memory.estimate(cfg, batch=1, seq=16, dp=16, ep=4, zero_stage=1)
    assert one["params"] == 2 * (dense + experts_per_rank) and one["optimizer"] == 12 * shard


def test_activations_count_the_top_k_experts():
    cfg = replace(decoder.CONFIGS["moe-tiny"], first_dense_layers=1, num_shared_experts=1)
    s, b, h, a, f, e, k = 16, 3, 64, 4, 128, 8, 2
    attention = 11 * s * b * h + 5 * a * s * s * b + 4 * s * b * h
    dense = attention + 2 * s * b * h + 8 * s * b * f + s * b * h  # SwiGLU A(f) = 8f bytes a token
    moe = attention + 2 * s * b * h + 2 * s * b * e + k * (2 * s * b * h + 8 * s * b * f + 2 * s * b * h)
    moe += 8 * s * b * f + s * b * h  # one shared expert of width f; the dropout mask
    assert moe_activation_bytes_per_layer(cfg, s, b, 0) == dense
    assert moe_activation_bytes_per_layer(cfg, s, b, 1) == moe
    assert memory.estimate(cfg, batch=b, seq=s)["activations"] == dense + moe
    assert memory.estimate(cfg, batch=b, seq=s, recompute="full")["activations"] == 2 * 2 * s * b * h
    # the same accounting gives the paper's layer for a GPT block (GELU, f = 4h)
    gpt = decoder.CONFIGS["tiny"]
    want = memory.activation_bytes_per_layer(s, b, gpt.hidden_size, gpt.n_heads)
    assert moe_activation_bytes_per_layer(gpt, s, b, 0) == want


def test_bad_layouts_are_refused():
    cfg = decoder.CONFIGS["moe-tiny"]
    with pytest.raises(ValueError, match="tp=1"):
        memory.estimate(cfg, batch=1, seq=8, tp=2)
    with pytest.raises(ValueError, match="must divide num_experts=8 and dp=2"):
        memory.estimate(cfg, batch=1, seq=8, dp=2, ep=4)
    with pytest.raises(ValueError, match="must divide"):
        memory.estimate(cfg, batch=1, seq=8, dp=3, ep=3)


def test_flops_per_token_count_active_parameters():
    cfg = decoder.CONFIGS["mixtral-8x7b"]
    active_without_head = decoder.active_parameter_count(cfg) - cfg.vocab_size * cfg.hidden_size
    assert memory.flops_per_token(cfg, 4096, attention=False) == 6 * active_without_head
    two = replace(cfg, num_experts=2, top_k=2)  # 2 experts, both active: the same FLOPs but the routers'
    router_difference = 6 * cfg.n_layers * cfg.hidden_size * (8 - 2)
    assert memory.flops_per_token(cfg, 4096) - memory.flops_per_token(two, 4096) == router_difference

"""Memory of a mixture of experts, and of expert parallelism (EP), for ``per_rank.estimate``.

Experts multiply parameters, not compute: every rank of a data-parallel replica holds the model
states of ALL its experts, but a token's activations are those of its top_k experts only.

Model states. A config's parameters split into a dense part (embeddings, attention, norms,
routers, shared experts, dense FFNs, the output matrix) and the routed experts. With EP over
``ep`` ranks (inside the data-parallel group: each EP rank routes its own tokens, so the ep
ranks are data-parallel replicas of the dense part), a rank holds

    dense  +  experts / ep

and ZeRO shards the dense part's states over the dp ranks, the experts' over the dp / ep ranks
that hold the same experts (DeepSpeed-MoE's and Megatron-Core's "expert data parallel" group).

Activations (Korthikanti et al.'s accounting, 16-bit values, 1-byte dropout masks; see
``activations.activation_bytes_per_layer``), per layer, s tokens x b sequences, A(f) the bytes a
FFN of width f saves per token beyond its input -- GELU 4f (its input and output), SwiGLU 8f
(gate and up outputs, SiLU output, their product):

    attention + 2 LayerNorms      11 sbh + 5 a s² b + 4 sbh        (as the paper's multi-head
                                                                     attention; GQA and MLA save less)
    dense FFN                     2 sbh + sb·A(f) + sbh
    MoE FFN                       2 sbh  (the norm's output: router and dispatch input)
                                  + 2 sbE  (the router's softmax)
                                  + k · (2 sbh + sb·A(f_moe) + 2 sbh)   (each routed copy: its
                                    input, the expert's insides, its output kept for the gate)
                                  + sb·A(f_moe · shared)  + sbh (dropout mask)

For a GPT block (f = 4h, GELU) the dense line is the paper's 19 sbh. With balanced routing EP
does not change a rank's activations (its experts process as many rows as its own tokens
send out); a capacity factor cf bounds the routed part by cf times that.
"""

from __future__ import annotations

from minidist.models import counting
from minidist.models.transformer import TransformerConfig

__all__ = ["moe_parameter_split", "moe_activation_bytes_per_layer", "ffn_saved_bytes_per_token"]


def _stage_layers(cfg: TransformerConfig, pp: int, stage: int) -> range:
    per = cfg.n_layers // pp
    return range(stage * per, (stage + 1) * per)


def moe_parameter_split(cfg: TransformerConfig, pp: int = 1, stage: int = 0) -> tuple[int, int]:
    """(dense, routed experts): parameters of pipeline stage ``stage`` (no tensor parallelism).

    Stage 0 holds the embeddings, the last stage the final norm and the output matrix (untied, or
    with pp > 1 its own copy of the tied word table, as ``model_states.stage_parameter_count``).
    """
    width = cfg.moe_d_ffn or cfg.ffn_size
    routed = dense = 0
    for layer in _stage_layers(cfg, pp, stage):
        block = counting.block_parameter_count(cfg, layer)
        experts = cfg.num_experts * counting.ffn_parameter_count(cfg, width) if cfg.is_moe_layer(layer) else 0
        routed += experts
        dense += block - experts
    if stage == 0:
        dense += _embedding(cfg)
    if stage == pp - 1:
        dense += counting.norm_parameter_count(cfg) if cfg.pre_ln else 0
        if not cfg.tie_word_embeddings or pp > 1:
            dense += cfg.vocab_size * cfg.hidden_size
    return dense, routed


def _embedding(cfg: TransformerConfig) -> int:
    d = cfg.hidden_size
    count = cfg.vocab_size * d + cfg.type_vocab_size * d
    if cfg.position == "learned":
        count += cfg.max_positions * d
    if cfg.embedding_layernorm:
        count += counting.norm_parameter_count(cfg)
    return count


def ffn_saved_bytes_per_token(cfg: TransformerConfig, width: int, element: int = 2) -> int:
    """A(f): bytes one FFN of inner width f keeps for backward per token, beyond its input."""
    return element * (4 if cfg.activation == "swiglu" else 2) * width


def moe_activation_bytes_per_layer(
    cfg: TransformerConfig, s: int, b: int, layer: int, recompute: str = "none"
) -> float:
    """Bytes layer ``layer`` of ``cfg`` keeps for backward (see the module docstring; tp = 1)."""
    h, a, sb = cfg.hidden_size, cfg.n_heads, s * b
    if recompute == "full":
        return 2.0 * sb * h
    attention = 15 * sb * h + (5 * a * s * s * b if recompute == "none" else 0)
    if not cfg.is_moe_layer(layer):
        return attention + 3 * sb * h + sb * ffn_saved_bytes_per_token(cfg, cfg.ffn_size)
    width = cfg.moe_d_ffn or cfg.ffn_size
    routed = cfg.top_k * (4 * sb * h + sb * ffn_saved_bytes_per_token(cfg, width))
    shared = sb * ffn_saved_bytes_per_token(cfg, width * cfg.num_shared_experts)
    return attention + 2 * sb * h + 2 * sb * cfg.num_experts + routed + shared + sb * h

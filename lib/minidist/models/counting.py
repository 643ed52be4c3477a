"""Parameters of any ``TransformerConfig``, layer by layer: all of them, and those a token uses.

A mixture-of-experts model has two sizes. **Total** parameters are what memory holds (every
expert); **active** parameters are what one token's forward pass multiplies by: the router, its
top_k routed experts and the shared ones, plus everything dense (attention, norms, the
embedding row and the output matrix). Compute per token is about 2 × active FLOPs forward.

    block        attention + 2 norms + feed-forward
    dense FFN    gelu: 2·d·f + f + d (biases)          swiglu: 3·d·f (no biases)
    MoE FFN      router d·E  +  E routed experts  +  shared experts (one FFN s·f_moe wide)
                 active: router d·E  +  top_k routed  +  shared
    attention    multi-head / grouped-query: d·d (Q) + 2·d·(kv_heads·d/heads) (K, V) + d·d (out)
                 latent (MLA): ``LatentAttention.parameter_count``

The checks: ``sum(p.numel() for p in model.parameters())`` of a model built on the meta device
equals ``decoder.parameter_count``; Mixtral 8x7B and DeepSeek-V3 land on their published sizes
(``decoder.PUBLISHED``).
"""

from __future__ import annotations

from minidist.models.modern_blocks import LatentAttention, linear_count

__all__ = [
    "attention_parameter_count",
    "ffn_parameter_count",
    "block_parameter_count",
    "transformer_parameter_count",
]


def norm_parameter_count(cfg) -> int:
    return cfg.hidden_size if cfg.norm == "rmsnorm" else 2 * cfg.hidden_size


def attention_parameter_count(cfg) -> int:
    if cfg.mla is not None:
        return LatentAttention.parameter_count(cfg)
    d, kv = cfg.hidden_size, cfg.kv_heads * cfg.head_dim
    return 2 * linear_count(d, d, cfg.bias) + 2 * linear_count(d, kv, cfg.bias)


def ffn_parameter_count(cfg, width: int) -> int:
    """One FFN of inner width ``width``: 2 (gelu) or 3 (swiglu) matrices."""
    d = cfg.hidden_size
    up = (2 if cfg.activation == "swiglu" else 1) * linear_count(d, width, cfg.bias)
    return up + linear_count(width, d, cfg.bias)


def block_parameter_count(cfg, layer: int, active: bool = False) -> int:
    """Parameters of block ``layer``; ``active``: only those one token uses (top_k routed experts)."""
    count = attention_parameter_count(cfg) + 2 * norm_parameter_count(cfg)
    if not cfg.is_moe_layer(layer):
        return count + ffn_parameter_count(cfg, cfg.ffn_size)
    width = cfg.moe_d_ffn or cfg.ffn_size
    routed = cfg.top_k if active else cfg.num_experts
    count += cfg.hidden_size * cfg.num_experts + routed * ffn_parameter_count(cfg, width)
    if cfg.num_shared_experts:
        count += ffn_parameter_count(cfg, width * cfg.num_shared_experts)
    return count


def transformer_parameter_count(cfg, active: bool = False) -> int:
    """``Transformer(cfg)``: embeddings, every block, the final norm (no output matrix)."""
    d = cfg.hidden_size
    embed = cfg.vocab_size * d + cfg.type_vocab_size * d
    if cfg.position == "learned":
        embed += cfg.max_positions * d
    if cfg.embedding_layernorm:
        embed += norm_parameter_count(cfg)
    blocks = sum(block_parameter_count(cfg, layer, active) for layer in range(cfg.n_layers))
    return embed + blocks + (norm_parameter_count(cfg) if cfg.pre_ln else 0)

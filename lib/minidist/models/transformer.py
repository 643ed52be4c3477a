"""One transformer, written from scratch on torch, shared by BERT and the decoder.

Everything a course model needs sits in this file, so a student reads one page (its configuration
is in ``config``; the bias added to the attention scores -- ALiBi, the causal and the padding
mask -- is built in ``score_bias``):

    input_ids ──► Embeddings: word + position (learned, or none with ALiBi) + segment
                  [+ LayerNorm]                                   (B, T, d)
              ──► TransformerBlock × n_layers
                      attention: softmax(Q Kᵀ / √d_head + bias) V, per head, then a projection
                      MLP:       Linear(d, 4d) ─ GELU ─ Linear(4d, d)
              ──► [final LayerNorm, pre-LN only]                  (B, T, d)

Two block layouts, chosen by ``TransformerConfig.pre_ln``:

    post-LN (BERT, as in the paper)      pre-LN (GPT-2, OPT, BLOOM)
    x = LN(x + Attn(x))                  x = x + Attn(LN(x))
    x = LN(x + MLP(x))                   x = x + MLP(LN(x))
                                         ... and one LayerNorm after the last block

Pre-LN keeps an un-normalised residual path from input to output, which is why deep decoders
(96 layers) train with it; BERT's 12 post-LN layers train fine with warm-up.

The ``causal`` flag makes position i attend only to positions j <= i (the decoder); the
same block without it is BERT's bidirectional encoder. Attention is computed explicitly
(scores, mask, softmax, weighted sum) so that every step is visible; the tests check it against
``torch.nn.functional.scaled_dot_product_attention``.

Dropout defaults to 0 in every course config: dropout draws a random mask from each process's
generator, so a data-parallel run and its single-process reference (or two ranks of one run)
would see different masks and their results could only be compared statistically. With
dropout 0 a run is a deterministic function of its seed and data, and our short runs on a small
corpus are far from overfitting anyway. Set ``dropout`` > 0 for long pre-training.

Mixture of experts: with ``num_experts`` > 0 the MLP of every block from ``first_dense_layers`` on
is a ``minidist.parallel.experts.MoELayer`` (top_k experts of width ``moe_d_ffn`` per token, plus
``num_shared_experts``); its load-balancing loss is left on the layer (``aux_loss``) and the
decoder adds ``aux_loss_coef`` times their sum to its loss. Newer decoders' pieces (RMSNorm, rotary
positions, grouped-query and latent attention, SwiGLU, no biases) are in ``modern_blocks``,
chosen by the fields after ``init_std``; the defaults keep the blocks above.

Cost: a block holds 12 d² + 13 d parameters (Q, K, V, output: 4 d² + 4 d; MLP with a 4d
inner size: 8 d² + 5 d; two LayerNorms: 4 d) and costs about 24 B T d² + 4 B T² d
multiply-adds forward for a batch of B sequences of T tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from minidist.models.config import TransformerConfig
from minidist.models.modern_blocks import MLAConfig, make_attention, make_mlp, make_norm
from minidist.models.score_bias import attention_bias

__all__ = [
    "TransformerConfig",
    "MLAConfig",
    "Embeddings",
    "MultiHeadSelfAttention",
    "MLP",
    "TransformerBlock",
    "Transformer",
    "attention_bias",
    "parameter_count",
]


def parameter_count(cfg: TransformerConfig) -> int:
    """Parameters of ``Transformer(cfg)`` by formula (embeddings, blocks, final LayerNorm; no head).

    word V·d + positions P·d (learned only) + segments S·d + embedding LayerNorm 2d
    + n_layers · (4d² + 4d  [Q, K, V, output]  +  2·d·f + f + d  [MLP]  +  4d  [2 LayerNorms])
    + 2d final LayerNorm (pre-LN only).
    """
    if not cfg.classic:  # MoE or newer blocks: the general count, layer by layer
        from minidist.models.counting import transformer_parameter_count

        return transformer_parameter_count(cfg)
    d, f = cfg.hidden_size, cfg.ffn_size
    embed = cfg.vocab_size * d + cfg.type_vocab_size * d
    if cfg.position == "learned":
        embed += cfg.max_positions * d
    if cfg.embedding_layernorm:
        embed += 2 * d
    block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
    final = 2 * d if cfg.pre_ln else 0
    return embed + cfg.n_layers * block + final


class Embeddings(nn.Module):
    """word + position (learned only) + segment vectors, then LayerNorm (optional) and dropout."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = (
            nn.Embedding(cfg.max_positions, cfg.hidden_size) if cfg.position == "learned" else None
        )
        self.segment = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size) if cfg.type_vocab_size else None
        self.norm = make_norm(cfg) if cfg.embedding_layernorm else None
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        if seq_len > self.cfg.max_positions and self.position is not None:
            raise ValueError(
                f"sequence of {seq_len} tokens, but the model has {self.cfg.max_positions} positions: "
                "cut the input into blocks of at most max_positions"
            )
        x = self.word(input_ids)
        if self.position is not None:
            x = x + self.position(torch.arange(seq_len, device=input_ids.device))[None]
        if self.segment is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            x = x + self.segment(token_type_ids)
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)


class MultiHeadSelfAttention(nn.Module):
    """softmax(Q Kᵀ / √d_head + bias) V for each of n_heads heads, concatenated, then projected.

    x (B, T, d) ─► Q, K, V = x W_q, x W_k, x W_v       each (B, T, d) split into (B, H, T, d/H)
               ─► scores = Q Kᵀ / √(d/H) + bias        (B, H, T, T)
               ─► weights = softmax over keys; out = weights V, heads concatenated ─► W_o
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.causal = cfg.causal
        d = cfg.hidden_size
        self.query = nn.Linear(d, d)
        self.key = nn.Linear(d, d)
        self.value = nn.Linear(d, d)
        self.output = nn.Linear(d, d)
        self.attn_dropout = nn.Dropout(cfg.dropout)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        return x.view(batch, seq_len, self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq_len, d = x.shape
        q, k, v = (
            self.split_heads(self.query(x)),
            self.split_heads(self.key(x)),
            self.split_heads(self.value(x)),
        )
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, H, T, T)
        if bias is not None:
            scores = scores + bias
        weights = self.attn_dropout(torch.softmax(scores, dim=-1))
        out = (weights @ v).transpose(1, 2).reshape(batch, seq_len, d)
        return self.output(out)


class MLP(nn.Module):
    """Linear(d, f) ─ GELU ─ Linear(f, d), applied to every position alone (f = 4d by default).

    GELU here is the exact one, x·Φ(x) with the normal CDF (BERT's); GPT-2 used a tanh approximation.
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.ffn_size)
        self.down = nn.Linear(cfg.ffn_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class TransformerBlock(nn.Module):
    """Attention then MLP, each with a residual connection; post-LN or pre-LN (see the module docstring).

    ``layer`` (its index) matters only for MoE configs: blocks before ``first_dense_layers`` stay dense.
    """

    def __init__(self, cfg: TransformerConfig, layer: int = 0) -> None:
        super().__init__()
        self.pre_ln = cfg.pre_ln
        self.attention = make_attention(cfg)
        self.attention_norm = make_norm(cfg)
        self.mlp = make_mlp(cfg, layer)
        self.mlp_norm = make_norm(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.pre_ln:
            x = x + self.dropout(self.attention(self.attention_norm(x), bias))
            return x + self.dropout(self.mlp(self.mlp_norm(x)))
        x = self.attention_norm(x + self.dropout(self.attention(x, bias)))
        return self.mlp_norm(x + self.dropout(self.mlp(x)))


class Transformer(nn.Module):
    """Embeddings, ``n_layers`` blocks and (pre-LN) a final LayerNorm: token ids (B, T) -> states (B, T, d).

    Weights start as N(0, init_std²) with zero biases and unit LayerNorms (BERT's and GPT's
    initialisation). On ``torch.device("meta")`` nothing is allocated, so a 176B-parameter
    model can be built to count and inspect.
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, layer) for layer in range(cfg.n_layers))
        self.final_norm = make_norm(cfg) if cfg.pre_ln else None
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if any(p.is_meta for p in module.parameters(recurse=False)):
            return  # shapes only: drawing values on meta costs ~1 ms a tensor (DeepSeek-V3: 47k of them)
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.cfg.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
        x = self.embeddings(input_ids, token_type_ids)
        bias = attention_bias(self.cfg, input_ids.shape[1], attention_mask, x.dtype, x.device)
        for block in self.blocks:
            x = block(x, bias)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x

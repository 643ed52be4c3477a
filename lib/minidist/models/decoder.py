"""A decoder-only (GPT-style) language model on ``minidist.models.transformer``, and the 175B configs as data.

    input_ids (B, T) ─► Transformer (pre-LN, causal) ─► h (B, T, d) ─► h · Eᵀ ─► logits (B, T, V)

The output matrix is the word-embedding table E (tied, no bias), as in GPT-2, OPT and BLOOM.
Position t predicts token t + 1: with ``labels=input_ids`` the loss compares logits[:, :-1]
with labels[:, 1:].

The big configs are here so the course can reason about them without building them: build on
``torch.device("meta")`` to get every parameter's shape and no memory, and use
``parameter_count(cfg)`` for the formula (the tests check that the two agree).

    name        layers  d      heads  vocab    positions        parameters
    opt-175b    96      12288  96     50272    2048 learned     174.6B  (HF's position table: 2 rows more)
    gpt3-175b   96      12288  96     50257    2048 learned     174.6B  (GPT-3 also had sparse layers)
    bloom-176b  70      14336  112    250880   ALiBi (none)     176,247,271,424, with an embedding LayerNorm

Each is a pre-LN decoder with 4d MLPs and exact GELU; ``dropout`` is 0 (see transformer.py).

Mixtures of experts (``num_experts`` > 0: blocks with ``parallel.experts.MoELayer``; the loss adds
``aux_loss_coef`` × the layers' load-balancing losses), with newer blocks (``modern_blocks``):

    name          layers  d     heads (KV)  experts           FFN    vocab   total / active (ours, exact)
    moe-tiny      2       64    4 (2)       8, top-2          128    8192    1,467,712 / 1,172,800
    mixtral-8x7b  32      4096  32 (8)      8, top-2          14336  32000   46,702,792,704 / 12,879,925,248
    deepseek-v3   61      7168  128, MLA    256 + 1 shared,   2048   129280  671,026,404,352 / 37,552,282,624
                                            top-8; 3 dense    (dense: 18432)

Both: RMSNorm, rotary positions, SwiGLU, no biases, an untied output matrix. Published
(``PUBLISHED``): Mixtral 46.7B / 12.9B (Mistral AI's announcement, Dec. 2023; Jiang et al. 2024,
"Mixtral of Experts"); DeepSeek-V3 671B / 37B (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report":
the 671B leaves out the 14B multi-token-prediction module, as we do). Our DeepSeek-V3 active count
is 1.5% above "37B": the repository's README_WEIGHTS.md gives 36.7B (embedding and head
included) without the arithmetic, and the config does not reproduce it -- counting 8 routed +
1 shared experts, MLA, the 3 dense layers, embedding and head gives 37.55B.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from minidist.models import counting, transformer
from minidist.models.transformer import MLAConfig, Transformer, TransformerConfig

__all__ = [
    "CONFIGS",
    "DecoderLM",
    "CausalLMOutput",
    "parameter_count",
    "active_parameter_count",
    "PUBLISHED",
    "IGNORE_INDEX",
    "check_labels",
    "next_token_loss",
]

IGNORE_INDEX = -100


def _decoder(
    n_layers: int,
    hidden: int,
    n_heads: int,
    vocab: int,
    positions: int,
    position: str = "learned",
    embedding_layernorm: bool = False,
) -> TransformerConfig:
    return TransformerConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        max_positions=positions,
        type_vocab_size=0,
        position=position,
        causal=True,
        pre_ln=True,
        embedding_layernorm=embedding_layernorm,
        dropout=0.0,
        layer_norm_eps=1e-5,
    )


CONFIGS: dict[str, TransformerConfig] = {
    "tiny": _decoder(2, 128, 2, vocab=8192, positions=128),
    "mini": _decoder(4, 256, 4, vocab=8192, positions=128),
    "small": _decoder(4, 512, 8, vocab=8192, positions=128),
    "opt-175b": _decoder(96, 12288, 96, vocab=50272, positions=2048),
    "gpt3-175b": _decoder(96, 12288, 96, vocab=50257, positions=2048),
    "bloom-176b": _decoder(
        70, 14336, 112, vocab=250880, positions=2048, position="alibi", embedding_layernorm=True
    ),
}

_NEWER = dict(position="rope", norm="rmsnorm", activation="swiglu", bias=False, tie_word_embeddings=False)
CONFIGS["moe-tiny"] = replace(
    CONFIGS["tiny"],
    hidden_size=64,
    n_heads=4,
    intermediate_size=128,
    num_experts=8,
    top_k=2,
    n_kv_heads=2,
    **_NEWER,
)
CONFIGS["mixtral-8x7b"] = replace(
    _decoder(32, 4096, 32, vocab=32000, positions=32768),
    intermediate_size=14336,
    n_kv_heads=8,
    num_experts=8,
    top_k=2,
    rope_theta=1e6,
    **_NEWER,
)
CONFIGS["deepseek-v3"] = replace(
    _decoder(61, 7168, 128, vocab=129280, positions=163840),
    intermediate_size=18432,  # the 3 dense layers' FFN
    num_experts=256,
    top_k=8,
    moe_d_ffn=2048,
    num_shared_experts=1,
    first_dense_layers=3,
    mla=MLAConfig(
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
    ),
    **_NEWER,
)

#: published (total, active per token) parameter counts, as rounded in the sources above
PUBLISHED: dict[str, tuple[float, float]] = {"mixtral-8x7b": (46.7e9, 12.9e9), "deepseek-v3": (671e9, 37e9)}


def parameter_count(cfg: TransformerConfig) -> int:
    """Parameters of ``DecoderLM(cfg)`` by formula: the transformer's (the head is tied, so adds nothing).

    For a config with learned positions: V·d + P·d + n_layers·(12d² + 13d) + 2d,
    plus 2d for an embedding LayerNorm (BLOOM, which has no position table).
    An untied output matrix (``tie_word_embeddings=False``: Mixtral, DeepSeek) adds V·d.
    """
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return transformer.parameter_count(cfg) + head


def active_parameter_count(cfg: TransformerConfig) -> int:
    """Parameters one token uses (``counting``): MoE blocks count top_k routed experts, not all.

    The embedding table and the output matrix are counted whole, as the published figures do.
    """
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return counting.transformer_parameter_count(cfg, active=True) + head


def check_labels(input_ids: torch.Tensor, labels: torch.Tensor) -> None:
    """Refuse labels that are not the input ids' shape (the shift happens inside the loss)."""
    if labels.shape != input_ids.shape:
        raise ValueError(
            f"labels have shape {tuple(labels.shape)}, input_ids {tuple(input_ids.shape)}: "
            "pass labels=input_ids (shifted inside), -100 where nothing is predicted"
        )


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: position t predicts token t + 1 (labels = input_ids); the
    last position has no target, and labels of -100 are ignored."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
    )


class CausalLMOutput(NamedTuple):
    """``loss`` (mean next-token cross-entropy; None without labels) and ``logits`` (B, T, V)."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class DecoderLM(nn.Module):
    """Causal language model: ``forward(input_ids, labels=None) -> CausalLMOutput(loss, logits)``."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        if not cfg.causal or not cfg.pre_ln:
            raise ValueError("DecoderLM needs a causal pre-LN config (causal=True, pre_ln=True)")
        self.cfg = cfg
        self.transformer = Transformer(cfg)
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        if self.lm_head is not None and not self.lm_head.weight.is_meta:
            nn.init.normal_(self.lm_head.weight, std=cfg.init_std)

    @property
    def word_embeddings(self) -> nn.Parameter:
        """The (V, d) word-embedding table, also the output matrix (unless untied: ``lm_head``)."""
        return self.transformer.embeddings.word.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        hidden = self.transformer(input_ids, attention_mask)
        logits = F.linear(hidden, self.word_embeddings) if self.lm_head is None else self.lm_head(hidden)
        loss = None
        if labels is not None:
            check_labels(input_ids, labels)
            loss = next_token_loss(logits, labels)
            if self.cfg.num_experts:  # load balancing (Switch): coefficient × the MoE layers' aux losses
                aux = [
                    block.mlp.aux_loss for block in self.transformer.blocks if hasattr(block.mlp, "aux_loss")
                ]
                loss = loss + self.cfg.aux_loss_coef * torch.stack(aux).sum()
        return CausalLMOutput(loss, logits)

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
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from minidist.models import transformer
from minidist.models.transformer import Transformer, TransformerConfig

__all__ = [
    "CONFIGS",
    "DecoderLM",
    "CausalLMOutput",
    "parameter_count",
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


def parameter_count(cfg: TransformerConfig) -> int:
    """Parameters of ``DecoderLM(cfg)`` by formula: the transformer's (the head is tied, so adds nothing).

    For a config with learned positions: V·d + P·d + n_layers·(12d² + 13d) + 2d,
    plus 2d for an embedding LayerNorm (BLOOM, which has no position table).
    """
    return transformer.parameter_count(cfg)


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

    @property
    def word_embeddings(self) -> nn.Parameter:
        """The (V, d) word-embedding table, also the output matrix."""
        return self.transformer.embeddings.word.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        hidden = self.transformer(input_ids, attention_mask)
        logits = F.linear(hidden, self.word_embeddings)
        loss = None
        if labels is not None:
            check_labels(input_ids, labels)
            loss = next_token_loss(logits, labels)
        return CausalLMOutput(loss, logits)

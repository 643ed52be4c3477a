"""A compact BERT for masked-language modelling (Devlin et al., 2019), on ``minidist.models.transformer``.

    input_ids (B, T) ─► Transformer (post-LN, bidirectional, segment embeddings) ─► h (B, T, d)
                     ─► MLM head: Linear(d, d) ─ GELU ─ LayerNorm ─► · Eᵀ + b ─► logits (B, T, V)

The head's last matrix is the word-embedding table E itself (weight tying): the model scores
word w at a position by the dot product of the transformed state with w's input vector. That
saves V·d parameters (a quarter of BERT-base) and is one Parameter registered under two names
-- which data-parallel code must bucket once.

``CONFIGS`` holds the course's sizes (vocabulary 8192, the course's WordPiece tokenizer, 128
positions) and BERT-base and BERT-large as published (vocabulary 30522, 512 positions).
Parameter counts of ``BertForMLM`` (the tests check them against the formula, and base and
large against the published counts):

    tiny   2 x 128, 2 heads     1.49M        small  4 x 512, 8 heads    17.1M
    mini   4 x 256, 4 heads     5.36M        base  12 x 768, 12 heads  109.5M
                                             large 24 x 1024, 16 heads 335.2M

The paper's "110M" and "340M" are rounded; the exact counts of the released checkpoints' body
(embeddings, layers and the d x d pooler, no MLM head) are 109,482,240 and 335,141,888. Our
model has no pooler (d² + d) but has the MLM head (d² + d dense, 2d LayerNorm, V output bias),
so it lands 32,058 (base) and 32,570 (large) above those.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from minidist.models.transformer import Transformer, TransformerConfig, parameter_count

__all__ = ["CONFIGS", "BertForMLM", "MaskedLMOutput", "mlm_parameter_count", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # label of positions that are not predicted (not masked); cross_entropy skips them

COURSE_VOCAB = 8192


def _bert(n_layers: int, hidden: int, n_heads: int, vocab: int = COURSE_VOCAB, positions: int = 128):
    return TransformerConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        n_layers=n_layers,
        n_heads=n_heads,
        max_positions=positions,
        type_vocab_size=2,
        position="learned",
        causal=False,
        pre_ln=False,
        embedding_layernorm=True,
        dropout=0.0,
        layer_norm_eps=1e-12,
    )


CONFIGS: dict[str, TransformerConfig] = {
    "tiny": _bert(2, 128, 2),
    "mini": _bert(4, 256, 4),
    "small": _bert(4, 512, 8),
    "base": _bert(12, 768, 12, vocab=30522, positions=512),
    "large": _bert(24, 1024, 16, vocab=30522, positions=512),  # 1.3 GB in fp32: build on "meta" to inspect
}


def mlm_parameter_count(cfg: TransformerConfig) -> int:
    """Parameters of ``BertForMLM(cfg)``: the transformer plus the head's dense d² + d, LayerNorm 2d, bias V.

    The head's decoder matrix is the tied word embedding, already counted in the transformer.
    """
    d = cfg.hidden_size
    return parameter_count(cfg) + d * d + d + 2 * d + cfg.vocab_size


class MaskedLMOutput(NamedTuple):
    """``loss`` (scalar, mean over labelled positions; None without labels) and ``logits`` (B, T, V)."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class BertForMLM(nn.Module):
    """BERT with its masked-language-model head; ``forward`` returns ``MaskedLMOutput(loss, logits)``.

    ``labels`` (B, T) holds the original token id at each masked position and -100 elsewhere
    (see ``minidist.data.mask_tokens``); the loss is the mean cross-entropy over the labelled
    positions only.
    """

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        if cfg.causal or cfg.pre_ln:
            raise ValueError("BertForMLM needs a bidirectional post-LN config (causal=False, pre_ln=False)")
        self.cfg = cfg
        self.transformer = Transformer(cfg)
        self.head_dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.head_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.head_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        nn.init.normal_(self.head_dense.weight, std=cfg.init_std)
        nn.init.zeros_(self.head_dense.bias)

    @property
    def word_embeddings(self) -> nn.Parameter:
        """The (V, d) word-embedding table, also the output matrix of the MLM head."""
        return self.transformer.embeddings.word.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> MaskedLMOutput:
        hidden = self.transformer(input_ids, attention_mask, token_type_ids)
        hidden = self.head_norm(F.gelu(self.head_dense(hidden)))
        logits = F.linear(hidden, self.word_embeddings, self.head_bias)  # tied: h · Eᵀ + b
        loss = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(
                    f"labels have shape {tuple(labels.shape)}, input_ids {tuple(input_ids.shape)}: "
                    "give one label per token, -100 where nothing is predicted"
                )
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX
            )
        return MaskedLMOutput(loss, logits)

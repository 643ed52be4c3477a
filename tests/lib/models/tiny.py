"""The tiny transformer every model test builds on: one definition, each test's changes named.

``tiny_config()`` is a 2-layer, 32-wide, 4-head model over a 64-token vocabulary and 32
positions (BERT's layout unless ``causal=True``); a test passes what it needs different
(``tiny_config(causal=True, pre_ln=True)`` is a GPT-style decoder). ``tiny_decoder`` builds that
decoder from a seed. Small enough that a forward and backward take milliseconds on one core.
"""

from __future__ import annotations

import torch

from minidist.models.decoder import DecoderLM
from minidist.models.transformer import TransformerConfig

BASE = dict(vocab_size=64, hidden_size=32, n_layers=2, n_heads=4, max_positions=32)


def tiny_config(**changes) -> TransformerConfig:
    """``TransformerConfig`` of the tiny model, with ``changes`` applied."""
    return TransformerConfig(**{**BASE, **changes})


def tiny_decoder(seed: int = 0, cfg: TransformerConfig | None = None) -> DecoderLM:
    """A causal decoder of ``cfg`` (default: the tiny GPT-style one) from ``seed``, in eval mode."""
    torch.manual_seed(seed)
    return DecoderLM(cfg or tiny_config(causal=True, pre_ln=True, layer_norm_eps=1e-5)).eval()

"""What tensor parallelism sends per step: the collectives of a tensor-parallel decoder and their bytes.

``tp_traffic_formula`` counts the allreduces that ``operators`` issues for one training step of
``minidist.models.tp_decoder.TensorParallelDecoderLM`` (the counts ``count_collectives`` reports)
and the payload bytes one rank sends for them; ``python -m minidist.bench model_parallel``
compares both with the measured ones.
"""

from __future__ import annotations

__all__ = ["allreduce_bytes", "tp_traffic_formula"]


def allreduce_bytes(n_bytes: float, world: int) -> float:
    """Bytes one rank sends in an allreduce of ``n_bytes``: the ring's 2 (p-1)/p n.

    For p = 2 every algorithm of ``minidist.collectives`` (ring, butterfly, tree, star) sends
    exactly n: one half-exchange each way for the ring, one full message for the others."""
    return 2 * (world - 1) / world * n_bytes


def tp_traffic_formula(cfg, batch: int, seq: int, world: int, dtype_bytes: int = 4) -> dict:
    """TP (``TensorParallelDecoderLM``) per step: collective counts and bytes per rank.

    forward:  embedding g (b s d) + 2 per layer (b s d each) + cross-entropy max (b (s-1))
              and [sum exp, target] (2 b (s-1))
    backward: 2 per layer (b s d) + f before the logits (b s d)

    ``cfg``: the decoder's ``TransformerConfig`` (its ``hidden_size`` and ``n_layers``)."""
    bsd, tokens, layers = batch * seq * cfg.hidden_size, batch * (seq - 1), cfg.n_layers
    forward = bsd + 2 * layers * bsd + tokens + 2 * tokens
    backward = 2 * layers * bsd + bsd
    return {
        "forward": 1 + 2 * layers + 2,
        "backward": 2 * layers + 1,
        "bytes": allreduce_bytes((forward + backward) * dtype_bytes, world),
    }

"""Gradient compression as DDP communication hooks (``DistributedDataParallel(..., comm_hook=...)``).

* ``dgc``: Deep Gradient Compression -- sampled-threshold top-k, error feedback, momentum
  correction and masking, local clipping, warm-up; sparse allgather of (values, indices).
* ``topk``: DGC's selection of the entries to send, top-k by a sampled threshold.
* ``baselines``: ``bf16_allreduce`` (half the bytes) and ``SignErrorFeedback`` (1 bit + a scale).
* ``traffic``: the bytes each hook sends per rank and step (formulas the tests check).
* ``ablation`` (imported by name): lecture 6's rows -- each hook with the optimizer that goes
  with it (where momentum lives, where clipping happens); ``RowTrainer`` trains one row.
"""

from __future__ import annotations

from .baselines import SignErrorFeedback, bf16_allreduce
from .dgc import (
    WARMUP_SPARSITIES,
    DeepGradientCompression,
    DGCConfig,
    DGCState,
    compress_step,
    select_indices,
    sparsity_at,
)
from .traffic import dense_ring_bytes, sign_allgather_bytes, sparse_allgather_bytes

__all__ = [
    "WARMUP_SPARSITIES",
    "DGCConfig",
    "DGCState",
    "DeepGradientCompression",
    "SignErrorFeedback",
    "bf16_allreduce",
    "compress_step",
    "dense_ring_bytes",
    "select_indices",
    "sign_allgather_bytes",
    "sparse_allgather_bytes",
    "sparsity_at",
]

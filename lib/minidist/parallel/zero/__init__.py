"""ZeRO from scratch: shard the optimizer state (stage 1), the gradients (stage 2), the parameters (stage 3).

Data parallelism keeps N full copies of everything. Per parameter, mixed-precision-free fp32 AdamW
holds 4 bytes of weight, 4 of gradient and 8 of optimizer state (exp_avg, exp_avg_sq). ZeRO
(Rajbhandari et al., 2020) splits a *flat* vector of all parameters into N equal shards
(padded to a multiple of N) and gives each rank the responsibility for one::

    flat parameters  [ shard 0 | shard 1 | shard 2 | shard 3 | pad ]
    rank r           keeps optimizer state (stage 1), gradient (stage 2), weights (stage 3)
                     for shard r only

    bytes per rank (psi parameters, fp32, AdamW)        traffic per rank per step
    stage 1   4 psi + 4 psi     + 8 psi / N              reduce-scatter + allgather   2 psi (N-1)/N
    stage 2   4 psi + 4 psi / N + 8 psi / N              reduce-scatter + allgather   2 psi (N-1)/N
    stage 3   (4 + 4 + 8) psi / N (+ 2 gathered units)   allgather x2 + reduce-scatter 3 psi (N-1)/N

(traffic in elements; times the dtype's bytes. The paper's 2psi/2psi/3psi is the large-N limit.)

Two modules, one per idea; the formulas of the table are here, below:

    optimizer.py      stages 1 and 2: ``ZeroOptimizer(params, comm, stage, optimizer=AdamW, **kw)``
                      wraps any elementwise optimizer; the model's parameters become views of
                      one flat buffer, and each rank steps its shard of it
    fully_sharded.py  stage 3: ``FullyShardedModule(module, comm)`` keeps only the shards and
                      gathers each unit's weights just in time (what FSDP does)

``minidist.models.zero_training`` trains a decoder with either (the run the tests and the
benchmark share; lecture 08 writes the same loop out) and compares it with one process and
with torch's FSDP2.
"""

from __future__ import annotations

from .fully_sharded import FullyShardedModule, default_units
from .optimizer import STAGES, ZeroOptimizer, _check_stage

__all__ = ["FullyShardedModule", "ZeroOptimizer", "default_units", "memory_formula", "traffic_formula"]


def traffic_formula(stage: int, n_params: int, world: int, dtype_bytes: int = 4) -> float:
    """Payload bytes each rank sends per step with ring collectives (``comm.stats.bytes_sent``).

    Stages 1 and 2: reduce-scatter + allgather, 2 psi (N-1)/N elements. Stage 3: allgather in
    forward, again in backward, reduce-scatter: 3 psi (N-1)/N. Large N: 2 psi, 2 psi, 3 psi.
    ``n_params`` is the padded count (a multiple of ``world``) to match the counter exactly.
    """
    _check_stage(stage, STAGES)
    factor = 2 if stage in (1, 2) else 3
    return factor * n_params * (world - 1) / world * dtype_bytes


def memory_formula(
    stage: int, n_params: int, world: int, dtype_bytes: int = 4, state_per_param: int = 2
) -> dict:
    """Bytes held per rank after a step: params, grads, optimizer state (Adam: 2 values per param)."""
    _check_stage(stage, STAGES)
    psi = n_params * dtype_bytes
    return {
        "params": psi / world if stage >= 3 else psi,
        "grads": psi / world if stage >= 2 else psi,
        "optimizer": state_per_param * psi / world,
    }

"""Deep Gradient Compression (Lin et al., ICLR 2018) as a DDP communication hook.

Most of a gradient is small. DGC sends only the largest 0.1% of each bucket's
entries (values and indices) and keeps everything else *locally*, adding it to
the next step's gradient, so nothing is lost -- only delayed. Per rank, per
bucket, per step (``compress_step``)::

    g  = clip(grad, clip_norm * sqrt(N))   local gradient clipping (N ranks; see ``clip_local``)
    u  = m * u + g                         momentum correction: the velocity lives here,
    v  = v + u                             and the *velocity* is accumulated (not g)
    S  = top-k of |v| by sampled threshold  k = ceil(n * (1 - sparsity)) slots
    send (S, v[S])                         sparse allgather: every rank gets every (S, v[S])
    v[S] = 0                               error feedback: what was sent leaves v; the rest stays
    u[S] = 0                               momentum factor masking: stale momentum is dropped

    averaged = (sum over ranks of the dense vectors built from (S_r, v_r[S_r])) / N

The optimizer must then be plain SGD *without* momentum (the momentum is in
``u``): ``w -= lr * averaged``. With sparsity 0 and no masking every entry is
sent each step, ``v == u``, and this is exactly momentum SGD on the averaged
gradient (``u`` is linear in ``g``). Without momentum correction (``v = v + g``)
the optimizer keeps its momentum, applied to the sparse sum: the paper shows
that this loses the momentum of the entries that wait in ``v``.

Top-k by a sampled threshold (``select_indices``, in ``topk.py``): estimate the k-th largest
|v| from a random sample of the entries and take everything at least that large -- no sort
of all n entries.

Warm-up (``sparsity_at``): sparsity 75%, 93.75%, 98.4375%, 99.6%, then the final
99.9% (each stage sends 1/4 of the previous one), ``warmup_stage_steps`` steps
per stage (the paper: one epoch per stage; pass your steps per epoch).

The wire format (``pack``): a fixed number of slots k per bucket and rank, so
one allgather of equal shapes carries them (no count exchange first, a round
trip saved): an int32 tensor [values as raw float32 bits (k) | indices (k)].
Unused slots hold index 0 and value 0.0, which adds nothing. Each rank sends
(N-1) * k * 8 bytes per bucket on the ring allgather and receives as much, which
*grows with N*, while the dense ring allreduce stays below 2 n * 4 bytes: the
critics' point (see ``traffic``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ...collectives import allgather
from ...comm import Communicator, DerivedWork, Handle
from .topk import sampled_threshold, select_indices

WARMUP_SPARSITIES = (0.75, 0.9375, 0.984375, 0.996)  # then the final sparsity (0.999)


@dataclass(frozen=True)
class DGCConfig:
    """What DGC does; each switch removes one component (the ablations).

    sparsity: share of entries *not* sent after warm-up (0.999: 1 in 1000 sent).
    warmup_stage_steps: steps per warm-up stage (0: the final sparsity from step 0).
    warmup_sparsities: the stages' sparsities before the final one.
    momentum: m of the velocity u (used with momentum_correction).
    momentum_correction: accumulate the velocity u (True) or the raw gradient (False;
        then give the optimizer the momentum).
    momentum_masking: zero u where entries were sent.
    error_feedback: keep what was not sent (False: drop it; v starts from 0 each step).
    clip_norm: the threshold c at which dense training would clip the averaged gradient
        (None: no clipping); each rank clips its own gradient at c sqrt(N) (``clip_local``).
        The hook sees one bucket: the norm is the bucket's (one bucket, ``bucket_mb=inf``,
        gives the paper's whole-gradient norm).
    sample_ratio: share of entries sampled to estimate the threshold (1.0: exact top-k).
    min_sample: at least this many samples (small buckets).
    seed: the sampling generator's seed (plus the rank).
    """

    sparsity: float = 0.999
    warmup_stage_steps: int = 0
    warmup_sparsities: tuple[float, ...] = WARMUP_SPARSITIES
    momentum: float = 0.9
    momentum_correction: bool = True
    momentum_masking: bool = True
    error_feedback: bool = True
    clip_norm: float | None = None
    sample_ratio: float = 0.01
    min_sample: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for s in (self.sparsity, *self.warmup_sparsities):
            if not 0.0 <= s < 1.0:
                raise ValueError(f"sparsities must be in [0, 1) (0.999 sends 0.1%), got {s}")
        if self.warmup_stage_steps < 0:
            raise ValueError(
                f"warmup_stage_steps must be >= 0 (0: no warm-up), got {self.warmup_stage_steps}"
            )
        if not 0.0 < self.sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be in (0, 1] (1.0: exact top-k), got {self.sample_ratio}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0 or None (no clipping), got {self.clip_norm}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")


@dataclass(eq=False)
class DGCState:
    """What one rank keeps for one bucket between steps (all of DGC's memory).

    velocity: u, the local momentum (zeros without momentum correction).
    accumulated: v, what was not sent yet (error feedback).
    step: how many steps this bucket has taken (drives the warm-up).
    """

    velocity: torch.Tensor
    accumulated: torch.Tensor
    step: int = 0

    @classmethod
    def zeros_like(cls, flat: torch.Tensor) -> DGCState:
        return cls(torch.zeros_like(flat), torch.zeros_like(flat))


def sparsity_at(step: int, config: DGCConfig) -> float:
    """The sparsity of ``step`` (0-based): the warm-up stages, then ``config.sparsity``."""
    if config.warmup_stage_steps == 0:
        return config.sparsity
    stage = step // config.warmup_stage_steps
    return config.warmup_sparsities[stage] if stage < len(config.warmup_sparsities) else config.sparsity


def slots_for(numel: int, sparsity: float) -> int:
    """k: how many entries of ``numel`` are sent at ``sparsity`` (at least 1)."""
    return max(1, min(numel, math.ceil(numel * (1.0 - sparsity) - 1e-9)))


def clip_local(grad: torch.Tensor, clip_norm: float, world_size: int) -> torch.Tensor:
    """This rank's gradient ``grad`` (its own mean, not yet divided by N) scaled down to L2 norm
    ``clip_norm * sqrt(world_size)`` if longer (a new tensor then; ``grad`` itself, unmodified,
    when it is short enough).

    The paper (Lin et al. 2018, section 3.2 and Algorithm 1) clips each node's share of the
    average, grad / N, at clip_norm N^-1/2: that is grad at clip_norm sqrt(N). Why N^-1/2: the
    average of N independent gradients of norm c sqrt(N) has norm about c sqrt(N) sqrt(N) / N = c,
    the threshold dense training applies to the average.
    """
    threshold = clip_norm * math.sqrt(world_size)
    norm = torch.linalg.vector_norm(grad)
    if norm > threshold:
        return grad * (threshold / norm)
    return grad


def compress_step(
    state: DGCState,
    grad: torch.Tensor,
    config: DGCConfig,
    world_size: int,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One DGC step for one bucket on one rank: update ``state``, return (indices, values) to send.

    Invariant (error feedback): ``values`` + the new ``state.accumulated`` (scattered) equals
    the accumulation before the entries were taken out, exactly. ``grad`` is not modified.
    """
    g = clip_local(grad, config.clip_norm, world_size) if config.clip_norm is not None else grad
    if config.momentum_correction:
        state.velocity.mul_(config.momentum).add_(g)
        state.accumulated.add_(state.velocity)
    else:
        state.accumulated.add_(g)
    k = slots_for(grad.numel(), sparsity_at(state.step, config))
    indices = select_indices(state.accumulated, k, config.sample_ratio, generator, config.min_sample)
    values = state.accumulated[indices].clone()
    if config.error_feedback:
        state.accumulated[indices] = 0.0
    else:
        state.accumulated.zero_()
    if config.momentum_correction and config.momentum_masking:
        state.velocity[indices] = 0.0
    state.step += 1
    return indices, values


def pack(indices: torch.Tensor, values: torch.Tensor, k: int) -> torch.Tensor:
    """The wire format: int32 [float32 bits of values, padded to k | indices, padded to k]."""
    if values.dtype != torch.float32:
        raise TypeError(f"DGC sends float32 values; this bucket is {values.dtype} (use float32 parameters)")
    payload = torch.zeros(2 * k, dtype=torch.int32, device=values.device)
    payload[: values.numel()] = values.view(torch.int32)
    payload[k : k + indices.numel()] = indices.to(torch.int32)
    return payload


def unpack(payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices int64, values float32) of one rank's payload (padding included: zeros at 0)."""
    k = payload.numel() // 2
    return payload[k:].long(), payload[:k].view(torch.float32)


def sum_sparse(gathered: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense sum of every rank's sparse vector; ``gathered`` is (N, 2k), row r rank r's payload.
    Ranks are added in rank order, so every rank computes the same floats. ``out``: a float32
    vector of ``numel`` entries to overwrite (saves an allocation), else a new one."""
    dense = torch.zeros(numel, dtype=torch.float32, device=gathered.device) if out is None else out.zero_()
    for payload in gathered:
        indices, values = unpack(payload)
        dense.index_add_(0, indices, values)
    return dense


class SparseAllgatherWork(DerivedWork):
    """Handle of a DGC bucket in flight: ``wait()`` = sum of the gathered sparse vectors / N,
    written into ``out`` (the bucket: its gradient is already in the DGC state)."""

    def __init__(self, work: Handle, out: torch.Tensor, world_size: int) -> None:
        super().__init__(work)
        self.out, self.world_size = out, world_size

    def finish(self, gathered: torch.Tensor) -> torch.Tensor:
        return sum_sparse(gathered, self.out.numel(), self.out).div_(self.world_size)


@dataclass(eq=False)
class DeepGradientCompression:
    """The DGC communication hook::

        ddp = DistributedDataParallel(model, comm, comm_hook=DeepGradientCompression(DGCConfig()))

    Per bucket it runs ``compress_step`` (in the thread that launches the bucket),
    then one async allgather of the packed (values, indices); ``wait()`` adds the
    N sparse vectors and divides by N. Use ``torch.optim.SGD(..., momentum=0)``
    with momentum correction (the velocity is in ``states``); give the optimizer
    the momentum when ``momentum_correction=False``. No weight decay in the
    optimizer for an exact comparison with momentum SGD (it would act after the
    momentum here).

    ``states[bucket_index]`` is the per-bucket ``DGCState``; ``slots[bucket_index]``
    the k sent in the last step; ``selected[bucket_index]`` how many of them were
    real entries (the rest padding).
    """

    config: DGCConfig = field(default_factory=DGCConfig)
    states: dict[int, DGCState] = field(default_factory=dict)
    slots: dict[int, int] = field(default_factory=dict)
    selected: dict[int, int] = field(default_factory=dict)
    generator: torch.Generator | None = None

    def __call__(self, comm: Communicator, flat_grad: torch.Tensor, bucket_index: int) -> SparseAllgatherWork:
        if self.generator is None:  # rank-specific, so ranks sample different entries
            self.generator = torch.Generator(device=flat_grad.device)
            self.generator.manual_seed(self.config.seed * 1000 + comm.rank)
        state = self.states.get(bucket_index)
        if state is None:
            state = self.states[bucket_index] = DGCState.zeros_like(flat_grad)
        k = slots_for(flat_grad.numel(), sparsity_at(state.step, self.config))
        indices, values = compress_step(state, flat_grad, self.config, comm.world_size, self.generator)
        self.slots[bucket_index], self.selected[bucket_index] = k, indices.numel()
        work = allgather(comm, pack(indices, values, k), async_op=True)
        return SparseAllgatherWork(work, flat_grad, comm.world_size)


__all__ = [
    "WARMUP_SPARSITIES",
    "DGCConfig",
    "DGCState",
    "DeepGradientCompression",
    "SparseAllgatherWork",
    "clip_local",
    "compress_step",
    "pack",
    "select_indices",
    "slots_for",
    "sparsity_at",
    "sampled_threshold",
    "sum_sparse",
    "unpack",
]

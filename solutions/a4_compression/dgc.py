"""Assignment 4: Deep Gradient Compression (Lin et al., ICLR 2018) as a DDP communication hook.

Most of a gradient is small. DGC sends only the largest entries of each bucket (0.1% of them
after warm-up), as (value, index) pairs, and keeps the rest *on the rank*, added to the next
step's gradient: nothing is lost, only delayed. You write the five pieces:

=====  ======================  ============================================================
task   where                   what it does
=====  ======================  ============================================================
1      ``sparsity_at``         the warm-up schedule: 75%, 93.75%, 98.4375%, 99.6%, then 99.9%
2      ``clip_local``          local gradient clipping at ``clip_norm * sqrt(world_size)``
3      ``select_indices``      top-k by a *sampled* threshold (specified exactly below)
4      ``compress_step``       momentum correction, error feedback, momentum factor masking
5      ``DGCHook.__call__``    the communication hook: pack, allgather, add up, divide by N
=====  ======================  ============================================================

One rank, one bucket, one step (``compress_step``)::

    g = clip_local(grad)          (only if config.clip_norm is not None)
    u = m * u + g                 momentum correction: the velocity u lives here, not in the
    v = v + u                     optimizer, and the velocity is what accumulates in v
    S = select_indices(v, k)      k = slots_for(n, sparsity_at(step)) entries, by |v|
    send (S, v[S])
    v[S] = 0                      error feedback: what was sent leaves v, the rest waits there
    u[S] = 0                      momentum factor masking: no stale momentum for sent entries

    averaged gradient = (sum over ranks r of the dense vector made of (S_r, v_r[S_r])) / N

The optimizer is then plain SGD *without* momentum (the momentum is in ``u``):
``w -= lr * averaged``. Picture of one entry that is small: its ``u`` keeps growing in ``v``
step after step until ``|v|`` is among the k largest; then it is sent at once, with everything
it gathered, and ``u`` and ``v`` start again from 0 for it.

Why a sampled threshold: an exact top-k over millions of entries sorts (or partially sorts)
all of them. DGC estimates the k-th largest magnitude from a small random sample and takes
every entry above it -- one comparison per entry.

The library's compressor (``minidist.parallel.compression``) is off limits: the grader refuses a
submission that uses it. ``md.allgather`` and the rest of ``minidist`` are allowed.

Run the public tests from this folder (``grep -n "TODO(task" dgc.py``: what is left)::

    python -m pytest -q test_a4_compression.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

import minidist as md  # noqa: F401  (your hook calls md.allgather)

__all__ = [
    "WARMUP_SPARSITIES",
    "DGCConfig",
    "DGCHook",
    "DGCState",
    "SparseWork",
    "clip_local",
    "compress_step",
    "pack",
    "select_indices",
    "slots_for",
    "sparsity_at",
    "unpack",
]

#: the warm-up stages' sparsities (each sends 1/4 of the previous one); then config.sparsity
WARMUP_SPARSITIES = (0.75, 0.9375, 0.984375, 0.996)


# --- given: the configuration, the state, the wire format --------------------------------
@dataclass(frozen=True)
class DGCConfig:
    """What DGC does.

    sparsity: share of the entries *not* sent after warm-up (0.999: 1 in 1000 is sent).
    warmup_stage_steps: steps per warm-up stage (0: no warm-up, ``sparsity`` from step 0).
    warmup_sparsities: the stages' sparsities, in order, before ``sparsity``.
    momentum: m, the momentum of the velocity u.
    clip_norm: the threshold c at which dense training would clip the averaged gradient (None:
        no clipping); each rank clips its own gradient at c sqrt(N) (``clip_local``).
    sample_ratio: the share of entries sampled to estimate the threshold.
    min_sample: sample at least this many entries (all of them when the bucket is smaller).
    seed: the hook seeds its sampling generator with ``seed * 1000 + comm.rank``.
    """

    sparsity: float = 0.999
    warmup_stage_steps: int = 0
    warmup_sparsities: tuple[float, ...] = WARMUP_SPARSITIES
    momentum: float = 0.9
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
            raise ValueError(f"sample_ratio must be in (0, 1], got {self.sample_ratio}")
        if self.min_sample < 1:
            raise ValueError(f"min_sample must be >= 1, got {self.min_sample}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0 or None (no clipping), got {self.clip_norm}")


@dataclass(eq=False)
class DGCState:
    """All that one rank keeps for one bucket between steps.

    velocity: u, the local momentum. accumulated: v, what was not sent yet.
    step: how many steps this bucket has taken (0 before the first; drives the warm-up).
    """

    velocity: torch.Tensor
    accumulated: torch.Tensor
    step: int = 0

    @classmethod
    def zeros_like(cls, flat: torch.Tensor) -> DGCState:
        return cls(torch.zeros_like(flat), torch.zeros_like(flat))


def slots_for(numel: int, sparsity: float) -> int:
    """k: how many of ``numel`` entries are sent at ``sparsity``: ceil(numel * (1 - sparsity)),
    at least 1 and at most ``numel`` (the 1e-9 absorbs rounding: 1000 * (1 - 0.999) is 1.0000000000000009)."""
    return max(1, min(numel, math.ceil(numel * (1.0 - sparsity) - 1e-9)))


def pack(indices: torch.Tensor, values: torch.Tensor, k: int) -> torch.Tensor:
    """The wire format of one rank's sparse vector: int32 ``[value bits (k) | indices (k)]``.

    Always k slots (every rank allgathers the same shape, no count is exchanged first):
    fewer than k pairs are padded with index 0 and value 0.0, which adds nothing. 8 bytes a
    slot. ``values`` must be float32 (their bits travel in int32 slots).
    """
    if values.dtype != torch.float32:
        raise TypeError(f"DGC sends float32 values; got {values.dtype} (use float32 parameters)")
    if indices.numel() != values.numel() or indices.numel() > k:
        raise ValueError(
            f"need as many indices as values, at most k={k}; got {indices.numel()}, {values.numel()}"
        )
    payload = torch.zeros(2 * k, dtype=torch.int32)
    payload[: values.numel()] = values.view(torch.int32)
    payload[k : k + indices.numel()] = indices.to(torch.int32)
    return payload


def unpack(payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices as int64, values as float32) of one payload of ``pack`` (padding included)."""
    k = payload.numel() // 2
    return payload[k:].long(), payload[:k].view(torch.float32)


# --- task 1: the warm-up schedule --------------------------------------------------------
def sparsity_at(step: int, config: DGCConfig) -> float:
    """The sparsity of (0-based) ``step``.

    Stage s = step // warmup_stage_steps uses ``warmup_sparsities[s]`` while s is less than
    their number; after them, and always when ``warmup_stage_steps == 0``, ``config.sparsity``.
    With 2 steps a stage: steps 0, 1 -> 0.75; 2, 3 -> 0.9375; 4, 5 -> 0.984375; 6, 7 -> 0.996;
    8, 9, ... -> 0.999.
    """
    # TODO(task 1): two cases; no loop needed.
    ### BEGIN SOLUTION TODO(task 1): write sparsity_at
    stages = config.warmup_sparsities if config.warmup_stage_steps > 0 else ()
    stage = step // config.warmup_stage_steps if stages else 0
    return stages[stage] if stage < len(stages) else config.sparsity
    ### END SOLUTION


# --- task 2: local gradient clipping -----------------------------------------------------
def clip_local(grad: torch.Tensor, clip_norm: float, world_size: int) -> torch.Tensor:
    """``grad``, this rank's gradient (its own mean, not yet divided by N), scaled to L2 norm
    ``clip_norm * sqrt(world_size)`` if its norm is larger; else an unchanged copy. Always a new
    tensor; ``grad`` is not modified.

    The paper clips each node's share of the average, grad / N, at clip_norm / sqrt(N): that is
    grad at clip_norm sqrt(N). The average of N independent gradients of norm c sqrt(N) then has
    a norm of about c, the threshold dense training applies to the average.
    Compute it as ``grad * (threshold / norm)`` with ``norm = torch.linalg.vector_norm(grad)``.
    """
    # TODO(task 2): the threshold, the norm, and a comparison.
    ### BEGIN SOLUTION TODO(task 2): write clip_local
    norm = torch.linalg.vector_norm(grad)
    limit = clip_norm * math.sqrt(world_size)
    too_long = bool(norm > limit)
    return grad * (limit / norm) if too_long else grad.clone()
    ### END SOLUTION


# --- task 3: top-k by a sampled threshold ------------------------------------------------
def select_indices(
    values: torch.Tensor, k: int, config: DGCConfig, generator: torch.Generator
) -> torch.Tensor:
    """The indices (int64, ascending, at most k) of entries of ``values`` with the largest |value|.

    Exactly this, so that your indices equal the grader's (n = values.numel())::

        if k >= n: return every index 0 .. n-1
        m = |values|
        s = min(n, max(config.min_sample, ceil(config.sample_ratio * n)))
        sample = m                                            if s == n (no random draw)
                 m[torch.randint(n, (s,), generator=generator)]   otherwise (with replacement)
        ks = max(1, ceil(s * k / n))
        threshold = the ks-th largest entry of sample (counting repeats)
        chosen = the indices i with m[i] >= threshold, ascending
        if more than k are chosen: keep the k with the largest m; among equal m the smaller
            index is kept (a *stable* descending sort of m[chosen] does exactly that)
        return chosen, ascending

    Fewer than k may come out (the estimate was high): the hook pads the rest. When the sample
    is everything (s == n) this is the exact top-k. Cost: one comparison per entry, a sort of
    the s samples and of the (about k) chosen -- never a sort of all n.
    """
    # TODO(task 3): follow the recipe line by line; torch.sort(..., descending=True, stable=True).
    ### BEGIN SOLUTION TODO(task 3): write select_indices
    n = values.numel()
    if k >= n:
        return torch.arange(n)
    magnitude = values.abs()
    size = min(n, max(config.min_sample, math.ceil(config.sample_ratio * n)))
    sample = magnitude if size == n else magnitude[torch.randint(n, (size,), generator=generator)]
    ks = max(1, math.ceil(size * k / n))
    threshold = torch.sort(sample, descending=True).values[ks - 1]
    chosen = (magnitude >= threshold).nonzero().flatten()
    if chosen.numel() > k:
        order = torch.sort(magnitude[chosen], descending=True, stable=True).indices
        chosen = chosen[order[:k]].sort().values
    return chosen
    ### END SOLUTION


# --- task 4: one step of one bucket ------------------------------------------------------
def compress_step(
    state: DGCState, grad: torch.Tensor, config: DGCConfig, world_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One DGC step of one bucket on one rank (the picture at the top): update ``state`` in
    place and return ``(indices, values)`` to send, ``values = v[indices]`` before v[indices]
    is zeroed. ``grad`` is not modified. k = ``slots_for(n, sparsity_at(state.step, config))``;
    ``state.step`` goes up by one.

    Error feedback means: ``values`` scattered at ``indices`` plus the new ``state.accumulated``
    equals the accumulation before the entries were taken out -- exactly.
    """
    # TODO(task 4): clip (if clip_norm), u = m u + g, v += u, select, take the values, zero v
    # and u at the indices, count the step.
    ### BEGIN SOLUTION TODO(task 4): write compress_step
    if config.clip_norm is not None:
        grad = clip_local(grad, config.clip_norm, world_size)
    u, v = state.velocity, state.accumulated
    u.mul_(config.momentum).add_(grad)  # momentum correction: the velocity...
    v.add_(u)  # ...is what accumulates
    keep = select_indices(v, slots_for(v.numel(), sparsity_at(state.step, config)), config, generator)
    sent = v.index_select(0, keep)  # a copy
    v.index_fill_(0, keep, 0.0)  # error feedback: only what was sent leaves v
    u.index_fill_(0, keep, 0.0)  # momentum factor masking
    state.step += 1
    return keep, sent
    ### END SOLUTION


# --- task 5: the communication hook ------------------------------------------------------
class SparseWork:
    """A bucket in flight: ``wait()`` returns the averaged dense gradient (float32, n entries)."""

    def __init__(self, gathered, numel: int, world_size: int) -> None:
        self.gathered = gathered  # the allgather's handle: wait() -> (world_size, 2k) int32
        self.numel = numel
        self.world_size = world_size
        self.result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """The dense sum of every rank's sparse vector, added in rank order, divided by N
        (computed once; a second call returns the same tensor)."""
        # TODO(task 5): unpack each row, index_add_ into zeros in rank order, divide.
        ### BEGIN SOLUTION TODO(task 5): write SparseWork.wait
        if self.result is None:
            rows = self.gathered.wait()
            dense = torch.zeros(self.numel, dtype=torch.float32)
            for payload in rows:
                indices, values = unpack(payload)
                dense.index_add_(0, indices, values)
            self.result = dense.div_(self.world_size)
        return self.result
        ### END SOLUTION


@dataclass(eq=False)
class DGCHook:
    """The DGC communication hook::

        hook = DGCHook(DGCConfig(sparsity=0.999, warmup_stage_steps=100))
        ddp = md.DistributedDataParallel(model, comm, comm_hook=hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)   # no momentum: it is in u

    ``states[bucket_index]``: each bucket's ``DGCState`` (made on its first call, zeros).
    ``generator``: one per hook, made on the first call with ``torch.Generator()`` seeded
    ``config.seed * 1000 + comm.rank`` (ranks sample different entries), used by every bucket.
    """

    config: DGCConfig = field(default_factory=DGCConfig)
    states: dict[int, DGCState] = field(default_factory=dict)
    generator: torch.Generator | None = None

    def __call__(self, comm, flat_grad: torch.Tensor, bucket_index: int) -> SparseWork:
        """Compress this bucket, launch ONE asynchronous allgather of its packed k slots
        (``md.allgather(comm, payload, async_op=True)``: 8 k bytes from each rank, k of this
        step) and return a ``SparseWork`` on it. No other communication."""
        # TODO(task 5): the generator and the state on first use; k before compress_step
        # (it counts the step); pack; allgather; SparseWork.
        ### BEGIN SOLUTION TODO(task 5): write DGCHook.__call__
        if self.generator is None:
            self.generator = torch.Generator()
            self.generator.manual_seed(self.config.seed * 1000 + comm.rank)
        if bucket_index not in self.states:
            self.states[bucket_index] = DGCState.zeros_like(flat_grad)
        state = self.states[bucket_index]
        slots = slots_for(flat_grad.numel(), sparsity_at(state.step, self.config))
        chosen, values = compress_step(state, flat_grad, self.config, comm.world_size, self.generator)
        payload = pack(chosen, values.to(torch.float32), slots)
        return SparseWork(md.allgather(comm, payload, async_op=True), flat_grad.numel(), comm.world_size)
        ### END SOLUTION

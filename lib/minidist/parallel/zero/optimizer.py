"""ZeRO stages 1 and 2: one flat buffer of all parameters, each rank steps its shard of it.

Stages 1 and 2, ``ZeroOptimizer(params, comm, stage, optimizer=torch.optim.AdamW, **kw)``::

    loss.backward()       every rank: full gradient of its own batch
    opt.step()            1. reduce-scatter(avg) of the flat gradient: rank r gets the averaged shard r
                          2. the inner optimizer steps shard r only (its state is 1/N of the model's)
                          3. allgather of the updated shards: every rank has all weights again
    opt.zero_grad()

The model's parameters become views into one flat buffer, so step 3 writes them in place.
Stage 1 could allreduce the whole gradient instead (every rank then has all of it), but only
shard r is used on rank r: a reduce-scatter gives it for half the traffic of an allreduce, so
the step costs what plain DDP's allreduce costs, 2 psi (N-1)/N -- the paper's point.
Stage 1 keeps the full gradient buffer (``p.grad`` are views of it; after the step only the
rank's own slice holds the average). Stage 2 frees the full gradients after the reduce-scatter
and keeps only the averaged shard. (Here the reduce-scatter runs after backward, so the full
gradients still exist during backward; DeepSpeed reduces buckets during backward instead.)

The flat buffer and its shards (padding to a multiple of N, the same shapes on every rank) are
also what stage 3 cuts each unit into: ``fully_sharded`` uses the helpers below.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch
from torch import nn

from ...collectives import allgather, broadcast, reduce_scatter
from ...comm import Communicator

__all__ = ["ZeroOptimizer"]

STAGES = (1, 2, 3)


def _check_stage(stage, allowed) -> None:
    if isinstance(stage, bool) or stage not in allowed:
        raise ValueError(f"ZeRO stage must be one of {allowed}, got {stage!r}")


def _padded(n: int, world: int) -> int:
    return -(-n // world) * world


def _check_same_shapes(comm: Communicator, params: list[torch.Tensor], what: str) -> None:
    """Once at construction: every rank must shard the same list of shapes (else shards would not line up)."""
    signature = repr([tuple(p.shape) for p in params])
    mine = torch.tensor([len(params), sum(p.numel() for p in params), zlib.crc32(signature.encode())])
    rows = allgather(comm, mine)
    for rank in range(comm.world_size):
        if not torch.equal(rows[rank], rows[0]):
            raise ValueError(
                f"{what}: rank {rank} has {int(rows[rank, 0])} parameters with "
                f"{int(rows[rank, 1])} elements, "
                f"rank 0 has {int(rows[0, 0])} with {int(rows[0, 1])} (or different shapes): every rank must "
                "build the same model"
            )


def _distinct(params: Iterable[torch.Tensor]) -> list[nn.Parameter]:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            out.append(p)
    return out


class ZeroOptimizer:
    """ZeRO stage 1 or 2 around any elementwise optimizer (AdamW, Adam, SGD...).

    Args:
        params: the model's parameters (the same shapes, in the same order, on every rank).
        comm: this rank's communicator; every rank of it takes part.
        stage: 1 (optimizer state sharded) or 2 (+ gradients sharded).
        optimizer: the inner optimizer class, built over this rank's flat shard only.
        **kwargs: passed to ``optimizer`` (lr, weight_decay, ...).

    Rank 0's parameters are broadcast at construction so every rank starts equal.
    """

    def __init__(
        self, params, comm: Communicator, stage: int = 1, optimizer=torch.optim.AdamW, **kwargs
    ) -> None:
        _check_stage(stage, (1, 2))
        self.comm, self.stage = comm, stage
        self.params = _distinct(params)
        if not self.params:
            raise ValueError("ZeroOptimizer got no parameters that require grad")
        _check_same_shapes(comm, self.params, "ZeroOptimizer")
        world, rank = comm.world_size, comm.rank
        self.numel = sum(p.numel() for p in self.params)
        self.padded_numel = _padded(self.numel, world)
        self.shard_numel = self.padded_numel // world
        p0 = self.params[0]
        self.flat = torch.zeros(self.padded_numel, dtype=p0.dtype, device=p0.device)
        self.offsets = []
        offset = 0
        with torch.no_grad():
            for p in self.params:
                self.flat[offset : offset + p.numel()].copy_(p.detach().view(-1))
                self.offsets.append(offset)
                offset += p.numel()
            broadcast(comm, self.flat, 0)
            for p, off in zip(self.params, self.offsets):
                p.data = self.flat[off : off + p.numel()].view_as(p)  # the model's weights: views of flat
        lo = rank * self.shard_numel
        self.shard = nn.Parameter(self.flat[lo : lo + self.shard_numel])  # shares flat's storage
        self.flat_grad = None
        if stage == 1:  # full gradient buffer, p.grad are views of it (autograd accumulates in place)
            self.flat_grad = torch.zeros_like(self.flat)
            self._attach_grad_views()
        self.inner = optimizer([self.shard], **kwargs)

    def _attach_grad_views(self) -> None:
        for p, off in zip(self.params, self.offsets):
            p.grad = self.flat_grad[off : off + p.numel()].view_as(p)

    def _flat_gradient(self) -> torch.Tensor:
        """The local full gradient as one padded flat vector (stage 1: the buffer itself)."""
        if self.stage == 1:
            for p, off in zip(self.params, self.offsets):
                view = self.flat_grad[off : off + p.numel()]
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():  # someone replaced p.grad (e.g. set_to_none)
                    view.copy_(p.grad.reshape(-1))
            self._attach_grad_views()
            return self.flat_grad
        pieces = [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).view(-1) for p in self.params
        ]
        pad = self.padded_numel - self.numel
        if pad:
            pieces.append(self.flat.new_zeros(pad))
        for p in self.params:
            p.grad = None  # stage 2: the full gradients are freed once copied out
        return torch.cat(pieces)

    @torch.no_grad()
    def step(self) -> None:
        world, rank = self.comm.world_size, self.comm.rank
        flat_grad = self._flat_gradient()
        averaged = reduce_scatter(self.comm, flat_grad.view(world, -1), op="avg").view(-1)
        if self.stage == 1:  # keep the full buffer; its own slice now holds the average
            lo = rank * self.shard_numel
            flat_grad[lo : lo + self.shard_numel].copy_(averaged)
            self.shard.grad = flat_grad[lo : lo + self.shard_numel]
        else:
            self.shard.grad = averaged
        del flat_grad
        self.inner.step()
        gathered = allgather(self.comm, self.shard.detach())
        self.flat.copy_(gathered.view(-1))

    def zero_grad(self) -> None:
        if self.stage == 1:
            self.flat_grad.zero_()
            self._attach_grad_views()
        else:
            for p in self.params:
                p.grad = None
            self.shard.grad = None

    @property
    def state(self):
        """The inner optimizer's state: for this rank's shard only."""
        return self.inner.state

    @property
    def param_groups(self):
        """The inner optimizer's groups (set ``lr`` here, or hand ``opt`` to an LR scheduler's logic)."""
        return self.inner.param_groups

    def held_tensors(self) -> dict:
        """What this rank holds, by kind (for ``minidist.memory.tensor_bytes``)."""
        grads = [self.flat_grad, self.shard.grad] + [p.grad for p in self.params]  # views count once
        return {
            "params": [self.flat],
            "grads": [g for g in grads if g is not None],
            "optimizer": [dict(s) for s in self.inner.state.values()],
        }

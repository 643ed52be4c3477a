"""Naive data parallelism: the whole idea of DDP, one allreduce per parameter after backward.

    ddp = NaiveDataParallel(model, comm)             # every rank now holds rank 0's weights
    loss = ddp(inputs, targets); loss.backward()     # local gradients of this rank's batch
    ddp.sync_gradients()                             # grads = average over all ranks
    optimizer.step(); optimizer.zero_grad()          # identical update on every rank

Why it is exact: with a loss that is a mean over the batch, the gradient of the global batch
(p ranks x b samples) is the average of the p per-rank gradients. Every rank starts from the
same weights and takes the same step with the same averaged gradient, so they stay equal.

Cost per step (p ranks, ring allreduce): every parameter is its own collective, so each rank
sends 2(p-1)/p x the gradient bytes in ``len(params)`` allreduces (each pays the latency alpha
2(p-1) times), plus one small allreduce of a flag per parameter. Nothing overlaps: the
network is idle during backward and the GPU is idle during communication.

What it leaves out, all of it in the bucketed ``DistributedDataParallel`` (``ddp.py``, with the
buckets in ``buckets.py``): buckets (a few large messages instead of one per parameter),
overlap of communication with backward (hooks that launch a bucket as soon as it is full),
``no_sync`` for gradient accumulation, comm hooks (compression), tied and frozen parameter
bookkeeping beyond what ``module.parameters()`` gives, and the trace spans. Both are
checked against each other and against one process in ``tests/lib/parallel/test_ddp_naive.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..collectives import allreduce, broadcast
from ..comm import Communicator


class NaiveDataParallel(nn.Module):
    """Wrap ``module``; call ``sync_gradients()`` after ``loss.backward()`` to average gradients.

    Args:
        module: the model (the same architecture on every rank).
        comm: this rank's communicator.
        algorithm: the allreduce algorithm ("auto", "ring", ...; see ``md.allreduce``).
    """

    def __init__(self, module: nn.Module, comm: Communicator, algorithm: str = "auto") -> None:
        super().__init__()
        self.module, self.comm, self.algorithm = module, comm, algorithm
        for tensor in [*module.parameters(), *module.buffers()]:  # rank 0's, one broadcast each
            broadcast(comm, tensor.detach(), src=0)  # detach(): the same storage, outside autograd

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sync_gradients(self) -> None:
        """Replace every ``param.grad`` by its average over the ranks, one parameter at a time."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        # The ranks must issue the same allreduces in the same order, but a parameter may get a
        # gradient on one rank and none on another (a branch taken only for some samples). So
        # first agree on who has one: a parameter used by any rank is averaged by all (with
        # zeros where unused); one that no rank used keeps grad None, as in one process.
        used = torch.tensor([float(p.grad is not None) for p in params])
        allreduce(self.comm, used, op="max", algorithm=self.algorithm)
        for param, used_somewhere in zip(params, used.tolist()):
            if not used_somewhere:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            allreduce(self.comm, param.grad, op="avg", algorithm=self.algorithm)


__all__ = ["NaiveDataParallel"]

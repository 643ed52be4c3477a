"""Worker for test_optim.py (importable by md.launch workers): one DDP step of the large-batch model."""

from __future__ import annotations

import torch
from torch import nn

from minidist.optim import large_batch as lb
from minidist.parallel.ddp import DistributedDataParallel


def ddp_gradients(comm, cfg: lb.LargeBatchConfig, batch: int) -> list[torch.Tensor]:
    """Rank r computes the mean loss of its 1/world_size slice of the batch; DDP averages the gradients."""
    torch.set_num_threads(1)
    problem = lb.make_problem(cfg)
    model = DistributedDataParallel(lb.make_model(cfg), comm)
    share = batch // comm.world_size
    rows = slice(comm.rank * share, (comm.rank + 1) * share)
    loss = nn.functional.cross_entropy(model(problem.train_x[rows]), problem.train_y[rows])
    loss.backward()
    return [p.grad.clone() for p in model.module.parameters()]

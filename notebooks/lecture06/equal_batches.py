"""Lecture 06, section 1: the gradient of N ranks x b samples through our DDP (one step, no update)."""

import math

import torch
import torch.nn.functional as F

from minidist.optim import large_batch as lb
from minidist.parallel.ddp import DistributedDataParallel


def ddp_gradient(comm, cfg, x, y):
    """The averaged gradient of the student MLP on (x, y) split evenly over the ranks."""
    model = lb.make_model(cfg)  # the same seeded weights on every rank
    ddp = DistributedDataParallel(model, comm, bucket_mb=math.inf, overlap=False)
    mine = torch.arange(len(x)).chunk(comm.world_size)[comm.rank]
    F.cross_entropy(ddp(x[mine]), y[mine]).backward()  # each rank: the mean over its share
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    ddp.remove_hooks()
    return grads

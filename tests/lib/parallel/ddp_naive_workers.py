"""Worker functions for tests/lib/parallel/test_ddp_naive.py (importable by md.launch workers).

The model, the data and the per-rank slices are ``ddp_workers``'s, so the naive DDP, the
bucketed one and the single-process reference see exactly the same numbers.
"""

from __future__ import annotations

import torch

import minidist as md
from ddp_workers import _my_slice, make_data, make_model
from minidist.parallel import NaiveDataParallel


def _sgd(model: torch.nn.Module, cfg: dict) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=cfg["lr"])


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def train_single_sgd(cfg: dict) -> dict[str, torch.Tensor]:
    """The reference: one process, the whole batch (p*b samples) per step."""
    model = make_model(cfg, cfg["seed"])  # rank 0's seed: what both DDPs broadcast
    opt = _sgd(model, cfg)
    ids, targets = make_data(cfg)
    for step in range(cfg["steps"]):
        model(ids[step, 0], targets[step, 0]).backward()
        opt.step()
        opt.zero_grad()
    return _state(model)


def train_naive(comm, cfg: dict, algorithm: str = "auto") -> dict:
    """The naive DDP from rank-specific weights; per step the bytes ``sync_gradients`` sent,
    and which parameters had no gradient after it."""
    model = make_model(cfg, cfg["seed"] + 1000 * comm.rank)  # the broadcast must fix this
    ddp = NaiveDataParallel(model, comm, algorithm=algorithm)
    opt = _sgd(ddp, cfg)
    ids, targets = make_data(cfg)
    sent, no_grad = [], []
    for step in range(cfg["steps"]):
        ddp(_my_slice(comm, cfg, ids[step, 0]), _my_slice(comm, cfg, targets[step, 0])).backward()
        before = comm.stats
        ddp.sync_gradients()
        sent.append((comm.stats - before).bytes_sent)
        no_grad.append(sorted(name for name, p in model.named_parameters() if p.grad is None))
        opt.step()
        opt.zero_grad()
    return {"state": _state(model), "sent": sent, "no_grad": no_grad}


def train_bucketed(comm, cfg: dict) -> dict[str, torch.Tensor]:
    """``md.DistributedDataParallel`` on the same weights, data and optimizer."""
    model = make_model(cfg, cfg["seed"] + 1000 * comm.rank)
    ddp = md.DistributedDataParallel(model, comm, bucket_mb=cfg["bucket_mb"])
    opt = _sgd(ddp, cfg)
    ids, targets = make_data(cfg)
    for step in range(cfg["steps"]):
        ddp(_my_slice(comm, cfg, ids[step, 0]), _my_slice(comm, cfg, targets[step, 0])).backward()
        opt.step()
        opt.zero_grad()
    return _state(model)


def naive_and_bucketed(comm, cfg: dict) -> dict:
    """Both DDPs in one launch: the naive one with the ring (its bytes are then exact)."""
    naive = train_naive(comm, cfg, algorithm="ring")
    params = [p for p in make_model(cfg, 0).parameters() if p.requires_grad]
    return {**naive, "bucketed": train_bucketed(comm, cfg), "numels": [p.numel() for p in params]}

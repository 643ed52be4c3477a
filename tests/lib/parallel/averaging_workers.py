"""Worker functions for tests/lib/parallel/test_averaging.py and tests/lib/parallel/test_stragglers.py.

The model, data and optimizer (AdamW) are ``ddp_workers``' TinyNet runs, so the
single-process reference is ``ddp_workers.train_single``. Full ranks 0..n-1 are
workers (DDP on ``SubComm(comm, range(n))``), ranks n.. are servers.
"""

from __future__ import annotations

import torch

import ddp_workers as w
import minidist as md
from minidist.parallel import averaging, stragglers
from minidist.parallel.group import SubComm


def _state(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def _bucket_numels(ddp, model) -> list[int]:
    params = dict(model.named_parameters())
    return [sum(params[name].numel() for name in bucket) for bucket in ddp.buckets]


def train_with_architecture(comm, cfg: dict, architecture: str, n_servers: int) -> dict:
    """One rank of ``architecture``: a summation server, or a DDP worker (rank-specific init,
    so a missing broadcast shows) that records the bytes it moved during the steps."""
    n = cfg["world_size"]
    if comm.rank >= n:
        report = averaging.serve_summation(comm, list(range(n)))
        return {"role": "server", "rounds": report.rounds, "stats": vars(report.stats)}
    hook = averaging.make_hook(architecture, comm, n, n_servers)
    try:
        group = SubComm(comm, range(n))
        model = w.make_model(cfg, cfg["seed"] + 1000 * comm.rank)
        ddp = md.DistributedDataParallel(model, group, bucket_mb=cfg["bucket_mb"], comm_hook=hook)
        opt = w._optimizer(model, cfg)
        ids, targets = w.make_data(cfg)
        before = comm.stats
        for step in range(cfg["steps"]):
            ddp(w._my_slice(group, cfg, ids[step, 0]), w._my_slice(group, cfg, targets[step, 0])).backward()
            opt.step()
            opt.zero_grad()
        moved = comm.stats - before
    finally:
        hook.close()
    return {
        "role": "worker",
        "state": _state(model),
        "stats": vars(moved),
        "numels": _bucket_numels(ddp, model),
    }


def group_collectives(comm, members: list[int]) -> dict:
    """Members allreduce, broadcast and barrier on a SubComm; the others do nothing."""
    if comm.rank not in members:
        return {"member": False, "stats": vars(comm.stats)}
    group = SubComm(comm, members)
    x = torch.full((5,), float(comm.rank + 1))
    md.allreduce(group, x, op="sum", algorithm="ring")
    y = torch.full((3,), float(comm.rank))
    md.broadcast(group, y, src=1)
    group.barrier()
    h = md.allreduce(group, torch.ones(4) * group.rank, op="sum", async_op=True)
    return {"member": True, "group_rank": group.rank, "sum": x, "bcast": y, "async": h.wait()}


# --- stragglers -------------------------------------------------------------------------------
def train_drop_slowest(comm, cfg: dict, policy: stragglers.DeadlinePolicy, slow: stragglers.SlowRank | None):
    """Workers 0..n-1 with the deadline-aggregator hook (rank n aggregates); ``slow`` sleeps
    before its forward. Returns each worker's state and the contributor masks it was told."""
    n = cfg["world_size"]
    if comm.rank == n:
        report = stragglers.serve_deadline_aggregator(comm, list(range(n)), policy)
        return {"role": "aggregator", "report": report}
    hook = stragglers.DeadlineAveraging(comm, list(range(n)), aggregator=n)
    try:
        group = SubComm(comm, range(n))
        model = w.make_model(cfg, cfg["seed"] + 1000 * comm.rank)
        ddp = md.DistributedDataParallel(model, group, bucket_mb=cfg["bucket_mb"], comm_hook=hook)
        opt = w._optimizer(model, cfg)
        ids, targets = w.make_data(cfg)
        for step in range(cfg["steps"]):
            if slow is not None:
                slow.sleep(comm.rank, step)
            ddp(w._my_slice(group, cfg, ids[step, 0]), w._my_slice(group, cfg, targets[step, 0])).backward()
            opt.step()
            opt.zero_grad()
    finally:
        hook.close()
    return {"role": "worker", "state": _state(model), "contributors": hook.contributors}


def train_single_with_masks(cfg: dict, masks: list[list[int]]) -> dict:
    """Reference: one process computes every rank's gradient on its slice, averages the
    gradients of exactly the ranks in ``masks[step]``, AdamW step."""
    model = w.make_model(cfg, cfg["seed"])
    opt = w._optimizer(model, cfg)
    params = list(model.parameters())
    ids, targets = w.make_data(cfg)
    b = cfg["batch"]
    for step in range(cfg["steps"]):
        per_rank = []
        for rank in masks[step]:
            rows = slice(rank * b, (rank + 1) * b)
            per_rank.append(torch.autograd.grad(model(ids[step, 0, rows], targets[step, 0, rows]), params))
        for i, p in enumerate(params):
            p.grad = sum(g[i] for g in per_rank) / len(per_rank)
        opt.step()
        opt.zero_grad()
    return _state(model)

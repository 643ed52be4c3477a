"""Worker functions for tests/lib/parallel/test_compression.py (importable by md.launch workers).

The model and data are ``ddp_workers``' TinyNet runs (``ddp_workers.config``); the
optimizer here is SGD. ``emulate_*`` are the single-process references: one model,
each rank's gradient computed in turn on its slice, compressed exactly as the hook
does, averaged, one SGD step.
"""

from __future__ import annotations

import functools

import torch

import ddp_workers as w
import minidist as md
from minidist.collectives import allreduce
from minidist.parallel import compression
from minidist.parallel.compression import dgc


def _state(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def _hook(kind: str, dgc_config: dgc.DGCConfig | None):
    if kind == "dgc":
        return compression.DeepGradientCompression(dgc_config)
    if kind == "bf16":
        return functools.partial(compression.bf16_allreduce, algorithm="ring")
    if kind == "sign":
        return compression.SignErrorFeedback()
    return None  # the default: float32 allreduce average


def train_with_hook(comm, cfg: dict, kind: str, momentum: float, dgc_config=None) -> dict:
    """DDP with comm hook ``kind`` on TinyNet (rank-specific init: the broadcast must fix it)."""
    model = w.make_model(cfg, cfg["seed"] + 1000 * comm.rank)
    ddp = md.DistributedDataParallel(
        model, comm, bucket_mb=cfg["bucket_mb"], comm_hook=_hook(kind, dgc_config)
    )
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=momentum)
    ids, targets = w.make_data(cfg)
    for step in range(cfg["steps"]):
        ddp(w._my_slice(comm, cfg, ids[step, 0]), w._my_slice(comm, cfg, targets[step, 0])).backward()
        opt.step()
        opt.zero_grad()
    return _state(model)


def train_single_sgd(cfg: dict, momentum: float) -> dict:
    """Reference: one process, the whole batch, SGD with ``momentum``."""
    model = w.make_model(cfg, cfg["seed"])
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=momentum)
    ids, targets = w.make_data(cfg)
    for step in range(cfg["steps"]):
        model(ids[step, 0], targets[step, 0]).backward()
        opt.step()
        opt.zero_grad()
    return _state(model)


def emulate_compressed(cfg: dict, kind: str, momentum: float) -> dict:
    """One process plays every rank: per-rank gradient of one flat bucket (DDP's order: reverse
    registration), compressed as ``kind`` does it, averaged, SGD step. bucket_mb must be inf."""
    p = cfg["world_size"]
    model = w.make_model(cfg, cfg["seed"])
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.SGD(params, lr=cfg["lr"], momentum=momentum)
    ids, targets = w.make_data(cfg)
    errors = [None] * p
    for step in range(cfg["steps"]):
        flats = []
        for rank in range(p):
            rows = slice(rank * cfg["batch"], (rank + 1) * cfg["batch"])
            grads = torch.autograd.grad(model(ids[step, 0, rows], targets[step, 0, rows]), params)
            flats.append(torch.cat([g.flatten() for g in reversed(grads)]))
        if kind == "bf16":  # the sum along the ring is done in bf16 (p = 2: one rounded addition)
            total = flats[0].to(torch.bfloat16)
            for flat in flats[1:]:
                total = total + flat.to(torch.bfloat16)
            averaged = total.to(torch.float32) / p
        else:  # sign with error feedback
            messages = []
            for rank, flat in enumerate(flats):
                errors[rank] = torch.zeros_like(flat) if errors[rank] is None else errors[rank]
                corrected = flat + errors[rank]
                scale = corrected.abs().mean()
                sent = scale * torch.where(corrected >= 0, 1.0, -1.0)
                errors[rank] = corrected - sent
                messages.append(sent)
            averaged = sum(messages) / p
        offset = 0
        for param in reversed(params):
            param.grad = averaged[offset : offset + param.numel()].view_as(param).clone()
            offset += param.numel()
        opt.step()
        opt.zero_grad()
    return _state(model)


ONE_LAYER_WEIGHT = torch.linspace(-1.0, 1.0, 6).reshape(6, 1)


def one_layer_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s 4 rows of a least-squares problem, targets far from the start: large gradients."""
    gen = torch.Generator().manual_seed(40 + rank)
    x = torch.randn(4, 6, generator=gen)
    return x, 20.0 * (1 + rank) * torch.randn(4, 1, generator=gen)


def one_layer_first_update(comm, configs: list[dict], lr: float) -> list[torch.Tensor]:
    """Per config: one step of DDP + DGC (``DGCConfig(**config)``) + SGD on a bias-free
    Linear(6, 1) under mean squared error, from ``ONE_LAYER_WEIGHT``; the update w0 - w1."""
    updates = []
    for config in configs:
        model = torch.nn.Linear(6, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(ONE_LAYER_WEIGHT.T)
        hook = compression.DeepGradientCompression(dgc.DGCConfig(**config))
        ddp = md.DistributedDataParallel(model, comm, bucket_mb=float("inf"), comm_hook=hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        x, y = one_layer_data(comm.rank)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        ddp.remove_hooks()
        updates.append((ONE_LAYER_WEIGHT.T - model.weight.detach()).T.clone())
    return updates


def rank_vector(rank: int, numel: int, seed: int = 7) -> torch.Tensor:
    """A rank's test gradient: heavy-tailed (a few large entries, as gradients are)."""
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen) ** 4


def dgc_hook_steps(comm, numel: int, config: dgc.DGCConfig, steps: int) -> list[torch.Tensor]:
    """``steps`` calls of the DGC hook on rank_vector(rank, step); each step's averaged result."""
    hook = compression.DeepGradientCompression(config)
    results = []
    for step in range(steps):
        work = hook(comm, rank_vector(comm.rank, numel, seed=step), 0)
        results.append(work.wait(timeout=30))
    return results


def bytes_per_hook(comm, numel: int, sparsity: float) -> dict:
    """Bytes this rank sends for one bucket of ``numel`` entries with each hook (pipe: ring)."""
    flat = rank_vector(comm.rank, numel)
    sent = {}
    for name, call in (
        ("dense", lambda: allreduce(comm, flat.clone(), op="sum", algorithm="ring")),
        ("bf16", lambda: compression.bf16_allreduce(comm, flat.clone(), 0, algorithm="ring").wait(30)),
        ("sign", lambda: compression.SignErrorFeedback()(comm, flat, 0).wait(30)),
        (
            "dgc",
            lambda: compression.DeepGradientCompression(dgc.DGCConfig(sparsity=sparsity))(comm, flat, 0).wait(
                30
            ),
        ),
    ):
        comm.barrier()
        before = comm.stats
        call()
        sent[name] = (comm.stats - before).bytes_sent
    return sent

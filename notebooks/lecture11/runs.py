"""Lecture 11: the rank bodies of sections 1-3 (DiLoCo's bytes, a fault-tolerant run, a resharding save)."""

import os
import signal

import torch

from minidist import checkpoint
from minidist.parallel import elastic, local_sgd
from minidist.parallel.zero import FullyShardedModule

D = 16  # the tiny model of section 1: one Linear(16, 16), 272 parameters


def regression_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step`` (4 rows): its own data, the same in every run."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, D, generator=g)
    return x, x.flip(1) + 0.1 * torch.randn(4, D, generator=g)


def mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def diloco_bytes(comm, steps: int, settings: list) -> list:
    """For each (H, quantize): train ``steps`` inner steps of DiLoCo; the bytes this rank sent."""
    rows = []
    for inner_steps, quantize in settings:
        torch.manual_seed(0)
        model = torch.nn.Linear(D, D)
        trainer = local_sgd.DiLoCo(
            model,
            comm,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            inner_steps,
            quantize=quantize,
        )
        before = comm.stats.copy()
        for step in range(steps):
            loss = trainer.step(mse, regression_batch(comm.rank, step))
        rows.append(
            {
                "H": inner_steps,
                "quantize": quantize,
                "bytes": (comm.stats - before).bytes_sent,
                "loss": float(loss),
            }
        )
    return rows


def make_mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The fault-tolerant run's model (float64, seeded: the same on every rank) and its optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8, dtype=torch.float64),
        torch.nn.Tanh(),
        torch.nn.Linear(8, 2, dtype=torch.float64),
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def mlp_loss(model, slot: int, step: int) -> torch.Tensor:
    """Slot ``slot``'s loss at ``step`` on its own batch (the same in the run and in the replay)."""
    g = torch.Generator().manual_seed(1000 * step + slot)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64)
    y = torch.randn(6, 2, generator=g, dtype=torch.float64)
    return torch.nn.functional.mse_loss(model(x), y)


def elastic_worker(comm, total_steps: int, kills: dict) -> dict:
    """Fault-tolerant data parallel; SIGKILL ourselves at ``kills[(slot, incarnation)]``, a (point, step)."""
    slot, incarnation = elastic.identity()
    model, optimizer = make_mlp()

    def on_point(point: str, step: int) -> None:
        if kills.get((slot, incarnation)) == (point, step):
            os.kill(os.getpid(), signal.SIGKILL)

    ft = elastic.FaultTolerant(comm, model, optimizer, total_steps, on_point=on_point)
    while ft.step < total_steps:
        ft.train_step(lambda step: mlp_loss(model, slot, step))
    return {
        "incarnation": incarnation,
        "history": ft.history,
        "recovered_bytes": ft.recovered_bytes,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def small_model(seed: int) -> torch.nn.Module:
    """Section 3's model: Linear(6, 5), ReLU, Linear(5, 3): 35 + 18 = 53 parameters."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def save_sharded(comm, path: str) -> dict:
    """ZeRO-3 (``FullyShardedModule``) of ``small_model(0)`` at this world size, saved to ``path``."""
    sharded = FullyShardedModule(small_model(0), comm)
    checkpoint.save(path, {"model": sharded}, comm)
    return {"shard_numel": [u.shard.numel() for u in sharded.all_units]}


def load_sharded(comm, path: str) -> dict:
    """A differently seeded ZeRO-3 model at this world size, loaded from ``path``; its full weights."""
    sharded = FullyShardedModule(small_model(1), comm)
    read = checkpoint.load(path, {"model": sharded}, comm)
    return {
        "bytes_read": read,
        "full": {k: v.clone() for k, v in sharded.full_state().items()},
    }

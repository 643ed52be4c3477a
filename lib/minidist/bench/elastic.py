"""``python -m minidist.bench elastic``: live recovery (a quorum per step) against checkpoint-restart.

The same training (a small float64 MLP, ``world_size`` ranks, ``steps`` steps, each rank its own
batches) loses a rank at each step of ``kill_steps`` (SIGKILL in the middle of the gradient
exchange), twice over:

* **live** -- one ``md.launch(..., elastic=Policy(max_restarts=len(kill_steps)))``: the survivors
  finish the step with the gradients they all hold, a replacement starts and receives the model
  and the optimizer state from the lowest healthy rank (``parallel.elastic``);
* **checkpoint-restart** -- the usual way: plain ``md.launch``, rank 0 saves the model and
  optimizer every ``checkpoint_every`` steps; a death fails the launch, and a new launch of
  *every* rank loads the last checkpoint and redoes the steps done since.

Counted in both runs: steps executed, steps redone, rounds spent on recovery, bytes of state
moved (each recovery's ``torch.save`` blob, printed next to the formula's 12 B a parameter).
Seconds lost per failure are a *formula*, on the emulated clock of a stated job (``step_s`` a step,
``params`` parameters with fp32 Adam state: 12 bytes each, a ``link_gbps`` link between peers,
``storage_gbps`` to the checkpoint store, ``restart_s`` to start a process: imports, GPU
initialisation, rendezvous)::

    live:               restart_s + state_bytes / link                 (nothing redone)
    checkpoint-restart: restart_s + state_bytes / storage + redone x step_s
                        + its saves: (steps / checkpoint_every) x state_bytes / storage (blocking)

By default our quorum waits for the replacement to start (the membership history then does
not depend on timing), hence ``restart_s`` on both sides; with ``wait_for_replacements=False``
(torchft's way) the survivors go on at N - 1 meanwhile, losing the dead rank's share of the
restart, ``restart_s / N``, and the steps they run below N are counted. Of the seconds, only
``redone`` is counted (in the runs); ``restart_s``, the state's bytes (12 B a parameter) and the
rates are the stated job's. The no-wait run's steps below N count this machine's process start
in this run's few-millisecond steps, so they are printed, not converted into the job's seconds.
"""

from __future__ import annotations

import os
import signal
import tempfile
from dataclasses import dataclass

import torch

from ..collectives import allreduce
from ..errors import WorkerError
from ..launch import launch
from ..parallel import elastic
from ._util import print_table

GBIT = 1.25e8  # bytes per second of 1 Gbit/s


@dataclass(frozen=True)
class ElasticBench:
    world_size: int = 4
    steps: int = 40
    kill_steps: tuple[int, ...] = (5, 13, 22, 37)
    checkpoint_every: int = 10
    width: int = 32
    step_s: float = 1.0  # the emulated job: one step on the stated GPU
    params: int = 125_000_000
    link_gbps: float = 10.0
    storage_gbps: float = 8.0  # 1 GB/s
    restart_s: float = 30.0


class _Adam:
    """Adam in a few lines: torch.optim's first use in a process imports torch._dynamo (~2 s)."""

    def __init__(self, params, lr: float = 0.01) -> None:
        self.params, self.lr, self.t = list(params), lr, 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        for p, m, v in zip(self.params, self.m, self.v, strict=True):
            m.mul_(0.9).add_(p.grad, alpha=0.1)
            v.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
            p -= self.lr * (m / (1 - 0.9**self.t)) / ((v / (1 - 0.999**self.t)).sqrt() + 1e-8)

    def state_dict(self) -> dict:
        return {"t": self.t, "m": [m.clone() for m in self.m], "v": [v.clone() for v in self.v]}

    def load_state_dict(self, state: dict) -> None:
        self.t = state["t"]
        for mine, theirs in zip(self.m + self.v, state["m"] + state["v"], strict=True):
            mine.copy_(theirs)


def _model(width: int):
    torch.manual_seed(0)
    lin = lambda a, b: torch.nn.Linear(a, b, dtype=torch.float64)  # noqa: E731
    model = torch.nn.Sequential(lin(8, width), torch.nn.Tanh(), lin(width, 1))
    return model, _Adam(model.parameters())


def _loss(model, slot: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + slot)
    x = torch.randn(16, 8, generator=g, dtype=torch.float64)
    return ((model(x) - x.sum(1, keepdim=True).sin()) ** 2).mean()


def live_worker(comm, cfg: ElasticBench, kills: dict):
    slot, incarnation = elastic.identity()
    model, optimizer = _model(cfg.width)

    def on_point(point: str, step: int) -> None:
        if kills.get((slot, incarnation)) == (point, step):
            os.kill(os.getpid(), signal.SIGKILL)

    ft = elastic.FaultTolerant(comm, model, optimizer, cfg.steps, on_point=on_point)
    while ft.step < cfg.steps:
        ft.train_step(lambda step: _loss(model, slot, step))
    return {"history": ft.history, "recoveries": ft.recoveries, "state_bytes": ft.recovered_bytes}


def checkpoint_worker(comm, cfg: ElasticBench, path: str, kill_at: int | None):
    """Plain data parallelism with a checkpoint every ``checkpoint_every`` steps (rank 0 writes)."""
    model, optimizer = _model(cfg.width)
    start = 0
    if os.path.exists(path):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    for step in range(start, cfg.steps):
        model.zero_grad()
        _loss(model, comm.rank, step).backward()
        if step == kill_at and comm.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        for p in model.parameters():
            p.grad = allreduce(comm, p.grad) / comm.world_size
        optimizer.step()
        if comm.rank == 0 and (step + 1) % cfg.checkpoint_every == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)  # a death mid-save leaves the previous checkpoint
    return {"start": start}


def run_live(cfg: ElasticBench, wait: bool = True) -> dict:
    kills = {}
    for i, step in enumerate(cfg.kill_steps):  # slots 1.. in turn, each incarnation once
        slot = 1 + i % (cfg.world_size - 1)
        kills[(slot, i // (cfg.world_size - 1))] = ("mid_allreduce", step)
    policy = elastic.Policy(min_size=2, max_restarts=len(cfg.kill_steps), wait_for_replacements=wait)
    outs = launch(live_worker, cfg.world_size, (cfg, kills), transport="pipe", timeout=120, elastic=policy)
    history = outs[0]["history"]
    return {
        "steps executed": len(history),
        "steps redone": len(history) - cfg.steps,
        "recovery rounds": outs[0]["recoveries"],
        "steps below N": sum(len(c) < cfg.world_size for c in history),
        "state bytes moved": sum(o["state_bytes"] for o in outs),
        # each surviving replacement recovered once: the bytes of one recovery (torch.save blob)
        "state bytes per recovery": sorted({o["state_bytes"] for o in outs if o["state_bytes"]}),
    }


def run_checkpoint_restart(cfg: ElasticBench) -> dict:
    executed, redone, launches = 0, 0, 0
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "checkpoint.pt")
        for kill_at in [*cfg.kill_steps, None]:
            start = torch.load(path, weights_only=True)["step"] if os.path.exists(path) else 0
            args = (cfg, path, kill_at)
            launches += 1
            try:
                launch(checkpoint_worker, cfg.world_size, args, transport="pipe", timeout=120)
            except WorkerError:
                ckpt = torch.load(path, weights_only=True)["step"] if os.path.exists(path) else 0
                executed += kill_at - start  # completed before the kill
                redone += kill_at - ckpt  # completed since the last checkpoint: lost
                continue
            executed += cfg.steps - start
        state_bytes = os.path.getsize(path)
    return {
        "steps executed": executed,
        "steps redone": redone,
        "launches": launches,
        "state bytes": state_bytes,
    }


def seconds_lost(cfg: ElasticBench, live: dict, ckpt: dict) -> tuple[float, float, float]:
    """Per failure, on the emulated clock of the stated job (the module docstring's formulas):
    live with the quorum waiting for the replacement, live without waiting, checkpoint-restart."""
    state = 12 * cfg.params
    failures = len(cfg.kill_steps)
    transfer = state / (cfg.link_gbps * GBIT) + live["steps redone"] / failures * cfg.step_s
    saves = cfg.steps // cfg.checkpoint_every * state / (cfg.storage_gbps * GBIT)
    ckpt_s = cfg.restart_s + state / (cfg.storage_gbps * GBIT) + ckpt["steps redone"] / failures * cfg.step_s
    return cfg.restart_s + transfer, transfer + cfg.restart_s / cfg.world_size, ckpt_s + saves / failures


def main(cfg: ElasticBench | None = None) -> dict:
    cfg = cfg or ElasticBench()
    live, no_wait, ckpt = run_live(cfg), run_live(cfg, wait=False), run_checkpoint_restart(cfg)
    live_s, no_wait_s, ckpt_s = seconds_lost(cfg, live, ckpt)
    print(
        f"{cfg.world_size} ranks, {cfg.steps} steps, kills at steps {list(cfg.kill_steps)}, "
        f"checkpoint every {cfg.checkpoint_every} steps"
    )
    rows = []
    for name, run, seconds in (("live, quorum waits", live, live_s), ("live, no wait", no_wait, no_wait_s)):
        rows.append(
            [name, run["steps executed"], run["steps redone"], run["steps below N"], f"{seconds:.1f}"]
        )
    rows.append(["checkpoint-restart", ckpt["steps executed"], ckpt["steps redone"], "-", f"{ckpt_s:.1f}"])
    header = ["", "steps executed", "steps redone", "steps below N", "s lost per failure (formula)"]
    print_table(header, rows)
    print(
        f"emulated job: {cfg.params / 1e6:.0f}M parameters (12 B each with Adam), step {cfg.step_s} s, "
        f"link {cfg.link_gbps} Gbit/s, storage {cfg.storage_gbps} Gbit/s, restart {cfg.restart_s} s"
    )
    ours = sum(p.numel() for p in _model(cfg.width)[0].parameters())
    counted, tensors = live["state bytes per recovery"], 3 * ours * 8  # weights, Adam m and v
    print(
        "state moved per recovery, counted (by the replacements alive at the end): "
        f"{'/'.join(map(str, counted))} B = 3 x {ours} float64 "
        f"parameters x 8 B (weights, Adam m and v: {tensors} B) + {min(counted) - tensors}-"
        f"{max(counted) - tensors} B of torch.save framing and history (fixed, not per parameter); "
        f"the formula for the job: 3 x 4 B = 12 B a parameter (fp32) x {cfg.params / 1e6:.0f}M = "
        f"{12 * cfg.params / 1e9:.2f} GB"
    )
    print(
        "s lost per failure: a formula on the emulated job (module docstring) -- restart_s, the "
        "state's bytes / link or storage, the saves; counted in the runs: steps redone (x step_s). "
        f"No wait: the runs counted {no_wait['steps below N']} steps below N here (this machine's "
        "process start, in steps of a few ms); the formula charges restart_s / N"
    )
    print(
        f"time lost per failure, checkpoint-restart / live: {ckpt_s / live_s:.2f}x (quorum waits), "
        f"{ckpt_s / no_wait_s:.2f}x (no wait: the dead rank's share of the restart, restart_s / N)"
    )
    return {"live": live, "no_wait": no_wait, "checkpoint": ckpt, "seconds": (live_s, no_wait_s, ckpt_s)}


_OPTIONS = {"world_size": int, "steps": int, "checkpoint_every": int, "step_s": float, "params": int,
            "link_gbps": float, "storage_gbps": float, "restart_s": float}  # fmt: skip


def add_parser(sub) -> None:
    p = sub.add_parser(
        "elastic", help="live recovery (quorum per step) vs checkpoint-restart: steps and s lost"
    )
    for name, kind in _OPTIONS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=getattr(ElasticBench, name))
    p.add_argument("--kill-steps", type=int, nargs="+", default=list(ElasticBench.kill_steps))


def main_from_args(args) -> dict:
    return main(ElasticBench(kill_steps=tuple(args.kill_steps), **{n: getattr(args, n) for n in _OPTIONS}))

"""Workers for test_elastic.py: a tiny float64 regression trained by FaultTolerant, with kills."""

from __future__ import annotations

import os
import select
import signal
import time

import torch

from minidist.parallel import elastic


class HandAdam:
    """Adam in a few lines. Not torch.optim.Adam: the first torch optimizer built in a process
    imports torch._dynamo (about 2 s on a loaded 2-core machine), in every rank and replacement."""

    def __init__(self, params, lr: float = 0.05, betas=(0.9, 0.999), eps: float = 1e-8) -> None:
        self.params, self.lr, self.betas, self.eps = list(params), lr, betas, eps
        self.t = 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2 = self.betas
        for p, m, v in zip(self.params, self.m, self.v):
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            p -= self.lr * (m / (1 - b1**self.t)) / ((v / (1 - b2**self.t)).sqrt() + self.eps)

    def state_dict(self) -> dict:
        return {"t": self.t, "m": [m.clone() for m in self.m], "v": [v.clone() for v in self.v]}

    def load_state_dict(self, state: dict) -> None:
        self.t = state["t"]
        for mine, theirs in zip(self.m + self.v, state["m"] + state["v"]):
            mine.copy_(theirs)


PAD = 2**18  # a 2 MiB float64 buffer in the state: the recovery blob is over a pipe's 1 MiB


def make_model() -> tuple[torch.nn.Module, HandAdam]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8, dtype=torch.float64),
        torch.nn.Tanh(),
        torch.nn.Linear(8, 2, dtype=torch.float64),
    )
    model.register_buffer("pad", torch.zeros(PAD, dtype=torch.float64))  # state, not trained
    return model, HandAdam(model.parameters())


def loss_of(model: torch.nn.Module, slot: int, step: int) -> torch.Tensor:
    """Slot ``slot``'s loss at ``step``: its own batch, the same in the run and in the replay."""
    g = torch.Generator().manual_seed(1000 * step + slot)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64)
    y = torch.randn(6, 2, generator=g, dtype=torch.float64)
    return torch.nn.functional.mse_loss(model(x), y)


def _die(pid_dir: str, slot: int, incarnation: int) -> None:
    """SIGKILL ourselves, having written the time (CLOCK_MONOTONIC: one clock for every process)."""
    with open(os.path.join(pid_dir, f"{slot}.{incarnation}.killed"), "w") as f:
        f.write(repr(time.monotonic()))
    os.kill(os.getpid(), signal.SIGKILL)


def _read_part_of_the_state(comm, nbytes: int) -> None:
    """Read ``nbytes`` raw bytes of what the donor is sending (the length, then the state blob):
    the donor has then certainly begun writing the blob, which is larger than the pipe's buffer."""
    fds = [conn.fileno() for conn in comm._readers.values()]
    got = 0
    while got < nbytes:
        ready, _, _ = select.select(fds, [], [], 30)
        if not ready:
            return
        got += len(os.read(ready[0], nbytes - got))


def elastic_worker(comm, total_steps: int, kills: dict, pid_dir: str):
    """Train; SIGKILL ourselves where ``kills[(slot, incarnation)] == (point, step)``.

    Besides the library's points: "startup" (before the first ask), "joiner_mid_recv" (at
    "joiner_recovering", after reading 256 KiB of the donor's state) and "hang:<point>" (sleep
    there instead of dying; "hang:startup" too). Each commit's arrival time
    is appended to ``pid_dir/<slot>.<incarnation>.commits`` (for the detection time)."""
    slot, incarnation = elastic.identity()
    with open(os.path.join(pid_dir, f"{slot}.{incarnation}.pid"), "w") as f:
        f.write(str(os.getpid()))
    point_to_die, step_to_die = kills.get((slot, incarnation), ("", -1))  # None: AttributeError
    if point_to_die == "startup":
        _die(pid_dir, slot, incarnation)
    if point_to_die == "hang:startup":
        _hang(pid_dir, slot, incarnation)
    model, optimizer = make_model()
    commits = open(os.path.join(pid_dir, f"{slot}.{incarnation}.commits"), "a")

    def on_point(point: str, step: int) -> None:
        if point == "after_report":
            commits.write(f"{step} {time.monotonic()!r}\n")
            commits.flush()
        if step != step_to_die:
            return
        if point == "joiner_recovering" and point_to_die == "joiner_mid_recv":
            _read_part_of_the_state(comm, 256 * 1024)
            _die(pid_dir, slot, incarnation)
        if point == point_to_die:
            _die(pid_dir, slot, incarnation)
        if point_to_die == "hang:" + point:
            _hang(pid_dir, slot, incarnation)

    ft = elastic.FaultTolerant(comm, model, optimizer, total_steps, on_point=on_point)
    while ft.step < total_steps:
        ft.train_step(lambda step: loss_of(model, slot, step))
    commits.close()
    return {
        "incarnation": incarnation,
        "history": ft.history,
        "params": [p.detach().clone() for p in model.parameters()],
        "optimizer": optimizer.state_dict(),
        "recoveries": ft.recoveries,
        "recovered_bytes": ft.recovered_bytes,
    }


def _hang(pid_dir: str, slot: int, incarnation: int) -> None:
    """Alive but stuck: nobody sees end-of-file. When it began: ``<slot>.<incarnation>.hung``."""
    with open(os.path.join(pid_dir, f"{slot}.{incarnation}.hung"), "w") as f:
        f.write(repr(time.monotonic()))
    time.sleep(600)


def large_gradient_worker(comm, features: int):
    """Two steps of a (features x features) float64 layer: a gradient over a pipe's 1 MiB buffer."""
    slot, _ = elastic.identity()
    torch.manual_seed(0)
    model = torch.nn.Linear(features, features, bias=False, dtype=torch.float64)
    optimizer = HandAdam(model.parameters())
    ft = elastic.FaultTolerant(comm, model, optimizer, 2)
    grads = []
    while ft.step < 2:
        step = ft.step
        g = torch.Generator().manual_seed(1000 * step + slot)
        x = torch.randn(4, features, generator=g, dtype=torch.float64)
        ft.train_step(lambda _step: model(x).pow(2).mean())
        grads.append(model.weight.grad.clone())
    return {"history": ft.history, "grads": grads}


def unused_parameter_worker(comm):
    """A model whose second layer no loss uses: its gradient would be missing from the exchange."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(2, 1), "unused": torch.nn.Linear(2, 1)})
    ft = elastic.FaultTolerant(comm, model, torch.optim.SGD(model.parameters(), lr=0.1), 1)
    ft.train_step(lambda step: model["used"](torch.ones(1, 2)).sum())

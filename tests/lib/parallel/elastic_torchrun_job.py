"""Run under torchrun's elastic mode by test_elastic_torchrun.py: the torchrun way of surviving
deaths -- restart every worker, resume from a checkpoint -- at the same and at a smaller size.

Two agents (two "nodes", one worker each, ``--nnodes=1:2 --max-restarts=2``). The model is one
3-element weight sharded ZeRO-3 (``FullyShardedModule``: 2 elements a rank, one of them padding
on rank 1); at the top of every step both ranks save it with ``minidist.checkpoint`` into
``ckpt-<step>`` (collective: when the save returns on one rank, the checkpoint of that step is
complete or is being finished by a rank that is alive, so the resume step is certain).

- step 2: rank 1 SIGKILLs itself (once: a marker file); its peer's gloo receive raises, both
  agents restart their workers at world size 2, which load ``ckpt-2`` (2 -> 2);
- step 4: the worker of the agent started with MINIDIST_DIE_AT=4 writes ``die.json`` (its pid
  and its agent's) and waits; the test SIGKILLs that agent, then the worker (a machine lost).
  The other agent's worker fails, its agent restarts it; the rendezvous re-forms with one node
  once the dead agent's heartbeats have expired, and the worker loads ``ckpt-4`` at world
  size 1 (2 -> 1: the plain module gets the whole weight) and finishes.

Every attempt appends (restart count, rank, world size, start step) to ``starts.jsonl`` and its
pid to ``pids`` (torchrun starts workers in their own session: the test kills them if it fails).
"""

import json
import os
import signal
import time

import torch

import minidist as md
from minidist import checkpoint
from minidist.parallel.zero import FullyShardedModule

STEPS = 6


class Weight(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c).sum()  # gradient: c


def latest(folder: str) -> int:
    done = [int(n[5:]) for n in os.listdir(folder) if n.startswith("ckpt-") and n[5:].isdigit()]
    done = [s for s in done if os.path.exists(os.path.join(folder, f"ckpt-{s}", checkpoint.METADATA))]
    return max(done, default=0)


def train(comm, folder: str):
    with open(os.path.join(folder, "pids"), "a") as f:
        f.write(f"{os.getpid()}\n")
    plain = Weight()
    model = FullyShardedModule(plain, comm) if comm.world_size > 1 else plain
    start = latest(folder)
    if start:
        checkpoint.load(os.path.join(folder, f"ckpt-{start}"), {"model": model}, comm)
    record = {"restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]), "rank": comm.rank}
    with open(os.path.join(folder, "starts.jsonl"), "a") as f:
        f.write(json.dumps({**record, "world": comm.world_size, "start": start}) + "\n")
    marker = os.path.join(folder, "killed")
    for step in range(start, STEPS):
        if step > start:
            checkpoint.save(os.path.join(folder, f"ckpt-{step}"), {"model": model}, comm)
        if comm.rank == 1 and step == 2 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        if os.environ.get("MINIDIST_DIE_AT") == str(step):
            with open(os.path.join(folder, "die.json.tmp"), "w") as f:
                json.dump({"worker": os.getpid(), "agent": os.getppid()}, f)
            os.replace(os.path.join(folder, "die.json.tmp"), os.path.join(folder, "die.json"))
            time.sleep(120)  # the test kills our agent and us
        c = torch.full((3,), float(comm.rank + 1 + step), dtype=torch.float64)
        model.zero_grad()
        model(c).backward()
        with torch.no_grad():
            for p in model.parameters():  # the shard (world 2, gradient averaged) or the weight
                p -= 0.1 * p.grad
    full = model.full_state()["w"] if comm.world_size > 1 else plain.w.detach()
    return {"start": start, "w": full.tolist()}


if __name__ == "__main__":
    folder = os.environ["MINIDIST_TEST_OUT"]
    outs = md.launch(train, args=(folder,), transport="torch", timeout=60)
    with open(os.path.join(folder, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(outs, f)

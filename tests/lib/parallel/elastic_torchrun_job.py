"""Run under torchrun's elastic mode by test_elastic.py: the torchrun way of surviving a death.

Two agents (two "nodes", one worker each) with ``--max-restarts=1``: rank 1 SIGKILLs itself at
step 2 (once: a marker file says it has); its agent sees the death, the rendezvous closes a new
round, *every* worker is restarted, and each resumes from the checkpoint rank 0 saved after every
step. (Not TORCHELASTIC_RESTART_COUNT to decide: it counts each agent's own restarts only.)
"""

import json
import os
import signal

import torch

import minidist as md

STEPS = 4


def train(comm, folder: str):
    marker = os.path.join(folder, "killed")
    torch.manual_seed(0)
    w = torch.zeros(3, dtype=torch.float64)
    path = os.path.join(folder, "checkpoint.pt")
    start = 0
    if os.path.exists(path):
        state = torch.load(path, weights_only=True)
        w, start = state["w"], state["step"]
    for step in range(start, STEPS):
        if comm.rank == 1 and step == 2 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        grad = torch.full((3,), float(comm.rank + 1 + step), dtype=torch.float64)
        w -= 0.1 * md.allreduce(comm, grad) / comm.world_size
        if comm.rank == 0:
            torch.save({"w": w, "step": step + 1}, path + ".tmp")
            os.replace(path + ".tmp", path)
    return {"start": start, "w": w.tolist()}


if __name__ == "__main__":
    folder = os.environ["MINIDIST_TEST_OUT"]
    outs = md.launch(train, args=(folder,), transport="torch", timeout=60)
    with open(os.path.join(folder, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(outs, f)

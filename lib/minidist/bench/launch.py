"""Start-up benchmark: start N workers, meet at a barrier, return -- ours vs torch.

    python -m minidist.bench launch [--world-sizes 1 2 4]

* ours, forkserver: ``md.launch`` with its default start method. The fork
  server has torch and minidist imported already, so a worker is a fork()
  away. The first call pays for starting the fork server ("cold"); every later
  call in the same Python process (your notebook kernel) is "warm".
* ours, spawn: ``md.launch(start_method="spawn")``: every worker is a new
  interpreter that imports torch itself.
* torch.multiprocessing.spawn: the usual way to start workers in PyTorch
  tutorials; each worker imports torch and waits at a multiprocessing Barrier.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from ..comm import Communicator
from ._util import new_figure, out_dir, print_table, save_json


def barrier_worker(comm: Communicator):
    comm.barrier()
    return comm.rank


def _spawn_target(index, barrier):
    barrier.wait()


def time_torch_spawn(world_size: int) -> float:
    import torch.multiprocessing as torch_mp

    start = time.perf_counter()
    barrier = torch_mp.get_context("spawn").Barrier(world_size)
    torch_mp.spawn(_spawn_target, args=(barrier,), nprocs=world_size, join=True)
    return time.perf_counter() - start


def time_ours(world_size: int, start_method: str) -> float:
    import minidist as md

    start = time.perf_counter()
    outs = md.launch(barrier_worker, world_size, start_method=start_method, timeout=120)
    elapsed = time.perf_counter() - start
    assert outs == list(range(world_size))
    return elapsed


def cold_start(world_size: int) -> float:
    """A fresh Python that starts the fork server, as a new notebook kernel does."""
    code = (
        "import time, minidist as md\n"
        "from minidist.bench.launch import barrier_worker\n"
        "if __name__ == '__main__':\n"
        "    t = time.perf_counter()\n"
        f"    md.launch(barrier_worker, {world_size}, timeout=120)\n"
        "    print(time.perf_counter() - t)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def run(world_sizes=(1, 2, 4), repeats: int = 5, out: str | None = None, plot: bool = True) -> dict:
    rows, data = [], {}
    time_ours(1, "forkserver")  # start this process's fork server outside the measurement
    for n in world_sizes:
        print(f"measuring {n} workers ...", flush=True)
        warm = statistics.median(time_ours(n, "forkserver") for _ in range(repeats))
        cold = cold_start(n)
        spawn = statistics.median(time_ours(n, "spawn") for _ in range(max(1, repeats // 2)))
        torch_spawn = statistics.median(time_torch_spawn(n) for _ in range(max(1, repeats // 2)))
        data[n] = {"ours_warm": warm, "ours_cold": cold, "ours_spawn": spawn, "torch_spawn": torch_spawn}
        rows.append([n, warm * 1e3, cold * 1e3, spawn * 1e3, torch_spawn * 1e3, torch_spawn / warm])
    print()
    print_table(
        ["workers", "ours ms", "ours cold ms", "ours spawn ms", "torch.mp.spawn ms", "x torch"],
        rows,
        title="start N workers + barrier + return (median); x torch = torch.mp.spawn / ours (warm)",
    )
    if 4 in data:
        ratio = data[4]["torch_spawn"] / data[4]["ours_warm"]
        print(
            f"\ngoal: >= 3x faster than torch.multiprocessing.spawn with 4 workers -> {ratio:.1f}x "
            f"({'met' if ratio >= 3 else 'NOT met'})"
        )
    directory = out_dir(out)
    save_json(directory, "launch", {str(k): v for k, v in data.items()})
    if plot:
        fig, ax = new_figure(1, figsize=(6, 4))
        for key, label in [
            ("ours_warm", "minidist (forkserver, warm)"),
            ("ours_cold", "minidist (cold)"),
            ("ours_spawn", "minidist (spawn)"),
            ("torch_spawn", "torch.multiprocessing.spawn"),
        ]:
            ax.plot(list(data), [data[n][key] for n in data], "-o", label=label)
        ax.set(xlabel="workers", ylabel="seconds", yscale="log", title="start + barrier + return")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(directory / "launch.png", dpi=120)
        print(f"plot saved to {directory / 'launch.png'}")
    return data

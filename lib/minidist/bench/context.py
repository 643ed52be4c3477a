"""``python -m minidist.bench context``: ring vs Ulysses attention, predicted and on the emulated clock.

Which context-parallel attention is faster depends on how the link compares with the compute.
Per layer forward on p ranks (``parallel.context.costs``):

    ring      p-1 steps, each sending a K/V shard (2B bytes) while computing on the one in hand:
              T = sum_{t<p-1} max(c_t, alpha + 2B/bw) + c_{p-1}
    Ulysses   4 all-to-alls of (p-1)/p B bytes, not overlapped, then all the compute:
              T = 4 (p-1) (alpha + B/(p bw)) + C/p          (needs p | heads)

Ulysses sends p/2 times fewer bytes, so it wins while the transfers cannot hide (short
sequences: compute grows as S^2, bytes as S); ring attention wins once each step's compute
covers its transfer (long sequences), and it is the only one left when p > heads.

Measured on the emulated clock: each rank's link is ``EmulatedLinkComm`` (alpha + bytes / bw)
and each tile (ring) or the local attention (Ulysses) also waits the time ``GPU`` would take on
its FLOPs (``compute_clock``). The tensors are small CPU tensors (b=1, a=4, d=8; non-causal, so
the contiguous layout is balanced), so the cluster is scaled down with them -- a 10 MFLOP/s
device and 0.2 MB/s links, alpha 0.2 ms: the ratio of compute to transfer is what decides,
and the prediction uses the same numbers. The real CPU work on the small tiles and the
scheduling of 4 processes on 2 cores come on top of the emulated time (a millisecond or two a
step on a loaded machine: hence the slow scaled cluster, where that is a few percent).

Printed: predicted and emulated forward time (slowest rank, median of ``repeats`` after one
warm-up call), their ratio, and which method wins by each. One run (load ~10 on 2 cores):
S=64 ring 65.3 ms predicted / 69.8 emulated, Ulysses 46.2 / 53.8 -- Ulysses wins 1.30x;
S=512 ring 838.9 / 846.9, Ulysses 1087.0 / 1097.8 -- ring wins 1.30x; 2 heads on 4 ranks:
ring only, 68.6 / 72.9. Results: bench-results/context.json.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from minidist.clock import GPUSpec
from minidist.launch import launch
from minidist.parallel import context
from minidist.transport.emulated import EmulatedLinkComm

from ._util import out_dir, print_table, save_json

__all__ = ["POINTS", "Point", "add_parser", "main", "measure", "run"]

GPU = GPUSpec("scaled-down device, 10 MFLOP/s", 1e7, 1.0)


@dataclass(frozen=True)
class Point:
    name: str
    seq: int
    heads: int = 4
    bandwidth_Bps: float = 0.2e6
    alpha_s: float = 2e-4
    batch: int = 1
    head_dim: int = 8


POINTS = (
    Point("short sequence", seq=64),
    Point("long sequence", seq=512),
    Point("2 heads < p", seq=128, heads=2),
)


def predict(pt: Point, p: int) -> dict[str, float | None]:
    args = (pt.batch, pt.heads, pt.seq, pt.head_dim, p, pt.alpha_s, pt.bandwidth_Bps, GPU)
    ring = context.ring_time(*args, causal=False, layout="contiguous")
    ulysses = context.ulysses_time(*args) if pt.heads % p == 0 else None
    return {"ring": ring, "ulysses": ulysses}


def _worker(comm, points: tuple[Point, ...], repeats: int) -> dict:
    gen = torch.Generator().manual_seed(comm.rank)
    times: dict = {}
    for pt in points:
        link = EmulatedLinkComm(comm, pt.alpha_s, pt.bandwidth_Bps)
        shape = (pt.batch, pt.heads, pt.seq // comm.world_size, pt.head_dim)
        q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
        methods = {
            "ring": lambda: context.ring_attention(q, k, v, link, False, "contiguous", compute_clock=GPU)
        }
        if pt.heads % comm.world_size == 0:
            methods["ulysses"] = lambda: context.ulysses_attention(q, k, v, link, False, compute_clock=GPU)
        for method, fn in methods.items():
            samples = []
            with torch.no_grad():
                fn()  # warm-up: threads started, buffers allocated
            for _ in range(repeats):
                comm.barrier()
                start = time.perf_counter()
                with torch.no_grad():
                    fn()
                samples.append(time.perf_counter() - start)
            times[pt.name, method] = samples
        link.close()
    return times


def measure(points: tuple[Point, ...] = POINTS, world_size: int = 4, repeats: int = 3) -> list[dict]:
    """One launch; per point and method: predicted and emulated seconds (slowest rank, median)."""
    outs = launch(_worker, world_size, args=(points, repeats), timeout=300, threads_per_worker=1)
    rows = []
    for pt in points:
        for method, predicted in predict(pt, world_size).items():
            if predicted is None:
                rows.append({**asdict(pt), "method": method, "predicted_s": None, "emulated_s": None})
                continue
            slowest = [max(o[pt.name, method][i] for o in outs) for i in range(repeats)]
            emulated = statistics.median(slowest)
            rows.append({**asdict(pt), "method": method, "predicted_s": predicted, "emulated_s": emulated})
    return rows


def run(
    world_size: int = 4, repeats: int = 3, out: str | None = None, points: tuple[str, ...] = ()
) -> list[dict]:
    chosen = tuple(pt for pt in POINTS if not points or pt.name in points)
    rows = measure(chosen, world_size, repeats)
    table = []
    for row in rows:
        if row["predicted_s"] is None:
            table.append(
                [row["name"], row["seq"], row["heads"], row["method"], "-", "-", f"p={world_size} > heads"]
            )
            continue
        ratio = row["emulated_s"] / row["predicted_s"]
        ms = [f"{row[k] * 1e3:.1f}" for k in ("predicted_s", "emulated_s")]
        table.append([row["name"], row["seq"], row["heads"], row["method"], *ms, f"{ratio:.2f}"])
    print_table(
        ["point", "S", "heads", "method", "predicted ms", "emulated ms", "emulated/predicted"],
        table,
        f"Context-parallel attention forward, p={world_size}, {GPU.name}, links alpha 0.2 ms, 0.2 MB/s",
    )
    winners = []
    for pt in chosen:
        mine = {r["method"]: r for r in rows if r["name"] == pt.name and r["predicted_s"] is not None}
        if len(mine) == 2:
            by = {k: min(mine, key=lambda m, k=k: mine[m][k]) for k in ("predicted_s", "emulated_s")}
            speedup = max(r["emulated_s"] for r in mine.values()) / min(
                r["emulated_s"] for r in mine.values()
            )
            winners.append([pt.name, by["predicted_s"], by["emulated_s"], f"{speedup:.2f}x"])
        else:
            winners.append([pt.name, "ring (only)", "ring (only)", "-"])
    print_table(["point", "wins (predicted)", "wins (emulated)", "by (emulated)"], winners)
    save_json(out_dir(out), "context", {"world_size": world_size, "gpu": GPU.name, "rows": rows})
    return rows


def add_parser(sub) -> None:
    parser = sub.add_parser("context", help="ring vs Ulysses attention: predicted vs the emulated clock")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--points", nargs="+", default=[], help=f"default: all of {[pt.name for pt in POINTS]}"
    )
    parser.add_argument("--out", default=None)


def main(args) -> list[dict]:
    return run(args.world_size, args.repeats, args.out, tuple(args.points))

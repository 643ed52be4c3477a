"""Point-to-point benchmark: latency and bandwidth of each transport vs gloo.

Two ranks play ping-pong: rank 0 sends n bytes, rank 1 sends them back. The
one-way time is half the round trip (best of a few repeats); bandwidth is
n / one-way time. The baseline, torch.distributed's gloo ``send``/``recv``,
is measured in the same run, on the same ranks, between the same tensors.

    python -m minidist.bench p2p [--max-size 256MiB] [--transports pipe shm torch]
"""

from __future__ import annotations

import math
import time

import torch

from ..collectives.cost_model import AlphaBeta, fit_alpha_beta
from ..comm import Communicator
from ._util import KIB, MIB, human_bytes, new_figure, out_dir, print_table, save_json, size_range


def iterations_for(size: int, scale: float = 1.0) -> int:
    """Enough round trips to move ~128 MiB, between 3 and 1000 (same on both ranks)."""
    return max(3, min(1000, int(scale * (128 * MIB) / max(size, 16 * KIB))))


def _pingpong(send, recv, barrier, rank: int, tensor: torch.Tensor, iterations: int, repeats: int) -> float:
    best = math.inf
    for repeat in range(repeats + 1):  # the first repeat is a warm-up
        barrier()
        start = time.perf_counter()
        for _ in range(iterations if repeat else 2):
            if rank == 0:
                send(tensor, 1)
                recv(tensor, 1)
            else:
                recv(tensor, 0)
                send(tensor, 0)
        elapsed = time.perf_counter() - start
        if repeat:
            best = min(best, elapsed / iterations / 2)
    return best


def pingpong_worker(
    comm: Communicator, sizes: list[int], repeats: int, with_gloo: bool, scale: float = 1.0
) -> dict:
    """Run by ``md.launch`` on 2 ranks; returns {"ours": {size: s}, "gloo": {size: s}}."""
    out: dict[str, dict[int, float]] = {"ours": {}, "gloo": {}}
    for size in sizes:
        tensor = torch.zeros(size, dtype=torch.uint8)
        iterations = iterations_for(size, scale)
        out["ours"][size] = _pingpong(
            comm.send, comm.recv, comm.barrier, comm.rank, tensor, iterations, repeats
        )
        if with_gloo:  # plain torch.distributed on the process group our torch transport opened
            import torch.distributed as dist

            out["gloo"][size] = _pingpong(
                lambda t, p: dist.send(t, p),
                lambda t, p: dist.recv(t, p),
                dist.barrier,
                comm.rank,
                tensor,
                iterations,
                repeats,
            )
    return out


def measure_alpha_beta(transport: str = "shm", sizes=None, repeats: int = 3) -> AlphaBeta:
    """Fit the cost model's alpha (latency) and beta (seconds per byte) to a 2-rank
    ping-pong on this machine; starts 2 workers with ``md.launch``.

    The fit is ``cost_model.fit_alpha_beta`` (least squares in relative error), so a
    1 KiB message counts as much as a 16 MiB one. gamma keeps its default.
    """
    import minidist as md

    sizes = sizes or [1 << k for k in range(10, 25, 2)]
    result = md.launch(
        pingpong_worker, 2, args=(sizes, repeats, False, 0.2), transport=transport, timeout=300
    )
    seconds = result[0]["ours"]
    alpha, beta = fit_alpha_beta(list(seconds), list(seconds.values()))
    return AlphaBeta(alpha=max(alpha, 1e-7), beta=max(beta, 1e-13))


def run(
    max_size: int = 256 * MIB,
    transports=("pipe", "shm", "torch"),
    repeats: int = 3,
    out: str | None = None,
    plot: bool = True,
    scale: float = 1.0,
) -> dict:
    import minidist as md

    sizes = size_range(KIB, max_size)
    if "torch" not in transports:
        transports = (*transports, "torch")  # gloo's numbers come from the torch launch
    results: dict[str, dict[int, float]] = {}
    for transport in transports:
        print(f"measuring {transport} ...", flush=True)
        outs = md.launch(
            pingpong_worker,
            2,
            args=(sizes, repeats, transport == "torch", scale),
            transport=transport,
            timeout=1200,
        )
        results[transport] = outs[0]["ours"]
        if transport == "torch":
            results["gloo"] = outs[0]["gloo"]
    names = [t for t in transports] + ["gloo"]
    gloo = results["gloo"]
    headers = ["size"]
    for name in names:
        headers += [f"{name} us", f"{name} GB/s"] + (["x gloo"] if name != "gloo" else [])
    rows = []
    for size in sizes:
        row: list = [human_bytes(size)]
        for name in names:
            t = results[name][size]
            row += [t * 1e6, size / t / 1e9]
            if name != "gloo":
                row.append(gloo[size] / t)
        rows.append(row)
    print()
    print_table(
        headers,
        rows,
        title="point-to-point ping-pong, 2 ranks: one-way time, bandwidth, and "
        "x gloo = gloo's time / ours (higher is better)",
    )
    summary = _goals(results, sizes)
    directory = out_dir(out)
    save_json(
        directory,
        "p2p",
        {
            "sizes": sizes,
            "seconds": {k: {str(s): v for s, v in r.items()} for k, r in results.items()},
            "goals": summary,
        },
    )
    if plot:
        path = _plot(results, sizes, names, directory)
        print(f"plot saved to {path}")
    return {"sizes": sizes, "seconds": results, "goals": summary}


def _goals(results, sizes) -> dict:
    gloo, shm = results["gloo"], results.get("shm")
    if shm is None:
        return {}
    big = [s for s in sizes if s >= MIB]
    bw_ratio = min(gloo[s] / shm[s] for s in big) if big else float("nan")
    lat_ratio = gloo[KIB] / shm[KIB]
    print()
    print(
        f"goal: shm bandwidth >= 3x gloo from 1 MiB up   -> worst ratio {bw_ratio:.1f}x "
        f"({'met' if bw_ratio >= 3 else 'NOT met'})"
    )
    print(
        f"goal: shm latency at 1 KiB >= 20x lower than gloo -> {lat_ratio:.1f}x "
        f"({'met' if lat_ratio >= 20 else 'NOT met'})"
    )
    return {"shm_bandwidth_ratio_min_from_1MiB": bw_ratio, "shm_latency_ratio_1KiB": lat_ratio}


def _plot(results, sizes, names, directory):
    fig, (left, right) = new_figure(2, figsize=(11, 4))
    for name in names:
        times = [results[name][s] for s in sizes]
        style = "k--" if name == "gloo" else "-o"
        left.loglog(sizes, [t * 1e6 for t in times], style, label=name, markersize=3)
        right.semilogx(sizes, [s / t / 1e9 for s, t in zip(sizes, times)], style, label=name, markersize=3)
    left.set(xlabel="message size (bytes)", ylabel="one-way time (us)", title="latency")
    right.set(xlabel="message size (bytes)", ylabel="GB/s", title="bandwidth")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = directory / "p2p.png"
    fig.savefig(path, dpi=120)
    return path

"""Allreduce benchmark: every algorithm on every transport vs torch.distributed gloo
(and all-to-all beside gloo's ``all_to_all_single``: ``bench.all_to_all``).

    python -m minidist.bench collectives --world-size 2 [--max-size 256MiB]

Definitions as in nccl-tests: for an allreduce of S bytes taking t seconds,
``algbw = S / t`` and ``busbw = algbw * 2 (p - 1) / p`` -- the bandwidth each
link must sustain, comparable across world sizes and with point-to-point
bandwidth. gloo's ``all_reduce`` runs in the same processes, on the same
tensors, in the same run; "x gloo" is our busbw over gloo's (= gloo's time over
ours).

The memory-copy ceiling: an in-place allreduce must at least read each rank's S
input bytes and write its S result bytes -- one memcpy of S bytes per rank, all
ranks at once. The benchmark times exactly that (``copy_`` between two private
buffers of S bytes, every rank copying at the same time, as they do during an
allreduce) and prints the busbw an allreduce would reach if it cost no more than
that copy: ``ceiling busbw = 2 (p-1)/p * S / t_memcpy``. No algorithm on this
machine can beat it; "% ceiling" says how far each one is from it. (The shm
allreduce moves more than that per rank: (p-1)/p S copied into the workspace,
(p-1)/p S copied out, S/p reduced from p sources and copied twice -- for p = 2,
two memcpys' worth of traffic, half of it staying in the cache.)
"""

from __future__ import annotations

import math
import time

import torch

from ..comm import Communicator
from ._util import KIB, MIB, human_bytes, new_figure, out_dir, print_table, save_json, size_range

TRANSPORT_ALGORITHMS = {
    "shm": ("shm", "ring", "butterfly", "tree", "star"),
    "pipe": ("ring", "butterfly", "tree", "star"),
    "torch": ("ring", "butterfly", "tree", "star"),
}


def iterations_for(size: int, scale: float = 1.0) -> int:
    return max(3, min(500, int(scale * (64 * MIB) / max(size, 4 * KIB))))


def _time(run, barrier, iterations: int, repeats: int) -> float:
    best = math.inf
    for repeat in range(repeats + 1):  # repeat 0 warms up
        barrier()
        start = time.perf_counter()
        for _ in range(iterations if repeat else 1):
            run()
        elapsed = time.perf_counter() - start
        if repeat:
            best = min(best, elapsed / iterations)
    return best


def allreduce_worker(
    comm: Communicator, algorithms, sizes, repeats: int, with_gloo: bool, scale: float = 1.0
) -> dict:
    """Seconds per allreduce for each (algorithm, size); slowest rank's view is what counts,
    so every rank measures and the launcher keeps the maximum. With ``with_gloo``, also
    gloo's allreduce and the memory-copy ceiling ("memcpy": one copy of the tensor)."""
    import minidist as md

    extra = ["gloo", "memcpy"] if with_gloo else []
    out: dict[str, dict[int, float]] = {name: {} for name in (*algorithms, *extra)}
    for size in sizes:
        tensor = torch.zeros(max(size // 4, 1), dtype=torch.float32)  # sums of zeros never overflow
        iterations = iterations_for(size, scale)
        if with_gloo:
            copy = torch.empty_like(tensor)
            out["memcpy"][size] = _time(lambda c=copy: c.copy_(tensor), comm.barrier, iterations, repeats)
            del copy
        for algorithm in algorithms:
            out[algorithm][size] = _time(
                lambda a=algorithm: md.allreduce(comm, tensor, algorithm=a), comm.barrier, iterations, repeats
            )
        if with_gloo:
            import torch.distributed as dist

            out["gloo"][size] = _time(lambda: dist.all_reduce(tensor), dist.barrier, iterations, repeats)
    return out


def _worker(comm: Communicator, algorithms, sizes, repeats: int, with_gloo: bool, scale: float) -> tuple:
    """One launch per transport measures both collectives: (allreduce, all_to_all) seconds."""
    from .all_to_all import all_to_all_worker

    allreduce = allreduce_worker(comm, algorithms, sizes, repeats, with_gloo, scale)
    return allreduce, all_to_all_worker(comm, sizes, repeats, with_gloo, scale)


def run(
    world_size: int = 2,
    max_size: int = 256 * MIB,
    transports=("shm", "pipe", "torch"),
    repeats: int = 3,
    out: str | None = None,
    plot: bool = True,
    scale: float = 1.0,
) -> dict:
    import minidist as md

    sizes = size_range(KIB, max_size)
    if "torch" not in transports:
        transports = (*transports, "torch")
    seconds: dict[str, dict[int, float]] = {}
    a2a_seconds: dict[str, dict[int, float]] = {}
    for transport in transports:
        print(f"measuring {transport} ...", flush=True)
        algorithms = TRANSPORT_ALGORITHMS[transport]
        both = md.launch(
            _worker,
            world_size,
            args=(algorithms, sizes, repeats, transport == "torch", scale),
            transport=transport,
            timeout=3000,
        )
        outs = [allreduce for allreduce, _ in both]
        for name in both[0][1]:  # all_to_all: the slowest rank's time, like the allreduce
            key = name if name.startswith("gloo") else f"{name}/{transport}"
            a2a_seconds[key] = {s: max(o[1][name][s] for o in both) for s in sizes}
        for name in outs[0]:
            per_size = {s: max(o[name][s] for o in outs) for s in sizes}
            if name == "memcpy":
                memcpy = per_size
            else:
                seconds["gloo" if name == "gloo" else f"{name}/{transport}"] = per_size
    factor = 2 * (world_size - 1) / world_size
    gloo = seconds["gloo"]
    names = [n for n in seconds if n != "gloo"] + ["gloo"]
    rows = []
    for name in names:
        for size in sizes:
            t = seconds[name][size]
            algbw = size / t / 1e9
            ceiling = 100 * memcpy[size] / t
            rows.append([name, human_bytes(size), t * 1e6, algbw, algbw * factor, gloo[size] / t, ceiling])
    print()
    print_table(
        ["algorithm/transport", "size", "time us", "algbw GB/s", "busbw GB/s", "x gloo", "% ceiling"],
        rows,
        title=f"allreduce of float32, {world_size} ranks "
        "(busbw = algbw * 2(p-1)/p; x gloo = gloo time / ours; % ceiling = memcpy time / ours)",
    )
    print()
    print_table(
        ["size", "memcpy GB/s", "ceiling busbw", "gloo busbw", "5x gloo", "ceiling / gloo"],
        [
            [
                human_bytes(s),
                s / memcpy[s] / 1e9,
                s / memcpy[s] / 1e9 * factor,
                s / gloo[s] / 1e9 * factor,
                5 * s / gloo[s] / 1e9 * factor,
                gloo[s] / memcpy[s],
            ]
            for s in sizes
        ],
        title="memory-copy ceiling: every rank copies S bytes once, all at the same time "
        "(the least any in-place allreduce must do); ceiling busbw = 2(p-1)/p * S / t_memcpy",
    )
    from .all_to_all import report

    a2a_seconds = {k: a2a_seconds[k] for k in sorted(a2a_seconds, key=lambda k: (k.startswith("gloo"), k))}
    report(a2a_seconds, sizes, world_size)
    goals = _goals(seconds, sizes, world_size)
    crossings = _crossovers(seconds, sizes, world_size, transports)
    directory = out_dir(out)
    save_json(
        directory,
        f"collectives_p{world_size}",
        {
            "world_size": world_size,
            "sizes": sizes,
            "seconds": {k: {str(s): v for s, v in d.items()} for k, d in seconds.items()},
            "memcpy_seconds": {str(s): v for s, v in memcpy.items()},
            "goals": goals,
            "crossovers": crossings,
            "all_to_all": {k: {str(s): v for s, v in d.items()} for k, d in a2a_seconds.items()},
        },
    )
    if plot:
        path = _plot(seconds, sizes, names, world_size, directory)
        print(f"plot saved to {path}")
    return {
        "sizes": sizes,
        "seconds": seconds,
        "memcpy_seconds": memcpy,
        "goals": goals,
        "crossovers": crossings,
        "all_to_all": a2a_seconds,
    }


def _crossovers(seconds, sizes, world_size, transports) -> dict:
    """Measured vs predicted best point-to-point algorithm per size, per transport.

    The prediction uses alpha and beta fitted to a ping-pong on this machine
    (``p2p.measure_alpha_beta``) and the formulas in ``cost_model.predict``.
    """
    from ..collectives import cost_model
    from .p2p import measure_alpha_beta

    report = {}
    print()
    for transport in transports:
        algorithms = [a for a in TRANSPORT_ALGORITHMS[transport] if a != "shm"]
        model = measure_alpha_beta(transport, sizes=[KIB, 16 * KIB, 256 * KIB, 4 * MIB], repeats=2)
        measured = [min(algorithms, key=lambda a: seconds[f"{a}/{transport}"][s]) for s in sizes]
        predicted = [
            min(algorithms, key=lambda a: cost_model.predict(a, world_size, s, model)) for s in sizes
        ]
        changes = lambda best: [
            (sizes[i], best[i - 1], best[i]) for i in range(1, len(best)) if best[i] != best[i - 1]
        ]
        report[transport] = {
            "alpha_us": model.alpha * 1e6,
            "beta_GBps": 1 / model.beta / 1e9,
            "measured_best": measured,
            "predicted_best": predicted,
            "measured_crossovers": changes(measured),
            "predicted_crossovers": changes(predicted),
        }
        print(f"{transport}: alpha {model.alpha * 1e6:.1f} us, 1/beta {1 / model.beta / 1e9:.2f} GB/s")
        print(f"  measured best : {' '.join(f'{human_bytes(s)}:{b}' for s, b in zip(sizes, measured))}")
        print(f"  predicted best: {' '.join(f'{human_bytes(s)}:{b}' for s, b in zip(sizes, predicted))}")
    return report


def _goals(seconds, sizes, world_size) -> dict:
    gloo = seconds["gloo"]
    big = [s for s in sizes if s >= MIB]
    goals = {}
    if "shm/shm" in seconds and big:
        shm = seconds["shm/shm"]
        goals["shm_busbw_ratio_min_from_1MiB"] = min(gloo[s] / shm[s] for s in big)
        goals["shm_time_ratio_1KiB"] = gloo[KIB] / shm[KIB]
        ring = seconds["ring/shm"]
        goals["ring_shm_busbw_ratio_min_from_1MiB"] = min(gloo[s] / ring[s] for s in big)
        print()
        for key, target, text in [
            ("shm_busbw_ratio_min_from_1MiB", 5, "shm allreduce busbw >= 5x gloo from 1 MiB up"),
            ("shm_time_ratio_1KiB", 50, "shm allreduce time at 1 KiB >= 50x lower than gloo"),
            ("ring_shm_busbw_ratio_min_from_1MiB", 1, "ring over shm busbw >= gloo's from 1 MiB up"),
            ("ring_shm_busbw_ratio_min_from_1MiB", 1.5, "ring over shm busbw >= 1.5x gloo from 1 MiB up"),
        ]:
            value = goals[key]
            verdict = "met" if value >= target else "NOT met"
            print(f"goal ({world_size} ranks): {text:<52} -> {value:.1f}x ({verdict})")
    return goals


def _plot(seconds, sizes, names, world_size, directory):
    factor = 2 * (world_size - 1) / world_size
    fig, (left, right) = new_figure(2, figsize=(12, 4.5))
    for name in names:
        times = [seconds[name][s] for s in sizes]
        style = "k--" if name == "gloo" else "-o"
        left.loglog(sizes, [t * 1e6 for t in times], style, label=name, markersize=3)
        right.semilogx(
            sizes, [s / t / 1e9 * factor for s, t in zip(sizes, times)], style, label=name, markersize=3
        )
    left.set(xlabel="bytes", ylabel="time per allreduce (us)", title=f"allreduce, {world_size} ranks")
    right.set(xlabel="bytes", ylabel="busbw (GB/s)", title="bus bandwidth")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = directory / f"collectives_p{world_size}.png"
    fig.savefig(path, dpi=120)
    return path

"""``python -m minidist.bench averaging``: who averages the gradients, and stragglers.

``compare_architectures(cfg)`` runs the same BERT step (``cfg.model``, AdamW, one
bucket allreduced after backward) with its gradients averaged four ways
(``parallel.averaging``: central server, sharded server on every node, ring
allreduce, BytePS with 1-2 CPU summation servers) for 2-4 workers, over the emulated
10 Gbit/s link (shm underneath; servers are processes of the same launch). Per row:
bytes sent per step by a worker and by a server, measured with ``comm.stats``, next to
the formula (``averaging.expected_bytes``: M out and in for a central-server worker,
n*M for the server, 2(n-1)/n*M for a sharded/ring worker, BytePS in between); the
median step time and time in the hook, and the link-time model of the hook
(``push_pull_seconds``).

``compare_stragglers(cfg)`` trains BERT on 3 workers with rank 2 sleeping
``straggler_s`` (+ seeded jitter) before every step after the first: synchronous DDP (ring) without and
with the straggler, and "drop the slowest" (``parallel.stragglers``: an aggregator
closes each round with the first 2 of 3 pushes). Median step time of the on-time
ranks, mean loss of the last steps, how often the slow rank's gradient was used.

The machine is small and shared: compare rows of one run, not numbers across runs.

The package: ``common`` (``AveragingBench``, the batches), ``architectures`` (who averages)
and ``stragglers`` (waiting for the slowest rank or dropping it); this file prints both tables.
"""

from __future__ import annotations

import os
from dataclasses import asdict

from .._util import out_dir, save_json
from .architectures import DEFAULT_CONFIGS, compare_architectures, print_architecture_table
from .common import AveragingBench
from .stragglers import compare_stragglers, print_straggler_table


def run(
    cfg: AveragingBench = AveragingBench(),  # noqa: B008 (frozen: one shared default is safe)
    out: str | None = None,
    stragglers: bool = True,
) -> dict:
    """Both tables (what ``python -m minidist.bench averaging`` prints); JSON saved to ``out``."""
    load_before = os.getloadavg()
    print(
        f"who averages: BERT {cfg.model}, batch {cfg.batch}x{cfg.seq} per worker, {cfg.gbit_per_s:g} Gbit/s"
    )
    arch_rows = compare_architectures(cfg)
    print_architecture_table(arch_rows, cfg.gbit_per_s)
    result = {"config": asdict(cfg), "architectures": arch_rows}
    if stragglers:
        straggler_rows = compare_stragglers(cfg)
        print_straggler_table(straggler_rows, cfg)
        result["stragglers"] = straggler_rows
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} ({os.cpu_count()} cores)")
    result["load"] = [load_before, load_after]
    save_json(out_dir(out), f"averaging_{cfg.model}_{cfg.gbit_per_s:g}gbit", result)
    return result


def add_parser(sub) -> None:
    parser = sub.add_parser("averaging", help="central PS, sharded PS, ring, BytePS; stragglers (BERT)")
    parser.add_argument("--model", default=AveragingBench.model, help="BERT config: tiny, mini (default)")
    parser.add_argument("--steps", type=int, default=AveragingBench.steps)
    parser.add_argument("--gbit", type=float, default=10.0, help="emulated link bandwidth (default 10)")
    parser.add_argument("--no-stragglers", action="store_true", help="skip the straggler table")
    parser.add_argument("--out", default=None)


def main(args) -> None:
    cfg = AveragingBench(model=args.model, steps=args.steps, gbit_per_s=args.gbit)
    run(cfg, args.out, stragglers=not args.no_stragglers)


__all__ = [
    "DEFAULT_CONFIGS",
    "AveragingBench",
    "compare_architectures",
    "compare_stragglers",
    "print_architecture_table",
    "print_straggler_table",
    "run",
]

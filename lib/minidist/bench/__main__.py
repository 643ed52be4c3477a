"""``python -m minidist.bench {p2p,launch,collectives,all_to_all,glove,ddp,...,swarm}``: see each module."""

from __future__ import annotations

import argparse

from ._util import MIB


def parse_size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "b": 1}
    lowered = text.strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * units[unit])
    return int(lowered)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minidist.bench", description=__doc__)
    sub = parser.add_subparsers(dest="bench", required=True)
    p2p = sub.add_parser("p2p", help="latency and bandwidth of each transport vs torch.distributed gloo")
    p2p.add_argument(
        "--max-size", type=parse_size, default=256 * MIB, help="largest message (default 256MiB)"
    )
    p2p.add_argument("--transports", nargs="+", default=["pipe", "shm", "torch"])
    p2p.add_argument("--repeats", type=int, default=3)
    p2p.add_argument("--scale", type=float, default=1.0, help="multiply the iteration counts")
    p2p.add_argument("--out", default=None, help="folder for the JSON and the plot (default bench-results/)")
    p2p.add_argument("--no-plot", action="store_true")
    start = sub.add_parser(
        "launch", help="time to start N workers, barrier and return, vs torch.multiprocessing.spawn"
    )
    start.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    start.add_argument("--repeats", type=int, default=5)
    start.add_argument("--out", default=None)
    start.add_argument("--no-plot", action="store_true")
    coll = sub.add_parser(
        "collectives", help="allreduce (every algorithm) and all-to-all x transport vs torch.distributed gloo"
    )
    coll.add_argument("--world-size", type=int, default=2)
    coll.add_argument("--max-size", type=parse_size, default=256 * MIB)
    coll.add_argument("--transports", nargs="+", default=["shm", "pipe", "torch"])
    coll.add_argument("--repeats", type=int, default=3)
    coll.add_argument("--scale", type=float, default=1.0, help="multiply the iteration counts")
    coll.add_argument("--out", default=None)
    coll.add_argument("--no-plot", action="store_true")
    a2a = sub.add_parser(
        "all_to_all", help="all-to-all (equal, uneven) x transport vs gloo all_to_all_single"
    )
    a2a.add_argument("--world-size", type=int, default=2)
    a2a.add_argument("--max-size", type=parse_size, default=4 * MIB)
    a2a.add_argument("--transports", nargs="+", default=["shm", "pipe", "torch"])
    a2a.add_argument("--repeats", type=int, default=3)
    a2a.add_argument("--scale", type=float, default=1.0, help="multiply the iteration counts")
    a2a.add_argument("--out", default=None)
    glove = sub.add_parser("glove", help="every GloVe trainer with 1 and 2 workers: pairs/s, loss, quality")
    glove.add_argument("--corpus", default="full", help="full (default), leads, articles or small")
    glove.add_argument("--epochs", type=int, default=15)
    glove.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    glove.add_argument("--trainers", nargs="+", default=None, help="default: all")
    glove.add_argument("--out", default=None)
    glove.add_argument("--no-plot", action="store_true")
    ddp = sub.add_parser("ddp", help="data-parallel BERT: our DDP (shm, pipe, emulated 10G) vs torch DDP")
    ddp.add_argument("--model", default="mini", help="BERT config: tiny, mini (default), small")
    ddp.add_argument("--batch", type=int, default=4, help="samples per rank per step (default 4)")
    ddp.add_argument("--seq", type=int, default=64, help="tokens per sample (default 64)")
    ddp.add_argument("--steps", type=int, default=5, help="measured steps (default 5)")
    ddp.add_argument("--warmup", type=int, default=2)
    ddp.add_argument("--bucket-mb", type=float, default=1.0)
    ddp.add_argument("--transports", nargs="+", default=["shm", "pipe"])
    ddp.add_argument("--no-emulated", action="store_true", help="skip the emulated 10 Gbit/s link")
    ddp.add_argument("--out", default=None)
    ddp.add_argument("--no-plot", action="store_true")
    sub.add_parser("large_batch", help="batches B..64B: Adam linear/sqrt scaling vs LAMB", add_help=False)
    sub.add_parser(
        "swarm", help="generated tokens/s locally and through swarms of 2 and 3 servers", add_help=False
    )
    from . import compression as compression_bench  # its own arguments and main

    compression_bench.add_parser(sub)
    from . import averaging as averaging_bench  # its own arguments and main

    averaging_bench.add_parser(sub)
    from . import context as context_bench  # its own arguments and main

    context_bench.add_parser(sub)
    from . import model_parallel as model_parallel_bench  # its own arguments and main

    model_parallel_bench.add_parser(sub)
    from . import layout as layout_bench  # its own arguments and main

    layout_bench.add_parser(sub)
    from . import checkpoint as checkpoint_bench  # its own arguments and main

    checkpoint_bench.add_parser(sub)
    from . import diloco as diloco_bench  # its own arguments and main

    diloco_bench.add_parser(sub)
    from . import elastic as elastic_bench  # its own arguments and main

    elastic_bench.add_parser(sub)
    args, rest = parser.parse_known_args(argv)
    if args.bench == "large_batch":  # its own options: python -m minidist.bench large_batch --help
        from . import large_batch as bench

        return bench.main(rest)
    if args.bench == "swarm":  # its own options: python -m minidist.bench swarm --help
        from . import swarm as bench

        return bench.main(rest)
    args = parser.parse_args(argv)
    if args.bench == "compression":
        return compression_bench.main(args)
    if args.bench == "averaging":
        return averaging_bench.main(args)
    if args.bench == "context":
        return context_bench.main(args)
    if args.bench == "model_parallel":
        return model_parallel_bench.main(args)
    if args.bench == "layout":
        return layout_bench.main(args)
    if args.bench == "checkpoint":
        return checkpoint_bench.main(args)
    if args.bench == "diloco":
        return diloco_bench.main(args)
    if args.bench == "elastic":
        return elastic_bench.main_from_args(args)
    if args.bench == "ddp":
        from . import ddp as bench

        cfg = bench.DdpBench(
            model=args.model,
            batch=args.batch,
            seq=args.seq,
            steps=args.steps,
            warmup=args.warmup,
            bucket_mb=args.bucket_mb,
        )
        bench.run(cfg, tuple(args.transports), not args.no_emulated, args.out, not args.no_plot)
        return
    if args.bench == "glove":
        from . import glove as bench

        trainers = tuple(args.trainers) if args.trainers else tuple(bench.TRAINERS)
        bench.run(args.corpus, args.epochs, tuple(args.workers), trainers, args.out, not args.no_plot)
        return
    if args.bench == "all_to_all":
        from . import all_to_all as bench

        bench.run(args.world_size, args.max_size, tuple(args.transports), args.repeats, args.out, args.scale)
        return
    if args.bench == "collectives":
        from . import collectives as bench

        bench.run(
            args.world_size,
            args.max_size,
            tuple(args.transports),
            args.repeats,
            args.out,
            not args.no_plot,
            args.scale,
        )
    elif args.bench == "p2p":
        from . import p2p as bench

        bench.run(args.max_size, tuple(args.transports), args.repeats, args.out, not args.no_plot, args.scale)
    else:
        from . import launch as bench

        bench.run(args.world_sizes, args.repeats, args.out, not args.no_plot)


if __name__ == "__main__":
    main()

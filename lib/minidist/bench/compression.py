"""``python -m minidist.bench compression``: gradient compression hooks on BERT MLM, 2 ranks.

Runs lecture 6's experiment, ``minidist.models.bert_compression.compare_hooks`` (BERT tiny
trained once per row of ``minidist.parallel.compression.ablation``: dense, DGC and its five
ablations, bf16, sign EF; the rows and their optimizers are described there), and prints
its table: per row the loss relative to dense, bytes sent per rank per step against the
formula, the compression ratio, step and hook times over the emulated 10 Gbit/s link, on
shm and over a 1 Gbit/s link. Then ``allgather_growth`` measures the bytes of one bucket,
dense ring allreduce vs DGC's sparse allgather, for 2, 3 and 4 ranks.

The machine is small and shared: only ratios measured in one run are claimed.
"""

from __future__ import annotations

import os
import statistics

import torch

from ..comm import Communicator
from ..models.bert_compression import compare_hooks
from ..parallel.compression.ablation import (
    ROWS,
    CompressionBench,
)
from ._util import human_bytes, out_dir, print_table, save_json


def print_compression_table(result: dict) -> str:
    cfg = result["config"]
    dense = result["rows"][0]
    table = [
        [
            r["label"],
            r["loss"],
            f"{100 * r['loss_vs_dense']:+.1f}%",
            human_bytes(int(r["bytes_per_step"])),
            human_bytes(int(r["formula_bytes"])),
            r["ratio"],
            r["step_s_10g"] * 1e3,
            r["step_s_10g"] / dense["step_s_10g"],
            r["hook_s_10g"] * 1e3,
            r["step_s_shm"] * 1e3,
            r["hook_s_shm"] * 1e3,
            r["step_s_slow"] * 1e3,
            r["hook_s_slow"] * 1e3,
        ]
        for r in result["rows"]
    ]
    return print_table(
        [
            "hook",
            "loss",
            "vs dense",
            "bytes/step",
            "formula",
            "ratio",
            "10G step ms",
            "x dense",
            "10G hook ms",
            "shm step ms",
            "shm hook ms",
            f"{cfg['slow_link_gbps']:g}G step ms",
            f"{cfg['slow_link_gbps']:g}G hook ms",
        ],
        table,
        title=f"BERT {cfg['model']} MLM, {cfg['world_size']} ranks x batch {cfg['batch']} x seq "
        f"{cfg['seq']}, "
        f"{result['numel']:,} gradient entries, {cfg['steps']} steps of SGD lr {cfg['lr']} (momentum "
        f"{cfg['momentum']}), DGC sparsity {cfg['sparsity']} after {cfg['warmup_stage_steps']} steps per "
        f"warm-up stage. loss: mean of the last {cfg['loss_window']} steps; bytes/step: sent per rank after "
        "warm-up; ratio: dense bytes / row bytes; step ms: median step time (slowest rank); hook ms: "
        "median time in the comm hook per step (compress + communicate + decompress, rank 0); shm and "
        f"{cfg['slow_link_gbps']:g}G: {cfg['timing_steps']} steps at the final sparsity",
    )


def _bytes_worker(comm: Communicator, numel: int, sparsity: float) -> dict:
    """Bytes this rank sends for one bucket of ``numel`` entries: dense ring allreduce vs DGC."""
    from ..collectives import allreduce
    from ..parallel.compression import DeepGradientCompression, DGCConfig

    flat = torch.randn(numel, generator=torch.Generator().manual_seed(comm.rank))
    before = comm.stats
    allreduce(comm, flat.clone(), op="sum", algorithm="ring")
    middle = comm.stats
    DeepGradientCompression(DGCConfig(sparsity=sparsity))(comm, flat, 0).wait(60)
    return {"dense": (middle - before).bytes_sent, "dgc": (comm.stats - middle).bytes_sent}


def allgather_growth(numel: int, sparsity: float = 0.999, world_sizes=(2, 3, 4)) -> list[dict]:
    """Measured bytes per rank for one bucket (pipe transport: every byte is a message) of the
    dense ring allreduce and of DGC's sparse allgather, for each N, next to the formulas:
    the allgather's traffic grows as N - 1, the ring's stays below 8n."""
    import minidist as md

    from ..parallel.compression import dgc, traffic

    k = dgc.slots_for(numel, sparsity)
    rows = []
    for p in world_sizes:
        outs = md.launch(_bytes_worker, p, args=(numel, sparsity), transport="pipe", timeout=120)
        dense = statistics.mean(o["dense"] for o in outs)
        sparse = statistics.mean(o["dgc"] for o in outs)
        rows.append(
            {
                "world_size": p,
                "dense": dense,
                "dense_formula": traffic.dense_ring_bytes(numel, p),
                "dgc": sparse,
                "dgc_formula": traffic.sparse_allgather_bytes(k, p),
                "ratio": dense / sparse,
            }
        )
    return rows


def print_growth_table(rows: list[dict], numel: int, sparsity: float) -> str:
    table = [
        [
            r["world_size"],
            human_bytes(int(r["dense"])),
            human_bytes(int(r["dense_formula"])),
            human_bytes(int(r["dgc"])),
            human_bytes(int(r["dgc_formula"])),
            r["ratio"],
        ]
        for r in rows
    ]
    return print_table(
        ["ranks", "dense ring", "2(N-1)/N n 4", "DGC allgather", "(N-1) k 8", "ratio"],
        table,
        title=f"bytes sent per rank for one bucket of {numel:,} float32 entries (pipe), DGC at {sparsity}: "
        "the sparse allgather grows with N, the ring does not (ratio = 1000/N at 99.9%)",
    )


def run(
    cfg: CompressionBench = CompressionBench(),  # noqa: B008 (frozen: one shared default is safe)
    out: str | None = None,
    timing: bool = True,
) -> dict:
    load_before = os.getloadavg()
    print(f"training {len(ROWS)} rows x {cfg.steps} steps over the emulated 10 Gbit/s link ...", flush=True)
    result = compare_hooks(cfg, timing=timing)
    print()
    print_compression_table(result)
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} ({os.cpu_count()} cores)")
    rows = {r["label"]: r for r in result["rows"]}
    dgc, dense = rows["DGC"], rows["dense"]
    goals = {
        "bytes_ratio": dgc["ratio"],
        "faster_over_10g": dense["step_s_10g"] / dgc["step_s_10g"],
        "hook_faster_over_10g": dense["hook_s_10g"] / dgc["hook_s_10g"],
        "loss_vs_dense": dgc["loss_vs_dense"],
    }
    print(f"goal: DGC >= 100x fewer bytes than dense -> {goals['bytes_ratio']:.0f}x (paper: 270-600x)")
    speedup = goals["faster_over_10g"]
    hook_speedup = goals["hook_faster_over_10g"]
    print(
        f"goal: DGC faster than dense over 10 Gbit/s -> dense / DGC step time {speedup:.2f}x, "
        f"time in the hook {hook_speedup:.2f}x"
    )
    if result["rows"][0]["hook_s_slow"] == result["rows"][0]["hook_s_slow"]:  # not nan: it ran
        slow = dense["hook_s_slow"] / dgc["hook_s_slow"], dense["step_s_slow"] / dgc["step_s_slow"]
        goals["hook_faster_over_slow_link"], goals["faster_over_slow_link"] = slow
        print(
            f"over {cfg.slow_link_gbps:g} Gbit/s: dense / DGC step time {slow[1]:.2f}x, "
            f"time in the hook {slow[0]:.2f}x"
        )
    print(f"goal: DGC loss within a few percent of dense -> {100 * goals['loss_vs_dense']:+.1f}%")
    print()
    growth = allgather_growth(result["numel"], cfg.sparsity)
    print_growth_table(growth, result["numel"], cfg.sparsity)
    result["goals"], result["load"], result["growth"] = goals, [load_before, load_after], growth
    save_json(out_dir(out), f"compression_{cfg.model}_p{cfg.world_size}", result)
    return result


def add_parser(sub) -> None:
    """Register ``compression`` on the bench's subparsers (called by ``__main__``)."""
    parser = sub.add_parser(
        "compression", help="dense vs DGC (and ablations), bf16, sign-EF on BERT, 2 ranks"
    )
    parser.add_argument("--model", default="tiny", help="BERT config: tiny (default), mini")
    parser.add_argument("--steps", type=int, default=CompressionBench.steps)
    parser.add_argument("--batch", type=int, default=CompressionBench.batch)
    parser.add_argument("--seq", type=int, default=CompressionBench.seq)
    parser.add_argument("--warmup-stage-steps", type=int, default=CompressionBench.warmup_stage_steps)
    parser.add_argument("--no-timing", action="store_true", help="skip the shm timing run")
    parser.add_argument(
        "--no-averaging",
        action="store_true",
        help="skip the first table: who averages (central PS, sharded PS, ring, BytePS; "
        "`python -m minidist.bench averaging` runs it alone, with the stragglers)",
    )
    parser.add_argument("--out", default=None)


def main(args) -> None:
    if not args.no_averaging:  # the order: who averages first, then what is sent
        from . import averaging

        averaging.run(averaging.AveragingBench(), args.out, stragglers=False)
        print()
    cfg = CompressionBench(
        model=args.model,
        steps=args.steps,
        batch=args.batch,
        seq=args.seq,
        warmup_stage_steps=args.warmup_stage_steps,
    )
    run(cfg, args.out, timing=not args.no_timing)

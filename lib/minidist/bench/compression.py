"""``python -m minidist.bench compression``: gradient compression hooks on BERT MLM, 2 ranks.

``compare_hooks(cfg)`` trains the same BERT (``cfg.model``, real MLM batches of the
course text, the same batches for every row) for ``cfg.steps`` steps through our
``DistributedDataParallel`` over the emulated 10 Gbit/s link (shm underneath, so
every byte goes through point-to-point messages and is counted), once per row:

* ``dense``: the default hook (float32 allreduce), SGD with momentum, the averaged
  gradient clipped to ``clip_norm``;
* ``DGC``: ``DeepGradientCompression`` at ``sparsity`` after the warm-up
  (``warmup_stage_steps`` per stage), momentum correction in the hook, plain SGD;
* the ablations: DGC with one component removed (momentum correction -- then SGD
  keeps the momentum --, local clipping, momentum masking, warm-up, error feedback);
* ``bf16`` (bf16 allreduce) and ``sign EF`` (1 bit + a scale per bucket, error
  feedback), both with SGD momentum and clipping of the average, like dense.

One bucket (``bucket_mb=inf``, allreduced after backward): the clipping norm is the
whole gradient's, as in the paper. Per row: the mean training loss of the last
``loss_window`` steps (both ranks' losses), relative to dense; bytes sent per rank
per step after the warm-up (measured with ``comm.stats``) and the formula; the
compression ratio dense bytes / row bytes; the median step time over the emulated
link and, in two short runs with the compressors at their final sparsity, on shm
and over a slower emulated link (``slow_link_gbps``, 1 Gbit/s: the paper's case);
and the time spent in the hook per step (``TimedHook``: compression, communication
and decompression -- the part of the step that differs between rows).

The machine is small and shared: only ratios measured in one run are claimed.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch

from ..comm import Communicator, DerivedWork, Handle
from ._util import human_bytes, out_dir, print_table, save_json

GBIT = 1.25e8  # bytes per second of 1 Gbit/s


@dataclass(frozen=True)
class CompressionBench:
    """The training run every row repeats (per-rank batch; lr of SGD)."""

    model: str = "tiny"
    world_size: int = 2
    batch: int = 8
    seq: int = 64
    steps: int = 120
    lr: float = 0.1
    momentum: float = 0.9
    clip_norm: float = 1.0
    sparsity: float = 0.999
    warmup_stage_steps: int = 8
    loss_window: int = 20
    timing_steps: int = 6
    slow_link_gbps: float = 1.0  # the second timing run's link (0: skip it)
    seed: int = 0


@dataclass(frozen=True)
class Row:
    """One compressor: ``hook`` is "dense", "dgc", "bf16" or "sign"; ``dgc`` overrides DGCConfig fields."""

    label: str
    hook: str
    dgc: tuple[tuple[str, object], ...] = ()


ROWS = (
    Row("dense", "dense"),
    Row("DGC", "dgc"),
    Row("DGC - momentum correction", "dgc", (("momentum_correction", False),)),
    Row("DGC - local clipping", "dgc", (("clip_norm", None),)),
    Row("DGC - momentum masking", "dgc", (("momentum_masking", False),)),
    Row("DGC - warm-up", "dgc", (("warmup_stage_steps", 0),)),
    Row("DGC - error feedback", "dgc", (("error_feedback", False),)),
    Row("bf16", "bf16"),
    Row("sign EF", "sign"),
)


def dgc_config(cfg: CompressionBench, row: Row):
    from ..parallel.compression import DGCConfig

    base = DGCConfig(
        sparsity=cfg.sparsity,
        warmup_stage_steps=cfg.warmup_stage_steps,
        momentum=cfg.momentum,
        clip_norm=cfg.clip_norm,
        seed=cfg.seed,
    )
    return replace(base, **dict(row.dgc))


def _batches(cfg: CompressionBench, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of shape [steps, p * batch, seq]: real MLM batches, fixed seed."""
    from .. import data

    tok = data.load_tokenizer()
    blocks = data.mlm_dataset(tok, seq_len=128, split="train")[:, : cfg.seq]
    gen = torch.Generator().manual_seed(cfg.seed)
    rows = steps * cfg.world_size * cfg.batch
    chosen = blocks[torch.randint(len(blocks), (rows,), generator=gen)]
    masked = data.mask_tokens(chosen, tok, gen)
    shape = (steps, cfg.world_size * cfg.batch, cfg.seq)
    return masked.input_ids.view(shape), masked.labels.view(shape)


def _hook(cfg: CompressionBench, row: Row):
    from ..parallel import compression
    from ..parallel.buckets import allreduce_average

    if row.hook == "dgc":
        return compression.DeepGradientCompression(dgc_config(cfg, row))
    if row.hook == "bf16":
        return compression.bf16_allreduce
    if row.hook == "sign":
        return compression.SignErrorFeedback()
    return allreduce_average


class TimedHook:
    """Wraps a comm hook and adds up the seconds spent in it: the call (compression, launch)
    plus ``wait()`` (communication, decompression). With ``overlap=False`` the bucket is
    waited for right after it is launched, so this is the whole cost of the hook per step."""

    def __init__(self, inner) -> None:
        self.inner, self.seconds = inner, 0.0

    def __call__(self, comm: Communicator, flat_grad: torch.Tensor, bucket_index: int):
        start = time.perf_counter()
        work = self.inner(comm, flat_grad, bucket_index)
        self.seconds += time.perf_counter() - start
        return _TimedWork(work, self)


class _TimedWork(DerivedWork):
    """The hook's handle, with the time spent in ``wait()`` added to the hook's ``seconds``."""

    def __init__(self, work: Handle, hook: TimedHook) -> None:
        super().__init__(work)
        self.hook = hook

    def wait(self, timeout: float | None = None) -> torch.Tensor | None:
        start = time.perf_counter()
        result = super().wait(timeout)
        self.hook.seconds += time.perf_counter() - start
        return result


class RowTrainer:
    """One row's model, DDP, hook and optimizer on this rank; ``step`` trains one step.

    Every row's trainer lives in the same worker and they take their steps in turn
    (row 1 step 0, row 2 step 0, ..., row 1 step 1, ...), so a change in the machine's
    load hits every row alike; the comparison of step times is fair within one run.
    """

    def __init__(self, comm: Communicator, cfg: CompressionBench, row: Row, final_sparsity: bool) -> None:
        from ..models import bert
        from ..parallel.ddp import DistributedDataParallel

        if final_sparsity and row.hook == "dgc":  # timing run: straight to the final sparsity
            row = replace(row, dgc=(*row.dgc, ("warmup_stage_steps", 0)))
        self.comm, self.cfg, self.row = comm, cfg, row
        in_hook_momentum = row.hook == "dgc" and dgc_config(cfg, row).momentum_correction
        torch.manual_seed(cfg.seed)
        self.model = bert.BertForMLM(bert.CONFIGS[cfg.model])
        # one bucket, after backward: DGC's clipping norm is then the whole gradient's
        self.hook = TimedHook(_hook(cfg, row))
        self.ddp = DistributedDataParallel(
            self.model, comm, bucket_mb=math.inf, overlap=False, comm_hook=self.hook
        )
        momentum = 0.0 if in_hook_momentum else cfg.momentum  # momentum correction: it is in the hook
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=momentum)
        stages = len(dgc_config(cfg, row).warmup_sparsities)
        self.warmup_steps = 0 if final_sparsity else cfg.warmup_stage_steps * stages
        self.losses: list[float] = []
        self.times: list[float] = []
        self.bytes_after_warmup: list[int] = []
        self.hook_s_after_warmup: list[float] = []

    def step(self, step: int, ids: torch.Tensor, labels: torch.Tensor) -> None:
        before, hook_before, start = self.comm.stats, self.hook.seconds, time.perf_counter()
        loss = self.ddp(ids, labels=labels).loss
        loss.backward()
        if self.row.hook != "dgc":  # DGC clips locally, before compression
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.times.append(time.perf_counter() - start)
        self.losses.append(loss.item())
        if step >= self.warmup_steps:
            self.bytes_after_warmup.append((self.comm.stats - before).bytes_sent)
            self.hook_s_after_warmup.append(self.hook.seconds - hook_before)

    def result(self) -> dict:
        self.ddp.remove_hooks()
        numel = sum(p.numel() for p in {id(p): p for p in self.model.parameters()}.values())
        sent = self.bytes_after_warmup or [math.nan]
        return {
            "losses": self.losses,
            "bytes_per_step": statistics.mean(sent),
            "step_s": statistics.median(self.times[1:] or self.times),
            "hook_s": statistics.median(self.hook_s_after_warmup or [math.nan]),
            "numel": numel,
        }


def _worker(
    comm: Communicator, cfg: CompressionBench, rows, steps: int, link_Bps: float, final: bool
) -> dict:
    """Train every row for ``steps`` steps, in turn, on this rank (over an emulated link of
    ``link_Bps`` bytes/s with Ethernet's latency; 0: straight on shm)."""
    from ..transport.emulated import ETHERNET_10G, EmulatedLinkComm

    if link_Bps:
        comm = EmulatedLinkComm(comm, ETHERNET_10G.alpha_s, link_Bps)
    trainers = [RowTrainer(comm, cfg, row, final) for row in rows]
    ids, labels = _batches(cfg, steps)
    mine = slice(comm.rank * cfg.batch, (comm.rank + 1) * cfg.batch)
    comm.barrier()
    for step in range(steps):
        for trainer in trainers:
            trainer.step(step, ids[step, mine], labels[step, mine])
    return {row.label: trainer.result() for row, trainer in zip(rows, trainers)}


def _launch(cfg: CompressionBench, rows, steps: int, link_Bps: float, final: bool) -> dict:
    import minidist as md

    outs = md.launch(
        _worker,
        cfg.world_size,
        args=(cfg, rows, steps, link_Bps, final),
        transport="shm",
        threads_per_worker=1,
        timeout=120 + 10 * len(rows) * steps,
    )
    merged = {}
    for row in rows:
        per_rank = [out[row.label] for out in outs]
        merged[row.label] = {
            **per_rank[0],
            "losses": [statistics.mean(values) for values in zip(*(r["losses"] for r in per_rank))],
            "step_s": max(r["step_s"] for r in per_rank),
            "bytes_per_step": statistics.mean(r["bytes_per_step"] for r in per_rank),
        }
    return merged


def formula_bytes(cfg: CompressionBench, row: Row, numel: int) -> float:
    """What ``parallel.compression.traffic`` predicts per rank per step after the warm-up."""
    from ..parallel.compression import dgc, traffic

    p = cfg.world_size
    if row.hook == "dgc":
        return traffic.sparse_allgather_bytes(dgc.slots_for(numel, cfg.sparsity), p)
    if row.hook == "sign":
        return traffic.sign_allgather_bytes(numel, p)
    return traffic.dense_ring_bytes(numel, p, 2 if row.hook == "bf16" else 4)


def compare_hooks(cfg: CompressionBench = CompressionBench(), rows=ROWS, timing: bool = True) -> dict:
    """Train every row (emulated 10G link) and, if ``timing``, time each on shm. See the module doc."""
    trained = _launch(cfg, rows, cfg.steps, GBIT * 10, final=False)
    shm = _launch(cfg, rows, cfg.timing_steps, 0.0, final=True) if timing else {}
    slow = {}
    if timing and cfg.slow_link_gbps:
        slow = _launch(cfg, rows, cfg.timing_steps, GBIT * cfg.slow_link_gbps, final=True)
    dense = trained[rows[0].label]
    dense_loss = statistics.mean(dense["losses"][-cfg.loss_window :])
    results = []
    for row in rows:
        r = trained[row.label]
        loss = statistics.mean(r["losses"][-cfg.loss_window :])
        results.append(
            {
                "label": row.label,
                "loss": loss,
                "loss_vs_dense": loss / dense_loss - 1.0,
                "bytes_per_step": r["bytes_per_step"],
                "formula_bytes": formula_bytes(cfg, row, r["numel"]),
                "ratio": dense["bytes_per_step"] / r["bytes_per_step"],
                "step_s_10g": r["step_s"],
                "step_s_shm": shm[row.label]["step_s"] if timing else math.nan,
                "hook_s_10g": r["hook_s"],
                "hook_s_shm": shm[row.label]["hook_s"] if timing else math.nan,
                "step_s_slow": slow[row.label]["step_s"] if slow else math.nan,
                "hook_s_slow": slow[row.label]["hook_s"] if slow else math.nan,
                "losses": r["losses"],
            }
        )
    return {"config": asdict(cfg), "numel": dense["numel"], "rows": results}


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


def run(cfg: CompressionBench = CompressionBench(), out: str | None = None, timing: bool = True) -> dict:
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


__all__ = [
    "ROWS",
    "CompressionBench",
    "Row",
    "RowTrainer",
    "TimedHook",
    "allgather_growth",
    "compare_hooks",
    "print_compression_table",
    "print_growth_table",
    "run",
]

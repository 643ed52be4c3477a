"""``python -m minidist.bench ddp``: data-parallel BERT, ours against torch's DDP.

One launch of 2 ranks (shm by default) holds every variant at once, each with its
own copy of the model and optimizer, and runs them **interleaved**: one step of
each variant per round, a barrier between steps. Load that drifts during the run
(a shared 2-core machine) then slows every variant alike, and the ratios printed
are between steps taken seconds apart. Variants, with the same model, data,
global batch and one thread per process (``torch.set_num_threads(1)``):

* torch's ``nn.parallel.DistributedDataParallel`` (default settings) on a gloo
  process group opened in the same processes (a FileStore in a temporary folder);
* our ``DistributedDataParallel`` three ways: ``after backward`` (one flat buffer
  of all gradients, allreduced when backward ends: ``bucket_mb=inf,
  overlap=False``), ``buckets`` (the same buckets as the next row, all after
  backward) and ``overlap`` (each bucket launched as soon as its last gradient is
  ready);
* the same three over an emulated 10 Gbit/s Ethernet link
  (``transport.emulated.ETHERNET_10G`` wrapping the launch's communicator).

A ``one process`` row (the global batch in one process, its own launch, not
interleaved) is printed for context.

Per row: the median step time (forward + backward + AdamW step), slowest rank;
samples/s; our time over torch DDP's (< 1: faster); CPU ms per step (all threads
of the process: hooks, the communication thread and its waiting count here, and
on a machine with fewer free cores than threads CPU time is what steps cost);
bytes sent per rank per step next to the ring formula 2(p-1)/p x gradient bytes
(the shm allreduce moves data through shared memory and sends no messages: 0 bytes);
rank 0's backward span B; C, the time per step during which some bucket was in
flight; and ``trace.overlap``, the share of allreduce time that lay inside backward.

What overlap can buy at most. With forward F, backward B, allreduce C and
optimizer O, allreduce after backward costs ``F + B + C + O`` and perfect hiding
``F + max(B, C) + O``. Of the backward-and-allreduce part alone the ratio is
``(B + C) / max(B, C)``, at most 2, reached when C = B: the GPU regime, where
backward is fast and the network is the bottleneck. ``--batch 1`` moves a CPU run
towards it (less compute per rank, the same 20 MiB of gradients). But the buckets
that can launch only when backward ends (BERT's word embedding, tied with the MLM
head, and what comes after it: 40% of the bytes) never hide: with s their share,
the best step is ``F + max(B + s*C, C) + O``. The ``bound`` printed for each ``overlap``
row is the after-backward step over that best step, with B and C measured on the
``after backward`` row of the same link (where they do not overlap).

Tokens are synthetic (uniform ids, every 7th position labelled): the speed of a
step does not depend on what the words are. The load average is printed; only
ratios measured in this run are claimed.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from ..comm import Communicator
from ._util import human_bytes, new_figure, out_dir, print_table, save_json


@dataclass(frozen=True)
class DdpBench:
    """What to train: a BERT config name, per-rank batch and sequence length, and how
    many steps each variant takes (``warmup`` unmeasured, then ``steps`` measured; one
    step of every variant per round)."""

    model: str = "mini"
    world_size: int = 2
    batch: int = 4
    seq: int = 64
    steps: int = 10
    warmup: int = 2
    bucket_mb: float = 1.0
    lr: float = 1e-4


@dataclass(frozen=True)
class Mode:
    """One row: ``kind`` is "single", "ours" or "torch"; ``link`` "emulated" wraps the comm."""

    label: str
    kind: str
    bucket_mb: float = math.inf
    overlap: bool = False
    link: str = ""


def _model(cfg: DdpBench):
    from ..models import bert

    torch.manual_seed(0)
    return bert.BertForMLM(bert.CONFIGS[cfg.model])


def _batches(cfg: DdpBench, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    from ..models import bert

    vocab = bert.CONFIGS[cfg.model].vocab_size
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (cfg.warmup + cfg.steps, rows, cfg.seq), generator=gen)
    labels = torch.full_like(ids, bert.IGNORE_INDEX)
    labels[..., ::7] = ids[..., ::7]
    return ids, labels


class _Variant:
    """One row's model, optimizer and measurements inside a worker."""

    def __init__(self, comm: Communicator, cfg: DdpBench, mode: Mode) -> None:
        from .. import trace
        from ..parallel.ddp import DistributedDataParallel
        from ..transport.emulated import ETHERNET_10G, EmulatedLinkComm

        self.mode, self.comm, self.ddp, self.recorder = mode, comm, None, None
        self.model = _model(cfg)
        if mode.kind == "single":
            self.net = self.model
        elif mode.kind == "torch":
            self.net = torch.nn.parallel.DistributedDataParallel(self.model)
        else:
            if mode.link == "emulated":
                self.comm = EmulatedLinkComm(comm, *ETHERNET_10G)
            self.recorder = trace.Recorder(rank=comm.rank)
            self.net = self.ddp = DistributedDataParallel(
                self.model, self.comm, bucket_mb=mode.bucket_mb, overlap=mode.overlap, recorder=self.recorder
            )
        self.optimizer = torch.optim.AdamW(self.net.parameters(), lr=cfg.lr)
        self.times, self.cpu, self.events, self.sent = [], [], [], 0

    def step(self, ids: torch.Tensor, labels: torch.Tensor, measured: bool) -> None:
        recorder = self.recorder
        first_event = len(recorder.events) if recorder is not None else 0
        before = self.comm.stats.bytes_sent if self.ddp is not None else 0
        cpu, start = time.process_time(), time.perf_counter()
        self.net(ids, labels=labels).loss.backward()
        with recorder.span("optimizer step", cat="optimizer") if recorder else contextlib.nullcontext():
            self.optimizer.step()
            self.optimizer.zero_grad()
        if measured:
            self.times.append(time.perf_counter() - start)
            self.cpu.append(time.process_time() - cpu)
            if recorder is not None:
                self.events += recorder.events[first_event:]
                self.sent += self.comm.stats.bytes_sent - before

    def result(self) -> dict:
        from .. import trace

        grads = {id(p): p for p in self.model.parameters() if p.requires_grad}.values()
        result = {
            "step_s": statistics.median(self.times),
            "cpu_s": statistics.median(self.cpu),
            "grad_bytes": sum(p.numel() * p.element_size() for p in grads),
        }
        if self.ddp is not None:
            steps = len(self.times)
            result["bytes_per_step"] = self.sent / steps
            result["buckets"] = len(self.ddp.buckets)
            result["tail_share"] = _tail_share(self.ddp)
            result["events"] = self.events
            result["overlap"] = trace.overlap(self.events)
            backward = [e["dur_us"] / 1e3 for e in self.events if e["name"] == "backward"]
            result["backward_ms"] = statistics.median(backward)
            comm = [(e["ts_us"], e["ts_us"] + e["dur_us"]) for e in self.events if e["cat"] == "comm"]
            result["comm_ms_per_step"] = _covered_us(comm) / 1e3 / steps
            self.ddp.remove_hooks()
        return result


def _tail_share(ddp) -> float:
    """Share of the gradient bytes in the buckets that cannot launch before backward ends:
    the one holding the input word embedding (its gradient is final only when backward
    reaches the input) and every bucket after it (launched in bucket order)."""
    buckets = ddp._buckets
    first = next(
        (b.index for b in buckets if any(n.endswith("embeddings.word.weight") for n in b.names)), None
    )
    tail = buckets[-1:] if first is None else buckets[first:]
    return sum(b.nbytes for b in tail) / sum(b.nbytes for b in buckets)


def _covered_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of intervals: the time during which some allreduce was in flight
    (buckets queued behind each other overlap in time; summing them would count twice)."""
    covered, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def bench_worker(comm: Communicator, cfg: DdpBench, modes: list[Mode], store: str | None = None) -> dict:
    """Every mode on this rank, interleaved: one step of each per round (``md.launch``
    sets one thread per rank). ``store``: a file for torch's gloo process group."""
    import torch.distributed as dist

    if store is not None:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=comm.rank, world_size=comm.world_size
        )
    try:
        variants = [_Variant(comm, cfg, mode) for mode in modes]
        rows = cfg.batch * comm.world_size if modes[0].kind != "single" else cfg.batch * cfg.world_size
        mine = (
            slice(None)
            if modes[0].kind == "single"
            else slice(comm.rank * cfg.batch, (comm.rank + 1) * cfg.batch)
        )
        ids, labels = _batches(cfg, rows)
        for step in range(cfg.warmup + cfg.steps):
            for variant in variants:
                comm.barrier()  # every rank starts the step together
                variant.step(ids[step, mine], labels[step, mine], measured=step >= cfg.warmup)
        return {variant.mode.label: variant.result() for variant in variants}
    finally:
        if store is not None:
            dist.destroy_process_group()


def _launch(cfg: DdpBench, modes: list[Mode], world_size: int, transport: str) -> dict:
    import minidist as md

    folder = tempfile.mkdtemp(prefix="minidist-ddp-bench-")
    store = os.path.join(folder, "store") if any(m.kind == "torch" for m in modes) else None
    try:
        outs = md.launch(
            bench_worker,
            world_size,
            args=(cfg, modes, store),
            transport=transport,
            threads_per_worker=1,
            timeout=120 + 30 * len(modes) * (cfg.steps + cfg.warmup),
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    merged = {}
    for mode in modes:  # the slowest rank sets the pace; keep rank 0's other numbers
        rows = [out[mode.label] for out in outs]
        merged[mode.label] = {
            **rows[0],
            "step_s": max(r["step_s"] for r in rows),
            "cpu_s": statistics.mean(r["cpu_s"] for r in rows),
        }
        if "events" in rows[0]:
            merged[mode.label]["events"] = [e for r in rows for e in r["events"]]
            merged[mode.label]["overlap"] = statistics.mean(r["overlap"] for r in rows)
    return merged


def _ours(cfg: DdpBench, link: str = "") -> list[Mode]:
    suffix = " (10G)" if link else ""
    return [
        Mode(f"after backward{suffix}", "ours", math.inf, False, link),
        Mode(f"buckets{suffix}", "ours", cfg.bucket_mb, False, link),
        Mode(f"overlap{suffix}", "ours", cfg.bucket_mb, True, link),
    ]


def overlap_bound(after: dict, tail_share: float) -> tuple[float, float]:
    """The most perfect overlap could gain over an ``after backward`` row (whose B and C
    do not overlap): (its step time / the best overlapped step, (B + C) / max(B, C)).

    The best overlapped step is ``step - B - C + max(B + s*C, C)``: the buckets
    that can launch only when backward ends, a share s of the bytes (for BERT the
    one with the input word embedding, tied with the MLM head, and those after it:
    40% of mini's gradients), can never hide. C is taken from the one-flat-buffer row; more
    buckets cost a little more each, so the true bound is a little lower still.
    """
    b, c = after["backward_ms"], after["comm_ms_per_step"]
    step_ms = after["step_s"] * 1e3
    best_ms = step_ms - b - c + max(b + tail_share * c, c)
    return step_ms / best_ms, (b + c) / max(b, c)


def run(
    cfg: DdpBench = DdpBench(),
    transports=("shm",),
    emulated: bool = True,
    out: str | None = None,
    plot: bool = True,
) -> dict:
    """One process (context), then per transport one launch with torch DDP and our
    variants interleaved (the emulated link wraps the first transport)."""
    load_before = os.getloadavg()
    p = cfg.world_size
    rows: list[tuple[str, str, dict]] = []  # (transport, label, result)
    print(f"one process, global batch {cfg.batch * p} ...", flush=True)
    rows.append(("-", "one process", _launch(cfg, [Mode("one process", "single")], 1, "shm")["one process"]))
    torch_rows = {}
    for i, transport in enumerate(transports):
        modes = (
            [Mode("torch DDP", "torch")]
            + _ours(cfg)
            + (_ours(cfg, "emulated") if emulated and i == 0 else [])
        )
        print(f"torch DDP (gloo) and our DDP on {transport}, interleaved ...", flush=True)
        results = _launch(cfg, modes, p, transport)
        torch_rows[transport] = results.pop("torch DDP")
        rows.append(("gloo", "torch DDP", {**torch_rows[transport], "reference_for": transport}))
        for label, r in results.items():
            link = "10G" if label.endswith("(10G)") else transport
            rows.append((link, label, {**r, "torch_step_s": torch_rows[transport]["step_s"]}))
    load_after = os.getloadavg()

    grad_bytes = rows[0][2]["grad_bytes"]
    ring_bytes = 2 * (p - 1) / p * grad_bytes
    samples = cfg.batch * p
    by_label = {(t, label): r for t, label, r in rows}
    table = []
    for transport, label, r in rows:
        sent = r.get("bytes_per_step", math.nan)
        bound = math.nan
        if label.startswith("overlap"):
            after_label = label.replace("overlap", "after backward")
            bound = overlap_bound(by_label[(transport, after_label)], r["tail_share"])[0]
            r["bound"] = bound
        table.append(
            [
                label,
                transport,
                r["step_s"] * 1e3,
                samples / r["step_s"],
                r["step_s"] / r.get("torch_step_s", r["step_s"]) if label != "one process" else math.nan,
                r["cpu_s"] * 1e3,
                human_bytes(int(sent)) if sent == sent else "-",
                human_bytes(int(ring_bytes)) if sent == sent else "-",
                r.get("buckets", "-"),
                r.get("backward_ms", math.nan),
                r.get("comm_ms_per_step", math.nan),
                r.get("overlap", math.nan),
                bound,
            ]
        )
    print()
    print_table(
        [
            "DDP",
            "transport",
            "step ms",
            "samples/s",
            "x torch",
            "cpu ms",
            "bytes/step",
            "ring formula",
            "buckets",
            "B backward ms",
            "C allreduce ms",
            "overlap",
            "bound",
        ],
        table,
        title=f"BERT {cfg.model}, {p} ranks x batch {cfg.batch} x seq {cfg.seq}, 1 thread each, "
        f"gradients {human_bytes(grad_bytes)}, median of {cfg.steps} interleaved steps after {cfg.warmup} "
        "(x torch = our step time / torch DDP's in the same launch; cpu ms: all threads, mean of ranks; "
        "B: rank 0's backward span; C: time per step with some bucket in flight; overlap = share of "
        "allreduce time inside backward; bound = the after-backward row's step / (its step - B - C + "
        "max(B + s*C, C)), s = share of the bytes in buckets that launch only after backward (the word "
        "embedding's and later): the most perfect overlap could gain)",
    )
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} ({os.cpu_count()} cores)")
    goals = _goals(by_label, transports, emulated)
    directory = out_dir(out)
    save_json(
        directory,
        f"ddp_{cfg.model}_p{p}_b{cfg.batch}",
        {
            "config": asdict(cfg),
            "load": [load_before, load_after],
            "rows": [
                {"transport": t, "label": label, **{k: v for k, v in r.items() if k != "events"}}
                for t, label, r in rows
            ],
            "goals": goals,
        },
    )
    if plot:
        path = _plot(rows, directory, cfg)
        print(f"timelines saved to {path}")
    return {"rows": rows, "goals": goals}


def _goals(by_label: dict, transports, emulated: bool) -> dict:
    goals = {}
    if ("shm", "overlap") in by_label:
        over = by_label[("shm", "overlap")]
        goals["shm_overlap_over_torch"] = over["step_s"] / over["torch_step_s"]
        verdict = "met" if goals["shm_overlap_over_torch"] <= 0.9 else "NOT met"
        print(
            f"goal: ours on shm with overlap <= 0.9x torch DDP's step time -> "
            f"{goals['shm_overlap_over_torch']:.2f}x ({verdict})"
        )
    if emulated:
        after, over = by_label[("10G", "after backward (10G)")], by_label[("10G", "overlap (10G)")]
        goals["emulated_speedup"] = after["step_s"] / over["step_s"]
        goals["emulated_bound"], goals["emulated_bound_bc"] = overlap_bound(after, over["tail_share"])
        verdict = "met" if goals["emulated_speedup"] >= 1.3 else "NOT met"
        print(
            f"goal: over 10 Gbit/s, overlap >= 1.3x faster than allreduce after backward -> "
            f"{goals['emulated_speedup']:.2f}x ({verdict}); attainable with perfect overlap: "
            f"{goals['emulated_bound']:.2f}x of the step, (B+C)/max(B,C) = {goals['emulated_bound_bc']:.2f}x"
        )
    return goals


def _plot(rows, directory, cfg: DdpBench):
    """Two timelines, one step each: allreduce after backward vs overlap (emulated link if run)."""
    from .. import trace

    labels = [label for _, label, _ in rows]
    pair = ["after backward (10G)", "overlap (10G)"]
    if not all(label in labels for label in pair):
        pair = ["after backward", "overlap"]
    fig, axes = new_figure(2, figsize=(12, 3.5))
    fig.subplots_adjust(wspace=0.3)
    for ax, label in zip(axes, pair):
        result = next(r for _, lab, r in rows if lab == label)
        events = result["events"]
        last_step = {  # each rank's last forward starts its last step
            rank: max(e["ts_us"] for e in events if e["rank"] == rank and e["name"] == "forward")
            for rank in {e["rank"] for e in events}
        }
        shown = [e for e in events if e["ts_us"] >= last_step[e["rank"]]]
        trace.plot_timeline(shown, ax=ax, title=label)
    path = directory / f"ddp_{cfg.model}_timeline.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path

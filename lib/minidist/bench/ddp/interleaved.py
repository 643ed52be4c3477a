"""The interleaved DDP runs behind ``python -m minidist.bench ddp``: every variant in one launch.

Each rank holds every variant (``Mode``: torch's DDP, ours after backward / in buckets / with
overlap, optionally over the emulated 10 Gbit/s link), each with its own model and optimizer,
and ``bench_worker`` takes one step of each per round, a barrier between steps, so load that
drifts during the run slows every variant alike. Per variant: median step and CPU time, bytes
sent per step, and from the DDP's trace its backward span B, the time C with some bucket in
flight and the share of allreduce time inside backward. The table is ``__init__.py``'s.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from ...comm import Communicator


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
    from ...models import bert

    torch.manual_seed(0)
    return bert.BertForMLM(bert.CONFIGS[cfg.model])


def _batches(cfg: DdpBench, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    from ...models import bert

    vocab = bert.CONFIGS[cfg.model].vocab_size
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (cfg.warmup + cfg.steps, rows, cfg.seq), generator=gen)
    labels = torch.full_like(ids, bert.IGNORE_INDEX)
    labels[..., ::7] = ids[..., ::7]
    return ids, labels


class _Variant:
    """One row's model, optimizer and measurements inside a worker."""

    def __init__(self, comm: Communicator, cfg: DdpBench, mode: Mode) -> None:
        from ... import trace
        from ...parallel.ddp import DistributedDataParallel
        from ...transport.emulated import ETHERNET_10G, EmulatedLinkComm

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
        from ... import trace

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

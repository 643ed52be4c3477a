"""The compression ablation of lecture 6: which hook each row sends with, and which optimizer goes with it.

A row is a comm hook plus the optimizer that matches it -- the switch this module holds:

=========================  =====================================  ===========================
row                        comm hook (what is sent)               optimizer, clipping
=========================  =====================================  ===========================
dense                      ``allreduce_average`` (float32)        SGD + momentum, clip average
DGC                        ``DeepGradientCompression``            plain SGD (momentum in the
                                                                  hook), each rank clipped at
                                                                  clip_norm sqrt(N) (the
                                                                  paper's equivalent)
DGC - momentum correction  DGC accumulating g, not the velocity   SGD keeps the momentum
DGC - <component>          DGC with that switch off (``dgc``)     as DGC
bf16                       ``bf16_allreduce``                     SGD + momentum, clip average
sign EF                    ``SignErrorFeedback`` (1 bit + scale)  SGD + momentum, clip average
=========================  =====================================  ===========================

``RowTrainer`` trains one row on this rank through ``DistributedDataParallel`` with one
bucket (``bucket_mb=inf``, allreduced after backward: DGC's clipping norm is then the whole
gradient's, as in the paper); ``formula_bytes`` is what ``traffic`` predicts it sends.
The BERT run over every row is ``minidist.models.bert_compression.compare_hooks``;
``python -m minidist.bench compression`` prints its tables (``minidist.bench.compression``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from ...comm import Communicator
from ..buckets import allreduce_average
from ..ddp import DistributedDataParallel
from ..timed_hook import TimedHook
from . import dgc, traffic
from .baselines import SignErrorFeedback, bf16_allreduce
from .dgc import DeepGradientCompression, DGCConfig


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


def dgc_config(cfg: CompressionBench, row: Row) -> DGCConfig:
    """DGC's configuration for ``row``: the run's sparsity, warm-up, momentum and clipping,
    with the row's overrides (one component switched off)."""
    base = DGCConfig(
        sparsity=cfg.sparsity,
        warmup_stage_steps=cfg.warmup_stage_steps,
        momentum=cfg.momentum,
        clip_norm=cfg.clip_norm,
        seed=cfg.seed,
    )
    return replace(base, **dict(row.dgc))


def make_hook(cfg: CompressionBench, row: Row):
    """The comm hook of ``row`` (a fresh one: DGC and sign EF keep per-bucket state)."""
    if row.hook == "dgc":
        return DeepGradientCompression(dgc_config(cfg, row))
    if row.hook == "bf16":
        return bf16_allreduce
    if row.hook == "sign":
        return SignErrorFeedback()
    return allreduce_average


class RowTrainer:
    """One row's model, DDP, hook and optimizer on this rank; ``step`` trains one step.

    Every row's trainer lives in the same worker and they take their steps in turn
    (row 1 step 0, row 2 step 0, ..., row 1 step 1, ...), so a change in the machine's
    load hits every row alike; the comparison of step times is fair within one run.
    """

    def __init__(
        self,
        comm: Communicator,
        cfg: CompressionBench,
        row: Row,
        final_sparsity: bool,
        make_model: Callable[[], nn.Module],
    ) -> None:
        if final_sparsity and row.hook == "dgc":  # timing run: straight to the final sparsity
            row = replace(row, dgc=(*row.dgc, ("warmup_stage_steps", 0)))
        self.comm, self.cfg, self.row = comm, cfg, row
        in_hook_momentum = row.hook == "dgc" and dgc_config(cfg, row).momentum_correction
        torch.manual_seed(cfg.seed)
        self.model = make_model()  # called as model(ids, labels=labels).loss (BertForMLM)
        # one bucket, after backward: DGC's clipping norm is then the whole gradient's
        self.hook = TimedHook(make_hook(cfg, row))
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


def formula_bytes(cfg: CompressionBench, row: Row, numel: int) -> float:
    """What ``parallel.compression.traffic`` predicts per rank per step after the warm-up."""
    p = cfg.world_size
    if row.hook == "dgc":
        return traffic.sparse_allgather_bytes(dgc.slots_for(numel, cfg.sparsity), p)
    if row.hook == "sign":
        return traffic.sign_allgather_bytes(numel, p)
    return traffic.dense_ring_bytes(numel, p, 2 if row.hook == "bf16" else 4)


__all__ = [
    "ROWS",
    "CompressionBench",
    "Row",
    "RowTrainer",
    "TimedHook",
    "dgc_config",
    "formula_bytes",
    "make_hook",
]

"""Run one stage's list of actions over point-to-point messages: the pipeline on real processes.

``run_pipeline(stage_module, comm, actions, ...)``: rank r is stage r and runs its list from
``schedules`` (checked by ``simulator.check_schedule``) in order. Sends are non-blocking
(``isend``: the bytes are buffered and the stage goes on), receives block until the message
has arrived -- exactly what the checker simulates, so a schedule that passes it runs here.
Every transfer is a 64-byte header (kind, microbatch, chunk, shape) and the tensor itself:
``pp_traffic_formula`` counts those bytes for a 2-stage decoder. ``timeline_of`` turns every
rank's ``PipelineResult`` into the measured ``simulator.Timeline``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ...comm import Communicator
from .schedules import Action
from .simulator import Timeline, _normalise

__all__ = ["PipelineResult", "pp_traffic_formula", "run_pipeline", "timeline_of"]

META_TAG, DATA_TAG = 7301, 7302
_META_LEN = 8  # kind (0 activation, 1 gradient), microbatch, chunk, ndim, shape (up to 4 dims)


@dataclasses.dataclass
class PipelineResult:
    """What ``run_pipeline`` measured on one rank.

    loss: mean over microbatches of loss_fn (last stage only, else None).
    peak_in_flight: the most microbatches (x chunks) whose activations this stage held at once.
    busy_s: seconds spent computing; wall_s: seconds from the start to the last action's end.
    actions: (action, start_s, end_s) per action, in execution order, times from the start
    (the start is after a barrier, so ranks on one machine share it up to the barrier's skew).
    """

    loss: float | None
    peak_in_flight: int
    busy_s: float
    wall_s: float
    actions: list[tuple[Action, float, float]]
    origin_s: float = 0.0  # time.perf_counter() at the start: add it to compare ranks on one machine


class _Mailbox:
    """Receives (meta, payload) pairs from one peer in arrival order, keeps them until asked for.

    Every transfer is two messages: a small int64 header naming (kind, microbatch, chunk, shape)
    and the tensor itself. So a stage may ask for messages in any order its schedule needs;
    the channel itself is first-in first-out.
    """

    def __init__(self, comm: Communicator, peer: int, dtype: torch.dtype) -> None:
        self.comm, self.peer, self.dtype = comm, peer, dtype
        self.kept: dict[tuple[int, int, int], torch.Tensor] = {}

    def get(self, key: tuple[int, int, int]) -> torch.Tensor:
        while key not in self.kept:
            meta = self.comm.recv(torch.zeros(_META_LEN, dtype=torch.int64), self.peer, META_TAG)
            kind, mb, chunk, ndim = (int(x) for x in meta[:4])
            tensor = torch.empty([int(x) for x in meta[4 : 4 + ndim]], dtype=self.dtype)
            self.kept[(kind, mb, chunk)] = self.comm.recv(tensor, self.peer, DATA_TAG)
        return self.kept.pop(key)


def _split(batch, microbatches: int, what: str) -> list:
    if batch is None:
        return [None] * microbatches
    if isinstance(batch, list | tuple):
        if len(batch) != microbatches:
            raise ValueError(f"{what}: {len(batch)} microbatches given, the schedule runs {microbatches}")
        return list(batch)
    if batch.shape[0] % microbatches:
        raise ValueError(
            f"{what}: a batch of {batch.shape[0]} does not split into {microbatches} equal microbatches; "
            "pick a batch size that is a multiple of the number of microbatches"
        )
    return list(batch.chunk(microbatches))


def run_pipeline(
    stage_module: nn.Module | Sequence[nn.Module],
    comm: Communicator,
    actions: Sequence[Sequence],
    inputs=None,
    targets=None,
    loss_fn: Callable | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> PipelineResult:
    """Run this rank's list of actions: rank r is stage r of ``comm.world_size`` stages.

    stage_module: this stage (or, for interleaved schedules, a list with one module per chunk).
    inputs: the first stage's batch (a tensor split into m microbatches along dim 0, or a list).
    targets, loss_fn: the last stage's; ``loss_fn(output, target)`` returns a mean loss.

    Forward of microbatch i: take the input (from ``inputs`` or from the previous stage),
    run the module, keep (input, output) for the backward, send the output on (isend).
    On the last stage the output goes into loss_fn; the loss is divided by m so the gradients
    accumulated over the m backwards equal those of the mean loss over the whole batch.
    Backward of microbatch i: take the output gradient from the next stage (or the scaled loss
    on the last), ``torch.autograd.backward``, send the input's gradient to the previous stage.
    Gradients accumulate in ``.grad`` (zero them before; a tied weight held by two stages
    needs its two gradients summed afterwards: see ``minidist.models.stages``).
    """
    rank, p = comm.rank, comm.world_size
    chunk_modules = (
        list(stage_module) if isinstance(stage_module, list | tuple | nn.ModuleList) else [stage_module]
    )
    _, v, (sched,) = _normalise([actions])
    if len(chunk_modules) != v and not (v == 1 and len(chunk_modules) >= 1):
        raise ValueError(
            f"the actions use {v} chunks, stage_module has {len(chunk_modules)}: pass one module per chunk"
        )
    v = len(chunk_modules)
    m = 1 + max(a[1] for a in sched)
    last_virtual = p * v - 1
    if loss_fn is None and rank == last_virtual % p:
        raise ValueError("the last stage needs loss_fn(output, target)")
    dtype = dtype or torch.get_default_dtype()
    micro_in = _split(inputs, m, "inputs")
    micro_tg = _split(targets, m, "targets")
    mailboxes = {
        peer: _Mailbox(comm, peer, dtype) for peer in ((rank - 1) % p, (rank + 1) % p) if peer != rank
    }
    local: dict[tuple[int, int, int], torch.Tensor] = {}  # messages to ourselves (p = 1, interleaved)
    pending = []

    # A message's key is (0 activation / 1 gradient, microbatch, the RECEIVER's chunk).
    def send(tensor: torch.Tensor, peer: int, key: tuple[int, int, int]) -> None:
        tensor = tensor.detach().contiguous()
        if peer == rank:
            local[key] = tensor
            return
        meta = torch.zeros(_META_LEN, dtype=torch.int64)
        meta[:4] = torch.tensor([*key, tensor.dim()])
        meta[4 : 4 + tensor.dim()] = torch.tensor(tensor.shape)
        pending.append(comm.isend(meta, peer, META_TAG))
        pending.append(comm.isend(tensor, peer, DATA_TAG))

    def receive(peer: int, key: tuple[int, int, int]) -> torch.Tensor:
        return local.pop(key) if peer == rank else mailboxes[peer].get(key)

    saved: dict[tuple[int, int], tuple] = {}
    losses, peak, busy, record = [], 0, 0.0, []
    comm.barrier()
    t0 = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every process on a machine
    for kind, mb, chunk in sched:
        s = chunk * p + rank  # virtual stage
        if kind == "F":
            if s == 0:
                x = micro_in[mb]
                if x is None:
                    raise ValueError("the first stage needs inputs")
            else:
                x = receive((s - 1) % p, (0, mb, chunk)).requires_grad_(True)
            start = time.perf_counter()
            out = chunk_modules[chunk](x)
            if s == last_virtual:
                loss = loss_fn(out, micro_tg[mb])
                losses.append(loss.detach())
                out = loss / m
            end = time.perf_counter()
            if s != last_virtual:  # sent after the clock stops: a receiver never starts before our end
                send(out, (s + 1) % p, (0, mb, (s + 1) // p))
            saved[(mb, chunk)] = (x, out)
            peak = max(peak, len(saved))
        else:
            if (mb, chunk) not in saved:
                raise RuntimeError(
                    f"stage {rank}: B{mb} (chunk {chunk}) before its forward; check_schedule the schedule"
                )
            grad = None if s == last_virtual else receive((s + 1) % p, (1, mb, chunk))
            start = time.perf_counter()
            x, out = saved.pop((mb, chunk))
            torch.autograd.backward(out, grad)
            end = time.perf_counter()
            if s > 0:
                send(x.grad, (s - 1) % p, (1, mb, (s - 1) // p))
        busy += end - start
        record.append(((kind, mb, chunk) if v > 1 else (kind, mb), start - t0, end - t0))
    wall = time.perf_counter() - t0
    for work in pending:
        work.wait()
    loss = float(torch.stack(losses).mean()) if losses else None
    return PipelineResult(loss, peak, busy, wall, record, t0)


def timeline_of(results: Sequence[PipelineResult]) -> Timeline:
    """The measured ``Timeline`` of a run, from every rank's ``PipelineResult`` (ranks on one machine).

    Feed it to ``plot_timeline`` or ``draw_ascii``; its ``bubble_fraction`` is the measured bubble.
    """
    rows = [[(a, r.origin_s + s, r.origin_s + e) for a, s, e in r.actions] for r in results]
    chunks = 1 + max((a[2] for row in rows for a, _, _ in row if len(a) == 3), default=0)
    return Timeline(rows, chunks)


def pp_traffic_formula(cfg, batch: int, seq: int, microbatches: int, dtype_bytes: int = 4) -> float:
    """PP with 2 stages per step, bytes per rank: stage 0 sends each microbatch's activations
    (b/m, s, d) forward, stage 1 sends their gradients back (same size), each with a 64-byte
    header (8 int64: kind, microbatch, chunk, shape); then the two copies of the tied word
    table swap gradients (V d each way, ``stages.sync_tied_gradients``).

    ``cfg``: the decoder's ``TransformerConfig`` (its ``hidden_size`` and ``vocab_size``)."""
    act = batch // microbatches * seq * cfg.hidden_size * dtype_bytes
    return microbatches * (act + 64) + cfg.vocab_size * cfg.hidden_size * dtype_bytes

"""Pipeline parallelism: schedules as data, a checker, a simulator, and an executor over send/recv.

A model cut into p consecutive *stages* runs one stage per rank. A batch is cut into m
*microbatches*; stage r computes the forward of microbatch i (``("F", i)``), sends the
activations to stage r + 1, and later, when the gradient comes back from stage r + 1, computes
the backward (``("B", i)``) and sends the input gradient to stage r - 1.

A *schedule* is plain data: one list per stage of the actions that stage runs, in order.

GPipe (Huang et al. 2019): all forwards, then all backwards. Every stage holds the activations
of all m microbatches at the peak. With t_F = 1, t_B = 2, p = 4, m = 4 (``draw_ascii``)::

    stage 0 |F0 F1 F2 F3 .  .  .  .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3
    stage 1 |.  F0 F1 F2 F3 .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3 .  .
    stage 2 |.  .  F0 F1 F2 F3 .  .  .  B0 B0 B1 B1 B2 B2 B3 B3 .  .  .  .
    stage 3 |.  .  .  F0 F1 F2 F3 B0 B0 B1 B1 B2 B2 B3 B3 .  .  .  .  .  .

1F1B (PipeDream-flush, Narayanan et al. 2021): stage r first runs p - 1 - r forwards
(warm-up), then alternates one forward and one backward (steady state), then drains the
remaining backwards (cool-down). Same length, so the same bubble as GPipe, but stage r never
holds more than p - r microbatches: activation memory no longer grows with m::

    stage 0 |F0 F1 F2 F3 .  .  .  .  .  .  B0 B0 .  B1 B1 .  B2 B2 .  B3 B3
    stage 1 |.  F0 F1 F2 .  .  .  .  B0 B0 F3 B1 B1 .  B2 B2 .  B3 B3 .  .
    stage 2 |.  .  F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3 .  .  .  .
    stage 3 |.  .  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .  .  .  .  .  .

The *bubble* is the idle share of p stages x makespan. With balanced stages both schedules
give ``(p - 1) / (m + p - 1)`` (``bubble_formula``): p - 1 forward and p - 1 backward slots of
fill and drain against m forward+backward slots of work. Interleaved 1F1B gives each rank v
model *chunks* (rank r holds virtual stages r, r + p, r + 2p, ...); each chunk costs 1/v of a
stage, so the fill and drain shrink v times: ``(p - 1) / (v m + p - 1)`` (the paper writes the
bubble-to-work ratio, (p - 1) / (v m)).

The executor (``run_pipeline``) runs one stage's list over point-to-point messages. Sends are
non-blocking (``isend``: the bytes are buffered and the stage goes on), receives block until
the message has arrived. ``check_schedule`` simulates exactly that and refuses a schedule that
would deadlock, so a schedule that passes the checker runs. (With sends that wait for their
receiver, plain 1F1B would deadlock at once for p = 2: stage 0 sends F1 while stage 1 sends
the gradient of B0, each waiting for the other to receive; Megatron pairs such a send and
receive in one batched call.)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..comm import Communicator

__all__ = [
    "ScheduleError",
    "gpipe",
    "one_f_one_b",
    "interleaved_one_f_one_b",
    "check_schedule",
    "simulate",
    "Timeline",
    "bubble_formula",
    "peak_in_flight",
    "draw_ascii",
    "plot_timeline",
    "run_pipeline",
    "PipelineResult",
    "measure_bubble",
    "timeline_of",
    "SleepStage",
]

Action = tuple  # ("F", mb) or ("B", mb); interleaved: ("F", mb, chunk)


class ScheduleError(ValueError):
    """A schedule misses an action, repeats one, breaks a dependency or deadlocks."""


def _check_sizes(stages: int, microbatches: int, chunks: int = 1) -> None:
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise ValueError(
            f"stages ({stages}), microbatches ({microbatches}) and chunks ({chunks}) must be >= 1"
        )


# --- schedules ------------------------------------------------------------------------------


def gpipe(stages: int, microbatches: int) -> list[list[Action]]:
    """GPipe: every stage runs F0 .. F(m-1), then B0 .. B(m-1)."""
    _check_sizes(stages, microbatches)
    order = [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
    return [list(order) for _ in range(stages)]


def one_f_one_b(stages: int, microbatches: int) -> list[list[Action]]:
    """1F1B: on stage r, min(p - 1 - r, m) warm-up forwards, then F/B pairs, then the last backwards.

    Stage r, p = 4, m = 6:   r=0: F0 F1 F2 | F3 B0 F4 B1 F5 B2 | B3 B4 B5
                             r=3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5
    """
    _check_sizes(stages, microbatches)
    schedule = []
    for r in range(stages):
        warmup = min(stages - 1 - r, microbatches)
        actions: list[Action] = [("F", i) for i in range(warmup)]
        for i in range(microbatches - warmup):  # steady state: one forward, one backward
            actions += [("F", warmup + i), ("B", i)]
        actions += [("B", i) for i in range(microbatches - warmup, microbatches)]  # cool-down
        schedule.append(actions)
    return schedule


def interleaved_one_f_one_b(stages: int, microbatches: int, chunks: int) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2): rank r holds chunks c = 0..v-1.

    Chunk c of rank r is virtual stage c * p + r. Forwards go through microbatches in groups of
    p: the k-th forward of a rank is on chunk (k // p) % v, microbatch (k // (p v)) * p + k % p;
    the k-th backward walks the chunks in reverse. Rank r first runs (p - 1 - r) * 2 + (v - 1) * p
    forwards (capped at m v), then alternates, then drains. Needs m to be a multiple of p.
    """
    _check_sizes(stages, microbatches, chunks)
    p, m, v = stages, microbatches, chunks
    if v == 1:
        return [[(kind, mb, 0) for kind, mb in actions] for actions in one_f_one_b(p, m)]
    if m % p:
        raise ValueError(
            f"interleaved 1F1B takes microbatches in groups of the {p} stages: {m} microbatches is "
            f"not a multiple of {p}; use {m - m % p or p} or {m - m % p + p}"
        )
    total = m * v

    def forward(k: int) -> Action:
        return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def backward(k: int) -> Action:
        return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    schedule = []
    for r in range(p):
        warmup = min((p - 1 - r) * 2 + (v - 1) * p, total)
        actions = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [forward(warmup + k), backward(k)]
        actions += [backward(k) for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule


# --- dependencies, checker, simulator ----------------------------------------------------------


def _normalise(schedule: Sequence[Sequence[Sequence]]) -> tuple[int, int, list[list[Action]]]:
    """(stages, chunks, schedule with every action as (kind, mb, chunk))."""
    out = []
    for r, actions in enumerate(schedule):
        row = []
        for a in actions:
            if len(a) not in (2, 3) or a[0] not in ("F", "B"):
                raise ScheduleError(f"stage {r}: action {a!r} is not ('F' or 'B', microbatch[, chunk])")
            row.append((a[0], int(a[1]), int(a[2]) if len(a) == 3 else 0))
        out.append(row)
    chunks = 1 + max((a[2] for row in out for a in row), default=0)
    return len(out), chunks, out


def _dependencies(action: Action, stage: int, p: int, v: int) -> list[tuple[int, Action]]:
    """The (stage, action) pairs that must finish before ``action`` on ``stage`` may start.

    Virtual stage s = chunk * p + stage. F on s needs F on s - 1 (its input); B on s needs
    B on s + 1 (its output gradient) and F on s (its saved activations).
    """
    kind, mb, chunk = action
    s = chunk * p + stage
    if kind == "F":
        return [] if s == 0 else [((s - 1) % p, ("F", mb, (s - 1) // p))]
    deps = [(stage, ("F", mb, chunk))]
    if s < p * v - 1:
        deps.append(((s + 1) % p, ("B", mb, (s + 1) // p)))
    return deps


def _name(action: Action, v: int) -> str:
    kind, mb, chunk = (*action, 0)[:3]
    return f"{kind}{mb}" + (f".{chunk}" if v > 1 else "")


def _run_order(schedule, t_forward: float, t_backward: float, check: bool, microbatches: int | None):
    """Execute every stage's list in order (receives block, sends do not); return start/end times.

    Each action starts when its stage is free and its dependencies have finished; a stage whose
    next action waits on something that never happens is a deadlock, reported by name.
    """
    p, v, sched = _normalise(schedule)
    if not p:
        raise ScheduleError("the schedule has no stages: pass one list of actions per stage")
    if check:
        m = microbatches
        for r, actions in enumerate(sched):
            seen = set()
            for a in actions:
                if a in seen:
                    raise ScheduleError(f"stage {r}: {_name(a, v)} appears twice")
                if not 0 <= a[1] < m:
                    raise ScheduleError(
                        f"stage {r}: {_name(a, v)} names microbatch {a[1]}, not in 0..{m - 1}"
                    )
                seen.add(a)
            for kind in ("F", "B"):
                for c in range(v):
                    for mb in range(m):
                        if (kind, mb, c) not in seen:
                            raise ScheduleError(f"stage {r}: {_name((kind, mb, c), v)} is missing")
        for r, actions in enumerate(sched):
            done_here = set()
            for a in actions:
                if a[0] == "B" and ("F", a[1], a[2]) not in done_here:
                    raise ScheduleError(f"stage {r}: {_name(a, v)} comes before its own forward")
                done_here.add(a)
    durations = {"F": t_forward / v, "B": t_backward / v}
    end: dict[tuple[int, Action], float] = {}
    starts: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    position = [0] * p
    free = [0.0] * p
    remaining = sum(len(a) for a in sched)
    while remaining:
        progressed = False
        for r in range(p):
            while position[r] < len(sched[r]):
                a = sched[r][position[r]]
                deps = _dependencies(a, r, p, v)
                if any(d not in end for d in deps):
                    break
                start = max([free[r]] + [end[d] for d in deps])
                finish = start + durations[a[0]]
                end[(r, a)] = finish
                free[r] = finish
                starts[r].append((schedule[r][position[r]], start, finish))  # the caller's action
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = []
            for r in range(p):
                if position[r] < len(sched[r]):
                    a = sched[r][position[r]]
                    missing = [
                        f"{_name(d, v)} on stage {s}"
                        for s, d in _dependencies(a, r, p, v)
                        if (s, d) not in end
                    ]
                    stuck.append(f"stage {r} waits in {_name(a, v)} for {', '.join(missing)}")
            raise ScheduleError("deadlock: " + "; ".join(stuck))
    return p, v, starts


def check_schedule(schedule: Sequence[Sequence[Sequence]], microbatches: int) -> None:
    """Raise ``ScheduleError`` naming the first violation, else return None.

    Checks, in this order: every stage runs each (F, mb[, chunk]) and (B, mb[, chunk]) exactly
    once; no backward before its own forward on the same stage; and that executing each
    stage's list in order, with blocking receives and buffered sends, finishes (a forward on
    stage s waits for the forward on s - 1, a backward for the backward on s + 1). Any
    schedule that passes also respects the cross-stage orders, since it ran.
    """
    _run_order(schedule, 1.0, 2.0, check=True, microbatches=microbatches)


@dataclasses.dataclass
class Timeline:
    """Per stage, the (action, start, end) of every action, in execution order."""

    stages: list[list[tuple[Action, float, float]]]
    chunks: int = 1

    @property
    def makespan(self) -> float:
        return max(end for row in self.stages for _, _, end in row) - min(
            start for row in self.stages for _, start, _ in row
        )

    @property
    def busy(self) -> list[float]:
        return [sum(end - start for _, start, end in row) for row in self.stages]

    @property
    def bubble_fraction(self) -> float:
        """Idle stage-time / (stages x makespan)."""
        return 1.0 - sum(self.busy) / (len(self.stages) * self.makespan)


def simulate(schedule, t_forward: float = 1.0, t_backward: float = 2.0) -> Timeline:
    """Run the schedule on an ideal machine (no communication time); each chunk costs t / chunks."""
    _, v, starts = _run_order(schedule, t_forward, t_backward, check=False, microbatches=None)
    return Timeline(starts, v)


def bubble_formula(stages: int, microbatches: int, chunks: int = 1) -> float:
    """(p - 1) / (v m + p - 1): GPipe and 1F1B with v = 1; interleaved 1F1B with v chunks per rank."""
    _check_sizes(stages, microbatches, chunks)
    return (stages - 1) / (chunks * microbatches + stages - 1)


def peak_in_flight(schedule) -> list[int]:
    """Per stage, the most (microbatch, chunk) activations held at once: +1 at F, -1 at B.

    GPipe: m on every stage. 1F1B: p - r on stage r (at most p), when m >= p.
    """
    peaks = []
    for actions in schedule:
        held = peak = 0
        for a in actions:
            held += 1 if a[0] == "F" else -1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


# --- drawings -----------------------------------------------------------------------------------


def draw_ascii(schedule_or_timeline, t_forward: float = 1.0, t_backward: float = 2.0) -> str:
    """A text timeline, one row per stage, one column per time unit; '.' is idle.

    A schedule is first simulated with ``t_forward`` / ``t_backward``. A backward of 2 units
    prints its label twice.
    """
    tl = (
        schedule_or_timeline
        if isinstance(schedule_or_timeline, Timeline)
        else simulate(schedule_or_timeline, t_forward, t_backward)
    )
    rows = [row for row in tl.stages]
    t0 = min(s for row in rows for _, s, _ in row)
    unit = min(e - s for row in rows for _, s, e in row)
    width = max(len(_name(a, tl.chunks)) for row in rows for a, _, _ in row)
    n_cols = round(tl.makespan / unit)
    lines = []
    for r, row in enumerate(rows):
        cells = ["." * 1] * n_cols
        for a, s, e in row:
            first, last = round((s - t0) / unit), round((e - t0) / unit)
            for c in range(first, max(last, first + 1)):
                if c < n_cols:
                    cells[c] = _name(a, tl.chunks)
        lines.append(f"stage {r} |" + " ".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(lines)


def plot_timeline(tl: Timeline, ax=None, title: str | None = None):
    """Draw a Timeline as bars (forwards light, backwards dark), one row per stage; returns ax."""
    import matplotlib.pyplot as plt  # lazily: the library works without matplotlib

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 + 0.5 * len(tl.stages)))
    t0 = min(s for row in tl.stages for _, s, _ in row)
    for r, row in enumerate(tl.stages):
        for a, s, e in row:
            color = "#9ecae1" if a[0] == "F" else "#3182bd"
            ax.broken_barh(
                [(s - t0, e - s)], (r - 0.4, 0.8), facecolors=color, edgecolors="black", linewidth=0.5
            )
            ax.text(s - t0 + (e - s) / 2, r, _name(a, tl.chunks), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(tl.stages)), [f"stage {r}" for r in range(len(tl.stages))])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    bubble = f"bubble {tl.bubble_fraction:.1%}"
    ax.set_title(f"{title}: {bubble}" if title else bubble)
    return ax


# --- the executor -------------------------------------------------------------------------------

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


# --- a measured bubble with sleep-timed stages --------------------------------------------------


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t_forward, t_backward):
        ctx.t_backward = t_backward
        time.sleep(t_forward)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.t_backward)
        return grad, None, None


class SleepStage(nn.Module):
    """A stage whose work is ``time.sleep``: t_forward in forward, t_backward in backward.

    Sleeping takes no CPU, so p stages show their schedule's timing on a 2-core machine.
    """

    def __init__(self, t_forward: float, t_backward: float) -> None:
        super().__init__()
        self.t_forward, self.t_backward = t_forward, t_backward
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.scale, self.t_forward, self.t_backward)


def _bubble_worker(comm: Communicator, schedule, t_forward: float, t_backward: float, chunks: int):
    modules = [SleepStage(t_forward / chunks, t_backward / chunks) for _ in range(chunks)]
    m = 1 + max(a[1] for a in schedule[comm.rank])
    inputs = torch.zeros(m, 4) if comm.rank == 0 else None
    targets = torch.zeros(m, 4) if comm.rank == comm.world_size - 1 else None
    for _ in range(2):  # the first step pays one-time costs (autograd's first backward): measure the second
        out = run_pipeline(
            modules if chunks > 1 else modules[0],
            comm,
            schedule[comm.rank],
            inputs=inputs,
            targets=targets,
            loss_fn=lambda y, t: ((y - t) ** 2).mean(),
        )
    return out


def measure_bubble(
    stages: int,
    microbatches: int,
    schedule_fn: Callable = one_f_one_b,
    t_forward: float = 0.02,
    t_backward: float = 0.04,
    *,
    chunks: int = 1,
    transport: str = "shm",
    timeout: float = 120.0,
) -> dict:
    """Launch ``stages`` ranks running sleep-timed stages under a schedule; return the measured bubble.

    Returns a dict: ``measured`` (1 - busy / (p x makespan), from the recorded action times),
    ``formula`` (``bubble_formula``), ``simulated`` (``simulate``), ``wall_s`` (the makespan),
    ``timeline`` (the measured ``Timeline``, for ``plot_timeline``) and the per-rank results.
    Runs the step twice and measures the second (the first pays one-time costs).
    Cost: about 2 (m + p - 1) (t_forward + t_backward) seconds plus the launch (~1-2 s).
    """
    from minidist.launch import launch  # lazily: launching is not the schedules' concern

    schedule = schedule_fn(stages, microbatches, chunks) if chunks > 1 else schedule_fn(stages, microbatches)
    outs = launch(
        _bubble_worker,
        stages,
        args=(schedule, t_forward, t_backward, chunks),
        transport=transport,
        timeout=timeout,
    )
    measured = timeline_of(outs)  # one clock (perf_counter) for every rank on this machine
    return {
        "measured": measured.bubble_fraction,
        "formula": bubble_formula(stages, microbatches, chunks),
        "simulated": simulate(schedule, t_forward, t_backward).bubble_fraction,
        "wall_s": measured.makespan,
        "timeline": measured,
        "results": outs,
    }

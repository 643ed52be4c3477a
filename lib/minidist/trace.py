"""Traces: what each rank was doing, and when -- spans, messages, a timeline.

A ``Recorder`` belongs to one rank. It stores *events*, plain dicts that pickle,
so a worker can return them from ``md.launch`` and the notebook can put the
ranks side by side::

    def worker(comm):
        rec = trace.Recorder(rank=comm.rank)
        trace.attach(comm, rec)                       # every send/recv becomes a "message" event
        with rec.span("forward"): ...
        with rec.span("backward"):
            token = rec.begin("allreduce", cat="comm")  # an async span: may end on another thread
            ...
        rec.end(token)
        return rec.events

    events = sum(md.launch(worker, 2), [])
    trace.export_chrome("trace.json", events)         # open in https://ui.perfetto.dev
    trace.plot_timeline(events)                       # or look at it in the notebook
    trace.overlap(events)                             # how much communication hid under backward

An event is ``{"name", "cat", "rank", "tid", "ts_us", "dur_us", "args"}``:
``cat`` is "compute", "comm", "message" or "optimizer"; ``ts_us`` is the start in
microseconds of ``time.perf_counter_ns`` -- on Linux a system-wide monotonic clock,
so the events of ranks on one machine line up without any clock synchronisation
(``Recorder.t0`` is kept for printing times relative to the recorder's start);
``tid`` numbers the threads of one recorder in the order they first recorded (0 is
the thread that made the recorder) and ``args["thread"]`` is the thread's name.

Layer 0: this module imports nothing from minidist (communicators are duck-typed),
so every layer may record into it.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator

from .comm import Communicator

CATEGORIES = ("compute", "comm", "message", "optimizer")
COLOURS = {"compute": "tab:blue", "comm": "tab:orange", "message": "tab:green", "optimizer": "tab:purple"}
_WRAPPED = ("send", "recv", "isend", "irecv")
_ORIGINALS = "_trace_originals"  # where attach keeps a communicator's own methods


class Recorder:
    """Collects one rank's events. Thread-safe: spans may be recorded from any thread."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.events: list[dict] = []
        self.t0 = time.perf_counter_ns()
        self._lock = threading.Lock()
        self._tids: dict[int, int] = {threading.get_ident(): 0}

    def _tid(self) -> int:
        ident = threading.get_ident()
        tid = self._tids.get(ident)
        if tid is None:
            with self._lock:
                tid = self._tids.setdefault(ident, len(self._tids))
        return tid

    def _add(self, name: str, cat: str, t_start_ns: int, t_end_ns: int, tid: int, thread: str, args) -> dict:
        _check_category(cat)
        event = {
            "name": name,
            "cat": cat,
            "rank": self.rank,
            "tid": tid,
            "ts_us": t_start_ns / 1000,
            "dur_us": max(t_end_ns - t_start_ns, 0) / 1000,
            "args": {**args, "thread": thread},
        }
        with self._lock:
            self.events.append(event)
        return event

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "compute", **args) -> Iterator[None]:
        """Record the time spent in the ``with`` block as one event of this thread."""
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self._add(name, cat, start, time.perf_counter_ns(), self._tid(), _thread_name(), args)

    def begin(self, name: str, cat: str = "comm", **args) -> dict:
        """Start a span that another thread (or a later call) ends with ``end(token)``.

        The event belongs to the thread that called ``begin`` (where the work was issued).
        """
        _check_category(cat)
        return {
            "name": name,
            "cat": cat,
            "args": args,
            "start": time.perf_counter_ns(),
            "tid": self._tid(),
            "thread": _thread_name(),
        }

    def end(self, token: dict, **args) -> dict:
        """Finish a span started by ``begin``; extra ``args`` are added to its event."""
        if token.get("ended"):
            raise ValueError(f"span {token['name']!r} was already ended: call end() once per begin()")
        token["ended"] = True
        return self._add(
            token["name"],
            token["cat"],
            token["start"],
            time.perf_counter_ns(),
            token["tid"],
            token["thread"],
            {**token["args"], **args},
        )

    def message(
        self, peer: int, nbytes: int, direction: str, t_start_ns: int, t_end_ns: int, tag: int = 0
    ) -> dict:
        """Record one point-to-point message (``direction`` "send" or "recv") of this thread."""
        return self._message(peer, nbytes, direction, t_start_ns, t_end_ns, tag, self._tid(), _thread_name())

    def _message(self, peer, nbytes, direction, t_start_ns, t_end_ns, tag, tid, thread) -> dict:
        if direction not in ("send", "recv"):
            raise ValueError(f"direction must be 'send' or 'recv', got {direction!r}")
        name = f"{direction} {nbytes} B {'to' if direction == 'send' else 'from'} rank {peer}"
        args = {"peer": peer, "bytes": nbytes, "direction": direction, "tag": tag}
        return self._add(name, "message", t_start_ns, t_end_ns, tid, thread, args)

    def relative_ms(self, event: dict) -> float:
        """An event's start in milliseconds after this recorder was made."""
        return event["ts_us"] / 1000 - self.t0 / 1e6


def _check_category(cat: str) -> None:
    if cat not in CATEGORIES:
        raise ValueError(f"unknown event category {cat!r}; use one of {CATEGORIES}")


def _thread_name() -> str:
    return threading.current_thread().name


# --- recording a communicator's messages ---------------------------------------------------
def attach(comm: Communicator, recorder: Recorder) -> None:
    """Record every point-to-point message of ``comm`` (send, recv, isend, irecv) into ``recorder``.

    Wraps the four methods *of this instance* (the class is untouched, so other
    communicators are not affected, and properties such as ``shared_workspace``
    keep working -- the shm fast-path allreduce sends no messages, so it shows up
    only as the comm span its caller records). An isend/irecv event lasts from the
    call until the transport finishes it (``Work.add_done_callback``), not until
    someone waits. A recv's event includes the time spent waiting for the sender.
    Nested calls (a transport's isend that calls its own send) are recorded once.
    Messages of ``comm.barrier()`` are not point-to-point calls and are not recorded.
    ``detach(comm)`` undoes it.
    """
    if _ORIGINALS in vars(comm):
        raise ValueError("this communicator is already attached to a recorder: call trace.detach(comm) first")
    originals = {name: getattr(comm, name) for name in _WRAPPED}
    inside = threading.local()  # set while this thread is in a recorded call

    def blocking(name: str, direction: str):
        original = originals[name]

        def call(tensor, *args, **kwargs):
            if getattr(inside, "active", False):
                return original(tensor, *args, **kwargs)
            inside.active = True
            start = time.perf_counter_ns()
            try:
                result = original(tensor, *args, **kwargs)
            finally:
                inside.active = False
            peer, tag = _peer_and_tag(args, kwargs)
            recorder.message(peer, _nbytes(tensor), direction, start, time.perf_counter_ns(), tag)
            return result

        return call

    def nonblocking(name: str, direction: str):
        original = originals[name]

        def call(tensor, *args, **kwargs):
            if getattr(inside, "active", False):
                return original(tensor, *args, **kwargs)
            inside.active = True
            start = time.perf_counter_ns()
            try:
                work = original(tensor, *args, **kwargs)
            finally:
                inside.active = False
            peer, tag = _peer_and_tag(args, kwargs)
            tid, thread = recorder._tid(), _thread_name()  # the issuing thread owns the event

            def finished(_work) -> None:
                end = time.perf_counter_ns()
                recorder._message(peer, _nbytes(tensor), direction, start, end, tag, tid, thread)

            add_callback = getattr(work, "add_done_callback", None)
            if add_callback is not None:
                add_callback(finished)
            else:  # a handle without callbacks: the event ends when wait() returns
                wait = work.wait

                def wait_and_record(*args, **kwargs):
                    result = wait(*args, **kwargs)
                    finished(work)
                    return result

                work.wait = wait_and_record
            return work

        return call

    setattr(comm, _ORIGINALS, originals)
    comm.send = blocking("send", "send")
    comm.recv = blocking("recv", "recv")
    comm.isend = nonblocking("isend", "send")
    comm.irecv = nonblocking("irecv", "recv")


def detach(comm: Communicator) -> None:
    """Stop recording ``comm``'s messages (undo ``attach``)."""
    originals = vars(comm).pop(_ORIGINALS, None)
    if originals is None:
        raise ValueError("this communicator is not attached to a recorder")
    for name in _WRAPPED:
        vars(comm).pop(name, None)  # the class' method shows again


def _peer_and_tag(args: tuple, kwargs: dict) -> tuple[int, int]:
    """(peer, tag) of a ``send(t, dst, tag)`` / ``recv(t, src, tag)`` call, positional or keyword."""
    peer = args[0] if args else kwargs.get("dst", kwargs.get("src"))
    tag = args[1] if len(args) > 1 else kwargs.get("tag", 0)
    return peer, tag


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


# --- Chrome / Perfetto export ----------------------------------------------------------
def _lanes(events: list[dict]) -> list[tuple[dict, int]]:
    """Give each event of one (rank, tid) a lane in which spans nest properly.

    A Chrome "X" event must nest inside or follow the events before it on the
    same thread; an async comm span that starts in forward and ends in backward
    does neither, so it goes to the next lane that fits (shown as "main (2)" etc.).
    """
    stacks: list[list[float]] = []  # per lane: end times of the open spans
    placed = []
    for event in sorted(events, key=lambda e: (e["ts_us"], -e["dur_us"])):
        start, end = event["ts_us"], event["ts_us"] + event["dur_us"]
        for lane, stack in enumerate(stacks):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                placed.append((event, lane))
                break
        else:
            stacks.append([end])
            placed.append((event, len(stacks) - 1))
    return placed


def chrome_trace(events: list[dict]) -> dict:
    """The Chrome trace-event JSON object for ``events`` (see ``export_chrome``)."""
    trace_events: list[dict] = []
    origin = min((e["ts_us"] for e in events), default=0.0)
    by_thread: dict[tuple[int, int], list[dict]] = {}
    for event in events:
        missing = {"name", "cat", "rank", "tid", "ts_us", "dur_us"} - event.keys()
        if missing:
            raise ValueError(f"not a trace event (missing {sorted(missing)}): {event!r}")
        by_thread.setdefault((event["rank"], event["tid"]), []).append(event)
    for rank in sorted({rank for rank, _ in by_thread}):
        trace_events.append(
            {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}
        )
        trace_events.append(
            {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}
        )
    for (rank, tid), thread_events in sorted(by_thread.items()):
        thread = thread_events[0].get("args", {}).get("thread", f"thread {tid}")
        named = set()
        for event, lane in _lanes(thread_events):
            chrome_tid = tid * 100 + lane
            if chrome_tid not in named:
                named.add(chrome_tid)
                label = thread if lane == 0 else f"{thread} ({lane + 1})"
                trace_events.append(
                    {
                        "ph": "M",
                        "name": "thread_name",
                        "pid": rank,
                        "tid": chrome_tid,
                        "args": {"name": label},
                    }
                )
            trace_events.append(
                {
                    "ph": "X",
                    "name": event["name"],
                    "cat": event["cat"],
                    "pid": rank,
                    "tid": chrome_tid,
                    "ts": event["ts_us"] - origin,
                    "dur": event["dur_us"],
                    "args": event.get("args", {}),
                }
            )
    return {"traceEvents": trace_events, "displayTimeUnit": "ms"}


def export_chrome(path, events: list[dict]) -> None:
    """Write ``events`` (of any number of ranks) as Chrome trace-event JSON.

    One process track per rank (``pid`` = rank, named "rank r"), one thread track
    per recording thread; times start at the earliest event. Open the file at
    https://ui.perfetto.dev ("Open trace file") or chrome://tracing ("Load").
    """
    with open(path, "w") as file:
        json.dump(chrome_trace(list(events)), file)


# --- a timeline in the notebook --------------------------------------------------------
def plot_timeline(events: list[dict], ax=None, title: str | None = None):
    """Draw a row per rank: compute (and optimizer) spans on top, comm spans under them and
    messages as a thin strip at the bottom, so overlap shows as bars stacked over each
    other. Times in ms from the earliest event. Returns the Axes."""
    import matplotlib.pyplot as plt  # lazily: the library must not need matplotlib

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1 + 0.8 * len({e["rank"] for e in events})))
    origin = min((e["ts_us"] for e in events), default=0.0)
    ranks = sorted({e["rank"] for e in events})
    # (y offset from the row's centre, bar height): compute above, comm below, messages a thin strip
    placement = {  # y axis inverted: the lowest offset is drawn on top
        "compute": (-0.42, 0.3),
        "optimizer": (-0.42, 0.3),
        "comm": (-0.08, 0.26),
        "message": (0.22, 0.18),
    }
    labelled = set()
    for row, rank in enumerate(ranks):
        for cat in CATEGORIES:
            bars = [
                ((e["ts_us"] - origin) / 1000, e["dur_us"] / 1000)
                for e in events
                if e["rank"] == rank and e["cat"] == cat
            ]
            if bars:
                offset, height = placement[cat]
                label = None if cat in labelled else cat
                labelled.add(cat)
                ax.broken_barh(bars, (row + offset, height), color=COLOURS[cat], alpha=0.8, label=label)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(-0.6, len(ranks) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    if title:
        ax.set_title(title)
    if labelled:
        ax.legend(loc="upper right", fontsize="small")
    return ax


# --- how much communication hid under backward ------------------------------------------
def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def overlap(events: list[dict], rank: int | None = None, inside: str = "backward") -> float:
    """The share of communication time that lies inside ``inside`` ("backward") spans.

    For every comm span (``cat == "comm"``) of a rank, the part of it that
    intersects that rank's spans named ``inside`` counts as hidden. The result is
    hidden time / comm time, summed over comm spans (two comm spans in flight at
    once both count) and over ranks (``rank=None``) or for one rank. 1.0: all
    communication ran while backward was computing; 0.0: none did.
    """
    ranks = sorted({e["rank"] for e in events}) if rank is None else [rank]
    hidden = total = 0.0
    for r in ranks:
        cover = _merged(
            [(e["ts_us"], e["ts_us"] + e["dur_us"]) for e in events if e["rank"] == r and e["name"] == inside]
        )
        for e in events:
            if e["rank"] != r or e["cat"] != "comm":
                continue
            start, end = e["ts_us"], e["ts_us"] + e["dur_us"]
            total += end - start
            hidden += sum(max(0.0, min(end, b) - max(start, a)) for a, b in cover)
    if total == 0:
        where = "any rank" if rank is None else f"rank {rank}"
        raise ValueError(f"no comm spans (cat='comm', non-zero length) for {where}: nothing to overlap")
    return hidden / total

"""The ``Recorder``: one rank's events -- spans of work and point-to-point messages.

An event is a plain dict that pickles (``{"name", "cat", "rank", "tid", "ts_us", "dur_us",
"args"}``, see the package docstring), so a worker can return its recorder's ``events`` from
``md.launch``. ``span`` times a ``with`` block of one thread; ``begin``/``end`` an operation
that another thread finishes (an async allreduce); ``message`` one send or receive (what
``messages.attach`` records for a communicator).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

CATEGORIES = ("compute", "comm", "message", "optimizer")


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


__all__ = ["CATEGORIES", "Recorder"]

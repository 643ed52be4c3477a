"""Chrome / Perfetto export: the events of every rank as one trace-event JSON file.

One process track per rank, one thread track per recording thread (more lanes where async
spans do not nest); open the file at https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json


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


__all__ = ["chrome_trace", "export_chrome"]

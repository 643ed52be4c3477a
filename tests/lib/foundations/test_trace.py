"""minidist.trace: recorder, attach, Chrome export, timeline plot and overlap."""

from __future__ import annotations

import ast
import json
import pickle
import threading
from pathlib import Path

import pytest

import minidist as md
import trace_workers
from minidist import trace

EVENT_KEYS = {"name", "cat", "rank", "tid", "ts_us", "dur_us", "args"}


def event(rank, name, cat, start, end, tid=0):
    """A hand-made event (times in microseconds)."""
    return {
        "name": name,
        "cat": cat,
        "rank": rank,
        "tid": tid,
        "ts_us": start,
        "dur_us": end - start,
        "args": {},
    }


# --- Recorder ---------------------------------------------------------------------------
def test_recorder_events_are_plain_picklable_dicts_and_async_spans_end_on_any_thread():
    rec = trace.Recorder(rank=3)
    with rec.span("forward"):
        pass
    token = rec.begin("allreduce bucket 0", cat="comm", bytes=4096)
    ended = threading.Thread(target=lambda: rec.end(token, done=True), name="comm")
    ended.start()
    ended.join()
    rec.message(peer=1, nbytes=64, direction="send", t_start_ns=rec.t0, t_end_ns=rec.t0 + 5000)
    assert [e["name"] for e in rec.events] == ["forward", "allreduce bucket 0", "send 64 B to rank 1"]
    for e in rec.events:
        assert set(e) == EVENT_KEYS and e["rank"] == 3 and e["dur_us"] >= 0
    comm_span = rec.events[1]
    assert comm_span["args"]["bytes"] == 4096 and comm_span["args"]["done"] is True
    assert comm_span["tid"] == 0  # owned by the thread that began it
    assert rec.events[2]["dur_us"] == 5.0 and rec.events[2]["ts_us"] == rec.t0 / 1000
    assert pickle.loads(pickle.dumps(rec.events)) == rec.events
    with pytest.raises(ValueError, match="already ended"):
        rec.end(token)
    with pytest.raises(ValueError, match="category"):
        rec.begin("x", cat="network")
    with pytest.raises(ValueError, match="direction"):
        rec.message(peer=1, nbytes=1, direction="sideways", t_start_ns=0, t_end_ns=1)


def test_each_recording_thread_gets_its_own_tid():
    rec = trace.Recorder()

    def record():
        with rec.span("in thread"):
            pass

    worker = threading.Thread(target=record, name="helper")
    worker.start()
    worker.join()
    with rec.span("main"):
        pass
    by_name = {e["name"]: e for e in rec.events}
    assert by_name["main"]["tid"] == 0 and by_name["in thread"]["tid"] == 1
    assert by_name["in thread"]["args"]["thread"] == "helper"


# --- overlap ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "events, expected",
    [
        ([event(0, "backward", "compute", 0, 100), event(0, "allreduce", "comm", 50, 150)], 0.5),
        ([event(0, "backward", "compute", 0, 100), event(0, "allreduce", "comm", 10, 30)], 1.0),
        ([event(0, "backward", "compute", 0, 100), event(0, "allreduce", "comm", 100, 130)], 0.0),
        (  # comm spans two backward spans and the gap between them
            [
                event(0, "backward", "compute", 0, 10),
                event(0, "backward", "compute", 20, 30),
                event(0, "allreduce", "comm", 5, 25),
            ],
            0.5,
        ),
        (  # overlapping backward spans are not counted twice
            [
                event(0, "backward", "compute", 0, 10),
                event(0, "backward", "compute", 0, 10, tid=1),
                event(0, "backward", "compute", 5, 15),
                event(0, "allreduce", "comm", 0, 20),
            ],
            0.75,
        ),
        (  # two comm spans in flight at once both count; messages and other compute are ignored
            [
                event(0, "backward", "compute", 0, 40),
                event(0, "forward", "compute", 40, 100),
                event(0, "bucket 0", "comm", 20, 60),
                event(0, "bucket 1", "comm", 30, 50),
                event(0, "send 4 B to rank 1", "message", 0, 100),
            ],
            (20 + 10) / (40 + 20),
        ),
    ],
)
def test_overlap_on_hand_made_events(events, expected):
    assert trace.overlap(events) == pytest.approx(expected)
    assert trace.overlap(events, rank=0) == pytest.approx(expected)


def test_overlap_per_rank_only_counts_that_ranks_backward():
    events = [
        event(0, "backward", "compute", 0, 100),
        event(0, "allreduce", "comm", 50, 150),  # 50 of 100 hidden
        event(1, "allreduce", "comm", 0, 100),  # rank 1 has no backward: rank 0's does not count
        event(2, "backward", "compute", 0, 300),
        event(2, "allreduce", "comm", 100, 300),  # all 200 hidden
    ]
    assert trace.overlap(events, rank=0) == pytest.approx(0.5)
    assert trace.overlap(events, rank=1) == 0.0
    assert trace.overlap(events, rank=2) == pytest.approx(1.0)
    assert trace.overlap(events) == pytest.approx((50 + 0 + 200) / (100 + 100 + 200))
    with pytest.raises(ValueError, match="no comm spans"):
        trace.overlap(events, rank=5)


# --- Chrome export ----------------------------------------------------------------------------
def check_chrome_schema(data: dict, events: list[dict]) -> list[dict]:
    """Trace-event format: X events with numeric ts/dur, a named process per rank, a named
    thread per track, and spans on one track nesting properly. Returns the X events."""
    assert isinstance(data["traceEvents"], list)
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in data["traceEvents"] if e["ph"] == "M"]
    assert len(complete) == len(events)
    for e in complete:
        assert isinstance(e["name"], str) and e["cat"] in trace.CATEGORIES
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0 and e["dur"] >= 0
    assert min(e["ts"] for e in complete) == 0
    process_names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert process_names == {rank: f"rank {rank}" for rank in {e["rank"] for e in events}}
    thread_names = {(e["pid"], e["tid"]) for e in meta if e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in complete} <= thread_names
    for track in {(e["pid"], e["tid"]) for e in complete}:
        spans = sorted((e["ts"], -e["dur"]) for e in complete if (e["pid"], e["tid"]) == track)
        open_ends: list[float] = []
        for start, minus_dur in spans:
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or start - minus_dur <= open_ends[-1], f"misnested span on {track}"
            open_ends.append(start - minus_dur)
    return complete


def test_export_chrome_writes_trace_event_json_with_a_track_per_rank(tmp_path: Path):
    events = [
        event(0, "forward", "compute", 1000, 1100),
        event(0, "backward", "compute", 1100, 1300),
        event(0, "allreduce bucket 0", "comm", 1150, 1400),  # starts in backward, ends after it
        event(0, "send 64 B to rank 1", "message", 1160, 1170, tid=1),
        event(1, "forward", "compute", 1010, 1120),
        event(1, "layer 1", "compute", 1020, 1050),  # nested in forward
    ]
    path = tmp_path / "trace.json"
    trace.export_chrome(path, events)
    data = json.loads(path.read_text())
    complete = check_chrome_schema(data, events)
    by_name = {(e["pid"], e["name"]): e for e in complete}  # pid is the rank
    assert by_name[0, "forward"]["ts"] == 0 and by_name[1, "forward"]["ts"] == 10
    assert by_name[0, "backward"]["dur"] == 200
    assert by_name[0, "allreduce bucket 0"]["tid"] != by_name[0, "backward"]["tid"]  # a lane of its own
    assert by_name[1, "layer 1"]["tid"] == by_name[1, "forward"]["tid"]  # nested: same track


def test_plot_timeline_draws_a_row_per_rank():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = [
        event(0, "backward", "compute", 0, 100),
        event(0, "allreduce", "comm", 50, 150),
        event(2, "forward", "compute", 0, 80),
    ]
    fig, ax = plt.subplots()
    assert trace.plot_timeline(events, ax=ax) is ax
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 2"]
    assert len(ax.collections) == 3  # rank 0 compute, rank 0 comm, rank 2 compute
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"compute", "comm"}
    plt.close(fig)
    new_ax = trace.plot_timeline(events)
    assert new_ax is not ax
    plt.close(new_ax.figure)


# --- attach: every message of a communicator ------------------------------------------------------
@pytest.mark.parametrize("transport", ["pipe", "shm", "torch"])
def test_attach_records_every_point_to_point_message(transport, tmp_path: Path):
    p = 3
    outs = md.launch(trace_workers.traced_traffic, p, transport=transport, timeout=120)
    all_events = []
    for rank, out in enumerate(outs):
        events, stats = out["events"], out["stats"]
        all_events += events
        sends = [e for e in events if e["cat"] == "message" and e["args"]["direction"] == "send"]
        recvs = [e for e in events if e["cat"] == "message" and e["args"]["direction"] == "recv"]
        # every message the transport counted is recorded once, from whichever thread sent it
        assert len(sends) == stats["messages_sent"] and len(recvs) == stats["messages_received"]
        assert sum(e["args"]["bytes"] for e in sends) == stats["bytes_sent"]
        assert sum(e["args"]["bytes"] for e in recvs) == stats["bytes_received"]
        if rank < 2:
            mine = [
                (e["args"]["peer"], e["args"]["bytes"]) for e in sends if e["args"]["bytes"] in (40, 800, 28)
            ]
            assert sorted(mine) == sorted([(1 - rank, 40), (1 - rank, 800 if rank == 0 else 28)])
        spans = {e["name"]: e for e in events if e["cat"] == "comm"}

        def messages_in(span):
            start, end = span["ts_us"], span["ts_us"] + span["dur_us"]
            return [e for e in sends if start <= e["ts_us"] and e["ts_us"] + e["dur_us"] <= end]

        assert len(messages_in(spans["allreduce ring"])) == 2 * (p - 1)
        assert messages_in(spans["allreduce async"])  # sent by the comm thread, inside the span
        assert {e["tid"] for e in messages_in(spans["allreduce async"])} != {0}
        assert out["workspace_kept"] == (transport == "shm")
        shm_fast_path = transport == "shm"
        assert bool(messages_in(spans["allreduce auto"])) != shm_fast_path
    trace.export_chrome(tmp_path / "ranks.json", all_events)
    check_chrome_schema(json.loads((tmp_path / "ranks.json").read_text()), all_events)
    assert 0.0 <= trace.overlap(all_events) <= 1.0


def test_trace_is_layer_0():
    """trace imports from minidist only its own modules and ``minidist.comm`` (the Communicator
    type, layer 0 too), so every layer may record into it."""
    paths = sorted((Path(md.__file__).parent / "trace").glob("*.py"))
    assert len(paths) > 1
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                sibling = node.level == 1  # from .recorder import ...
                comm = node.level == 2 and node.module == "comm"  # from ..comm import Communicator
                outside = node.level == 0 and not (node.module or "").startswith("minidist")
                assert sibling or comm or outside, f"{path.name}: {ast.dump(node)}"
            elif isinstance(node, ast.Import):
                assert not any(alias.name.startswith("minidist") for alias in node.names), path.name

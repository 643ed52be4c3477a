"""``FullyShardedModule.trace``: every unit's events of a step, in order (lecture 08 draws them)."""

from __future__ import annotations

import pytest

import minidist as md
import zero_trace_workers as w


@pytest.mark.parametrize("prefetch", [False, True])
def test_trace_records_each_units_gathers_frees_and_reduce_scatter(prefetch):
    traces = md.launch(w.traced_step, 2, args=(3, prefetch), transport="pipe", timeout=60)
    for trace in traces:
        times = [t for t, *_ in trace]
        assert times == sorted(times)
        for unit in ("unit0:TimedLayer", "unit1:TimedLayer", "unit2:TimedLayer"):
            events = [what for _, name, what, _ in trace if name == unit]
            forward = ["request", "ready", "free"]  # gathered, run, freed
            backward = ["request", "ready", "reduce-scatter", "free"]  # again, and the gradient sent
            assert events == forward + backward, events
        most_gathered = max(held for *_, held in trace)
        assert most_gathered == (2 if prefetch else 1)

"""Lecture 08, sections 2 and 3: the three ZeRO stages in one launch, and stage 3's gather timeline.

The training itself is ``minidist.models.zero_training.train_zero`` (the run the tests check
against one process); this module only runs it several times per launch and, for the timeline,
records when each unit of ``zero.FullyShardedModule`` is requested, gathered and freed.
"""

import time

from minidist.models.zero_training import make_data, make_model, my_rows, train_zero
from minidist.parallel import zero


def all_stages(comm, cfg, stages=(1, 2, 3)):
    """Rank body: ``train_zero`` for each of ``stages`` in turn; {stage: its result, without the weights}."""
    results = {}
    for stage in stages:
        out = train_zero(comm, {**cfg, "stage": stage})
        out.pop("state")  # the final weights: the tests compare them with one process; not needed here
        results[stage] = out
    return results


def _record(runner, events, clock):
    """Wrap each unit's start_gather, gather, free, reduce_gradient: append (t, unit, what, units held)."""
    for unit in runner.all_units:
        start_gather, gather, free, reduce_gradient = (
            unit.start_gather, unit.gather, unit.free, unit.reduce_gradient
        )  # fmt: skip

        def note(what, unit=unit):
            events.append((time.perf_counter() - clock[0], unit.name, what, runner.gathered_units()))

        def recorded_start(unit=unit, start_gather=start_gather, note=note):
            issuing = not unit.gathered and unit.pending is None
            start_gather()
            if issuing:
                note("request")  # the allgather is issued (async when prefetched)

        def recorded_gather(unit=unit, gather=gather, note=note):
            was = unit.gathered
            gather()
            if not was:
                note("ready")  # the full weights exist from here...

        def recorded_free(unit=unit, free=free, note=note):
            was = unit.gathered or unit.pending is not None
            free()
            if was:
                note("free")  # ...to here

        def recorded_reduce(reduce_gradient=reduce_gradient, note=note):
            note("reduce-scatter")
            reduce_gradient()

        unit.start_gather, unit.gather, unit.free = recorded_start, recorded_gather, recorded_free
        unit.reduce_gradient = recorded_reduce


def gather_timeline(comm, cfg, steps=2):
    """Rank body: stage 3 without and with prefetch; the events of the last of ``steps`` steps.

    Returns {prefetch: {"events": [(t, unit, what, gathered units)], "forward_end", "step_end",
    "peak_gathered_units", "units"}}, times in seconds from the start of that step.
    """
    import torch

    out = {}
    data = make_data({**cfg, "steps": steps})
    for prefetch in (False, True):
        runner = zero.FullyShardedModule(make_model(cfg), comm, prefetch=prefetch)
        opt = torch.optim.AdamW(runner.parameters(), lr=cfg["lr"])
        events, clock = [], [0.0]
        _record(runner, events, clock)
        for ids in data:
            mine = my_rows(ids, comm.rank, cfg)
            events.clear()
            clock[0] = time.perf_counter()
            loss = runner(mine, labels=mine).loss
            forward_end = time.perf_counter() - clock[0]
            loss.backward()
            opt.step()
            opt.zero_grad()
            step_end = time.perf_counter() - clock[0]
        out[prefetch] = {
            "events": list(events),
            "forward_end": forward_end,
            "step_end": step_end,
            "peak_gathered_units": runner.peak_gathered_units,
            "units": [u.name for u in runner.all_units],
        }
    return out

"""Assignment 7's trusted side, without launching anything: the shard layout the checks read
against the solution's, the peak computed from profiler events, the counts the communication
checks require, and the seeded stacks' padding. The examples through the pipeline:
``tests/grader/batches/test_a7.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from grader import forbidden
from grader.a7_zero import cases, reference, workers
from grader.a7_zero.grading import ASSIGNMENT

ROOT = Path(__file__).resolve().parents[2]


def solution_module():
    spec = importlib.util.spec_from_file_location(
        "a7_solution_zero", ROOT / "solutions" / "a7_zero" / "zero.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Rank:
    """What the solution's constructor reads of a communicator (it sends nothing there)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


@pytest.mark.parametrize("world", [2, 3])
def test_the_reference_layout_is_the_solutions(world):
    spec = cases.stack_spec(0, 30, world)
    want = reference.unit_flats(
        spec, [p.detach() for b in workers.make_blocks(spec) for p in b.parameters()], world
    )
    zero = solution_module()
    shards = [zero.ShardedStack(workers.make_blocks(spec), Rank(r, world)).shards for r in range(world)]
    for unit, flat in enumerate(want):
        assert torch.equal(torch.cat([shards[r][unit].detach() for r in range(world)]), flat)


def test_the_seeded_stacks_always_need_padding():
    for seed in range(40):
        for base in (10, 11, 20, 30, 31, 40):
            sizes = reference.unit_sizes(cases.stack_spec(seed, base, 2))
            assert all(s % 2 and s % 3 for s in (*sizes, sum(sizes))), sizes


def test_the_peak_pairs_frees_with_allocations_inside_the_window():
    events = torch.tensor(
        [
            [1, 100, 7],  # before the window: counted as alive
            [2, -50, 99],  # a free of something allocated before the profiler: not subtracted
            [3, 40, 8],
            [4, -100, 7],
            [5, 10, 9],
            [9, 1000, 10],  # after the window
        ]
    )
    assert reference.peak_bytes(events, [3, 5]) == 140  # at t=3: 100 + 40


def test_the_communication_check_wants_one_reduce_scatter_and_one_allgather_of_this_ranks_data():
    """Counts and bytes, and what each call carries: this rank's gradient of its own rows, then its
    shard of the updated parameters (a review's oracle sent zeros of the right sizes, and a full
    AdamW on every rank allgathered the averaged gradient: both passed the counts)."""
    spec = cases.stack_spec(0, 20, 3)
    total = reference.padded(sum(reference.unit_sizes(spec)), 3)
    shard, size = total // 3, sum(reference.unit_sizes(spec))
    per_step = 2 * shard * 2 * 8
    grads, after = reference.zero2_trajectory(spec)
    steps = range(spec["steps"])

    def report(rank, scatter=None, gather=None, calls=None):
        made = []
        for step in steps:
            mine = after[step][rank * shard : (rank + 1) * shard]
            made += [
                {"function": "reduce_scatter", "numel": total, "step": step, "input": grads[step][rank]},
                {"function": "allgather", "numel": shard, "step": step, "input": mine},
            ]
            if scatter is not None:
                made[-2]["input"] = scatter(step, rank)
            if gather is not None:
                made[-1]["input"] = gather(step, rank)
        if calls is not None:
            made = [dict(c, step=step) for step in steps for c in calls]
        own = [after[step][:size] for step in steps]  # what the rank reports after each step
        return {"calls": made, "bytes": [per_step] * len(steps), "grads_left": 0, "after": own}

    check = reference.check_zero2_communication(spec)
    check([report(rank) for rank in range(3)])
    check([report(rank, scatter=lambda s, r: grads[s][r] / 3) for rank in range(3)])  # op="sum", pre-divided
    allreduce = [{"function": "allreduce", "numel": total}]
    with pytest.raises(pytest.fail.Exception, match="collectives called"):
        check([report(rank, calls=allreduce) for rank in range(3)])
    with pytest.raises(pytest.fail.Exception, match="gradient of its own rows"):
        check(
            [report(rank, scatter=lambda s, r: torch.zeros(total, dtype=torch.float64)) for rank in range(3)]
        )
    averaged = lambda s, r: sum(grads[s])[r * shard : (r + 1) * shard] / 3  # noqa: E731
    with pytest.raises(pytest.fail.Exception, match="shard of the updated parameters"):
        check([report(rank, gather=averaged) for rank in range(3)])


def test_a_peak_below_the_model_states_fails():
    """Work in a thread the profiler does not follow measured 0.79 x 16 Psi / N in a review: below
    what the shards, gradients and moments alone take, so the check fails it instead of ranking it."""
    spec = dict(cases.MEASURED)
    want, _ = reference.one_process(spec, torch.float32)
    world = spec["ranks"]
    units = reference.unit_flats(spec, want, world)
    floor = reference.model_states(spec)
    outs = []
    for rank in range(world):
        shards = [u.view(world, -1)[rank] for u in units]
        events = torch.tensor([[1, int(floor) - 8, 1]])  # one allocation, 8 bytes short of the floor
        outs.append({"shards": shards, "events": events, "window": [0, 2]})
    with pytest.raises(pytest.fail.Exception, match="another thread"):
        reference.check_peak(spec)(outs)
    for out in outs:
        out["events"] = torch.tensor([[1, int(floor) + 8, 1]])
    assert reference.check_peak(spec)(outs) > 1.0


def test_the_intake_refuses_the_librarys_zero_and_memory_outside_torch():
    rules = ASSIGNMENT.forbidden
    for source in (
        "from minidist.parallel.zero import FullyShardedModule\n",
        "import torch\nx = torch.ones(2).tolist()\n",
        "import numpy\n",
        "import torch\nwith torch.autograd.profiler.profile(enabled=False):\n    pass\n",
        "import torch.distributed.fsdp\n",
        "import threading\n",  # the profiler counts its own thread only
        "from concurrent.futures import ThreadPoolExecutor\n",
        "import torch.multiprocessing\n",
    ):
        assert forbidden.check(source, rules), source
    assert forbidden.check((ROOT / "solutions" / "a7_zero" / "zero.py").read_text(), rules) is None

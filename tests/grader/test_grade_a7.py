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


def test_the_communication_check_wants_one_reduce_scatter_and_one_allgather():
    spec = cases.stack_spec(0, 20, 3)
    total = reference.padded(sum(reference.unit_sizes(spec)), 3)
    per_step = 2 * (total // 3) * 2 * 8

    def report(calls):
        steps = range(spec["steps"])
        return {
            "calls": [dict(c, step=s) for s in steps for c in calls],
            "bytes": [per_step] * 3,
            "grads_left": 0,
        }

    right = [{"function": "reduce_scatter", "numel": total}, {"function": "allgather", "numel": total // 3}]
    reference.check_zero2_communication(spec)([report(right)] * 3)
    allreduce = [{"function": "allreduce", "numel": total}]
    with pytest.raises(pytest.fail.Exception, match="collectives called"):
        reference.check_zero2_communication(spec)([report(allreduce)] * 3)


def test_the_intake_refuses_the_librarys_zero_and_memory_outside_torch():
    rules = ASSIGNMENT.forbidden
    for source in (
        "from minidist.parallel.zero import FullyShardedModule\n",
        "import torch\nx = torch.ones(2).tolist()\n",
        "import numpy\n",
        "import torch\nwith torch.autograd.profiler.profile(enabled=False):\n    pass\n",
        "import torch.distributed.fsdp\n",
    ):
        assert forbidden.check(source, rules), source
    assert forbidden.check((ROOT / "solutions" / "a7_zero" / "zero.py").read_text(), rules) is None

"""The case table of assignment 7 (ZeRO-2 and ZeRO-3). Instructors only.

Every test is a ``Case`` of ``cases(seed)``: a job (a worker of ``workers.py``, a number of
ranks, a JSON spec) and a trusted check of what the ranks report (``reference.py``). pytest runs
them with seed 0; ``grading.py`` with a seed per student: other widths, hidden sizes and number
of blocks (2 to 4), every unit's parameter count and the total chosen so that no N of the test
divides them -- the padding is always exercised. The stacks are ones the public tests do not have.

* task 1 ``ShardedAdamW``: after 3 AdamW steps every rank's parameters equal one process's, on 2
  ranks (shm) and 3 (pipe); in every ``step()`` exactly one reduce-scatter of the padded
  gradient and one allgather of the shard, the transport's bytes 2 Psi (N-1)/N x 8, and no
  ``.grad`` left (3 ranks, pipe);
* task 2 ``ShardedStack``: every unit's shards after the first backward (the averaged gradient)
  and after 3 steps equal one process's, read with the layout of the stub (2 ranks shm, 3 pipe);
  per step one allgather per unit in forward and one in backward, one reduce-scatter per unit,
  nothing else, 3 Psi (N-1)/N x 8 bytes; at every block's forward and backward at most 2 blocks
  hold weights; the next unit's allgather issued before a block computes (forward and backward);
  none holds weights after forward or after backward (3 ranks, pipe);
* task 3, measured in tiers: the peak of torch's allocations during two steps of a fixed stack
  (the same for every student: ``MEASURED``) over ZeRO-3's model states.
"""

from __future__ import annotations

import random

from grader.assignment import Case
from grader.tiers import Tiers

from . import reference as ref

TASKS = {"ShardedAdamW": 1, "ShardedStack": 2}  # task 3 is ShardedStack measured: test_peak_memory

#: the measured test's stack: 6 blocks 64 -> 256 -> 64 (33,088 parameters each), 128 rows a rank
MEASURED = {"widths": [64] * 7, "hidden": [256] * 6, "seed": 7, "rows": 128, "ranks": 2, "steps": 2}

PEAK_TIERS = Tiers(
    quantity="peak bytes allocated / ZeRO-3 model states (16 Psi / N)",
    unit="x",
    levels=((1.60, 1.0), (1.85, 0.5), (2.60, 0.25)),
    lower_is_better=True,
    baseline="the library's FullyShardedModule: 1.81x",
)


def stack_spec(seed: int, base: int, ranks: int) -> dict:
    """A stack of 2-4 blocks whose units' parameter counts, and their sum, no N of 2 or 3 divides."""
    rng = random.Random(seed * 1000 + base)
    while True:
        blocks = rng.randint(2, 4)
        widths = [rng.randint(3, 9) for _ in range(blocks + 1)]
        hidden = [rng.randint(3, 11) for _ in range(blocks)]
        sizes = ref.unit_sizes({"widths": widths, "hidden": hidden})
        if all(s % 2 and s % 3 for s in (*sizes, sum(sizes))):
            break
    return {
        "widths": widths,
        "hidden": hidden,
        "seed": (seed * 1000 + base) % 2**31,
        "rows": 3,
        "ranks": ranks,
        "steps": 3,
    }


def cases(seed: int) -> list[Case]:
    out = []
    for base, (ranks, transport) in enumerate(((2, "shm"), (3, "pipe"))):
        spec = stack_spec(seed, 10 + base, ranks)
        out.append(
            Case(
                f"test_zero2_values[{ranks}-{transport}]",
                6,
                "ShardedAdamW",
                "zero2",
                ranks,
                [spec],
                ref.check_zero2_values(spec),
                transport,
            )
        )
    spec = stack_spec(seed, 20, 3)
    out.append(
        Case(
            "test_zero2_communication[3-pipe]",
            4,
            "ShardedAdamW",
            "zero2",
            3,
            [spec],
            ref.check_zero2_communication(spec),
            "pipe",
        )
    )
    for base, (ranks, transport) in enumerate(((2, "shm"), (3, "pipe"))):
        spec = stack_spec(seed, 30 + base, ranks)
        out.append(
            Case(
                f"test_zero3_values[{ranks}-{transport}]",
                6,
                "ShardedStack",
                "zero3",
                ranks,
                [spec],
                ref.check_zero3_values(spec),
                transport,
            )
        )
    spec = stack_spec(seed, 40, 3)
    out.append(
        Case(
            "test_zero3_communication[3-pipe]",
            6,
            "ShardedStack",
            "zero3",
            3,
            [spec],
            ref.check_zero3_communication(spec),
            "pipe",
        )
    )
    out.append(
        Case(
            "test_peak_memory[2-shm]",
            8,
            "ShardedStack",
            "peak",
            MEASURED["ranks"],
            [dict(MEASURED)],
            ref.check_peak(MEASURED),
            "shm",
            tiers=PEAK_TIERS,
        )
    )
    return out

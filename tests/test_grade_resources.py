"""A batch of submissions that attack the machine's resources beside a correct one.

``grader/examples/a1_collectives/resources.py``: 150 busy-looping ``setsid`` processes, a disk
filled until ENOSPC, 8 GiB touched in 16 processes. Each sandbox has its own cgroup (memory, CPU
share, process count) and its working directory on its own tmpfs, so the correct submission
beside them keeps its full score, the grader finishes, and nothing is left: no cgroup, no mount,
no process of a sandbox user.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from grader import cgroups
from grader.examples.a1_collectives import resources
from test_grade import SUBSET, grade, gradebook, sandbox_processes

pytestmark = pytest.mark.skipif(
    not (hasattr(os, "geteuid") and os.geteuid() == 0 and all(cgroups.probe().values())),
    reason="needs root and cgroup v1 controllers memory, cpu and pids that can be created here",
)


def our_groups() -> list[Path]:
    """The grader's sandbox groups under our own cgroups (a grader running beside us has its
    own under ITS groups; cpu and pids are at the root here, so only names from this batch)."""
    found = []
    for controller in cgroups.CONTROLLERS:
        parent = cgroups._own_path(controller)
        if parent is not None:
            found += [path for path in parent.glob(f"{cgroups.PREFIX}*") if path.is_dir()]
    return found


def mounts_under(folder: Path) -> list[str]:
    prefix = str(folder.resolve()) + "/"
    with open("/proc/self/mountinfo") as info:
        return [line.split()[4] for line in info if line.split()[4].startswith(prefix)]


@pytest.mark.timeout(900)  # it may wait for another grading run's sandbox users first
def test_resource_hogs_do_not_change_the_correct_score(tmp_path):
    submissions, out = tmp_path / "subs", tmp_path / "out"
    resources.build(submissions)
    before = set(our_groups())
    extra = ("--jobs", "2", "--test-timeout", "30", "--timeout", "120")
    grade(submissions, out, *extra, tests=SUBSET, timeout=800)
    book = gradebook(out)
    assert set(book) == {"alice", *resources.ATTACKS}
    assert book["alice"]["status"] == "ok"
    assert float(book["alice"]["score"]) == float(book["alice"]["max_score"]) > 0
    assert mounts_under(tmp_path) == []
    assert not sandbox_processes()
    # groups of this batch are gone (one of a grader running beside this test may exist)
    assert not [path for path in set(our_groups()) - before if path.exists()]

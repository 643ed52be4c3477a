"""``python -m grader grade --sandbox-memory 64M``: a limit too small for the solution fails its grading
with the memory-limit reason (parsing and hashing of the limits: ``test_grade_limits.py``)."""

from __future__ import annotations

import os

import pytest
from test_a1 import grade as run_grade

from grade_helpers import gradebook
from grader import cgroups
from grader.examples.a1_collectives import make


@pytest.mark.skipif(
    not (hasattr(os, "geteuid") and os.geteuid() == 0 and cgroups.probe().get("memory")),
    reason="needs root and a cgroup v1 memory controller that can be created here",
)
@pytest.mark.timeout(900)  # it may wait for another grading run's sandbox users first
def test_a_small_memory_limit_applies_to_the_solution(tmp_path):
    """The solution under 64 MiB (torch alone needs more): killed for the limit, no points."""
    submissions, out = tmp_path / "subs", tmp_path / "out"
    make.write(submissions, {"alice": make.build_dict()["alice"]})
    output = run_grade(
        submissions, out, "--sandbox-memory", "64M", tests=["test_tree_broadcast[[]3]"], timeout=800
    )
    assert "sandbox limits per submission: memory 64 MiB" in output
    row = gradebook(out)["alice"]
    assert float(row["score"]) == 0 and float(row["max_score"]) == 1
    assert row["status"] == "crashed"
    assert "killed for exceeding the sandbox's memory limit (64 MiB" in row["reason"]

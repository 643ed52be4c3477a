"""The assignments as a student runs them: every public test fails cleanly on the released stub,
and a cheat that computes the right values with the wrong traffic fails the budget tests.

One pytest run in a subprocess (a module-scoped fixture) holds the public tests of all six
released stubs, read back through a JUnit XML report: every one fails with NotImplementedError
naming its TODO(task N), none with an import error or a timeout (a public test that passed on a
stub would test nothing). Why a subprocess: ``solutions/`` and ``assignments/`` hold modules of
the same names, which must never meet in one process; the six assignments' modules have
different names, so one run holds all six.

Elsewhere, each once: the public tests on the solutions are collected by ``make test`` itself
(``solutions/``); the solution and the stub on every hidden test, through the grader, in
``tests/grader/batches/test_a*.py``; the hidden tests' pytest form in ``tests/grader/test_assignment.py``
(generation) and below (the cheat), and ``tests/grader/batches/test_a3.py`` (the forgeries).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ASSIGNMENTS = [
    "a1_collectives",
    "a2_async",
    "a3_ddp",
    "a4_compression",
    "a5_model_parallel",
    "a6_inference",
    "a7_zero",
    "a8_experts",
    "a9_resilient",
]
#: at least this many public tests per assignment (a stub release that lost a file shows here)
MIN_PUBLIC = {
    "a1_collectives": 10,
    "a2_async": 5,
    "a3_ddp": 8,
    "a4_compression": 8,
    "a5_model_parallel": 7,
    "a6_inference": 8,
    "a7_zero": 5,
    "a8_experts": 7,
    "a9_resilient": 6,
}
CHEAT = ROOT / "tests" / "grader" / "a1_cheating"


@dataclass
class Outcome:
    status: str  # passed, failed, error, skipped
    message: str
    points: float | None


def run_pytest(
    tmp_path: Path, code_folders: list[Path], targets: list[Path], *extra: str, timeout: float
) -> tuple[dict[str, Outcome], str]:
    """Run pytest on ``targets`` with ``code_folders`` first on PYTHONPATH; {test id: Outcome}, output."""
    report = tmp_path / "report.xml"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, code_folders), *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, "-m", "pytest", *map(str, targets), "-p", "no:cacheprovider", "-q"]
    command += [f"--junitxml={report}", "-o", "junit_family=xunit1", *extra]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"pytest on {code_folders} did not finish in {timeout} s:\n{output[-5000:]}")
    assert process.returncode in (0, 1), (
        f"pytest could not run the tests (exit {process.returncode}):\n{output}"
    )
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}.{case.get('name')}"
        status, message = "passed", ""
        for child_status in ("failure", "error", "skipped"):
            child = case.find(child_status)
            if child is not None:
                status = {"failure": "failed"}.get(child_status, child_status)
                message = (child.get("message") or "") + "\n" + (child.text or "")
        points = next(
            (float(p.get("value")) for p in case.iter("property") if p.get("name") == "points"), None
        )
        outcomes[test_id] = Outcome(status, message, points)
    assert outcomes, f"no tests ran:\n{output}"
    return outcomes, output


def describe(outcomes: dict[str, Outcome]) -> str:
    return "\n".join(f"{test_id}: {o.status} {o.message[:300]}" for test_id, o in outcomes.items())


def public_of(outcomes: dict[str, Outcome], name: str) -> dict[str, Outcome]:
    return {t: o for t, o in outcomes.items() if f".test_{name}." in f".{t}"}


# --- the run ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def on_stubs(tmp_path_factory):
    """Every assignment's public tests on its released stub: one run."""
    folders = [ROOT / "assignments" / name for name in ASSIGNMENTS]
    targets = [ROOT / "assignments" / name / f"test_{name}.py" for name in ASSIGNMENTS]
    return run_pytest(tmp_path_factory.mktemp("stubs"), folders, targets, timeout=600)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("name", ASSIGNMENTS)
def test_the_stub_fails_every_public_test_with_not_implemented(on_stubs, name):
    outcomes, _ = on_stubs
    public = public_of(outcomes, name)
    assert len(public) >= MIN_PUBLIC[name]
    wrong = {
        t: o for t, o in public.items() if o.status != "failed" or "NotImplementedError" not in o.message
    }
    assert not wrong, "tests that did not fail with NotImplementedError:\n" + describe(wrong)
    for test_id, outcome in public.items():
        assert "TODO(task" in outcome.message, test_id
        assert "ImportError" not in outcome.message and "did not finish" not in outcome.message, test_id


# --- a cheat: the right values, the wrong traffic ----------------------------------------------------
@pytest.mark.timeout(300)
def test_the_byte_budget_catches_a_gather_and_broadcast_allreduce(tmp_path):
    hidden = [ROOT / "grader" / "a1_collectives"]
    outcomes, output = run_pytest(tmp_path, [CHEAT], hidden, "-k", "ring_allreduce", timeout=250)
    correctness = {t: o for t, o in outcomes.items() if "budget" not in t}
    budget = {t: o for t, o in outcomes.items() if "budget" in t}
    assert len(correctness) >= 8 and len(budget) >= 3
    # the cheat computes the right values...
    assert all(o.status == "passed" for o in correctness.values()), describe(correctness)
    # ... but sends too much, and is told so
    assert all(o.status == "failed" for o in budget.values()), describe(budget)
    for outcome in budget.values():
        assert "over the budget" in outcome.message and "rank 0" in outcome.message
    # the hidden tests' pytest form reports each test's points (JUnit XML) and the score
    earned = sum(o.points for o in correctness.values())
    total = earned + sum(o.points for o in budget.values())
    assert all(o.points for o in outcomes.values()) and f"score: {earned:g} / {total:g} points" in output


@pytest.mark.timeout(300)
def test_the_public_budget_test_catches_a_gather_and_broadcast_allreduce(tmp_path):
    folder = tmp_path / "cheat"  # the public tests beside the cheat, as a student would run them
    folder.mkdir()
    public = "test_a1_collectives.py"
    (folder / public).write_bytes((ROOT / "solutions" / "a1_collectives" / public).read_bytes())
    (folder / "collectives.py").write_bytes((CHEAT / "collectives.py").read_bytes())
    outcomes, _ = run_pytest(tmp_path, [folder], [folder / public], "-k", "ring_allreduce", timeout=250)
    budget = {t: o for t, o in outcomes.items() if "exactly" in t}
    values = {t: o for t, o in outcomes.items() if "exactly" not in t and "non_contiguous" not in t}
    assert len(budget) == 2 and len(values) == 3
    assert all(o.status == "passed" for o in values.values()), describe(values)
    assert all(o.status == "failed" for o in budget.values()), describe(budget)
    for outcome in budget.values():
        assert "rank 0" in outcome.message and "sends exactly" in outcome.message, outcome.message

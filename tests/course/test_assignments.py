"""The assignments: solutions pass every test, released stubs fail every test, cheats are caught.

The public tests (``test_*.py`` next to the assignment) and the hidden ones (``grader/<name>/``)
run in a pytest subprocess with PYTHONPATH pointing at the folder under test: solutions/ and
assignments/ hold modules of the same name, which must never meet in one process. Outcomes
come back through a JUnit XML report.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAME = "a1_collectives"
SOLUTION = ROOT / "solutions" / NAME
STUB = ROOT / "assignments" / NAME
HIDDEN = ROOT / "grader" / NAME
CHEAT = Path(__file__).resolve().parent / "a1_cheating"
PUBLIC_TESTS = "test_a1_collectives.py"
FUNCTIONS = [
    "tree_broadcast",
    "ring_allgather",
    "ring_reduce_scatter",
    "ring_allreduce",
    "butterfly_allreduce",
]


@dataclass
class Outcome:
    status: str  # passed, failed, error, skipped
    message: str
    points: float | None


def run_pytest(tmp_path: Path, code_folder: Path, targets: list[Path], *extra: str, timeout: float = 400):
    """Run pytest on ``targets`` with ``code_folder`` first on PYTHONPATH; return {test id: Outcome}."""
    report = tmp_path / f"report-{code_folder.name}.xml"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(code_folder), *filter(None, [env.get("PYTHONPATH")])])
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
        pytest.fail(f"pytest on {code_folder} did not finish in {timeout} s:\n{output[-5000:]}")
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


def is_hidden(test_id: str) -> bool:
    return test_id.startswith(f"grader.{NAME}.")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_solution_passes_public_and_hidden_tests(tmp_path):
    outcomes, output = run_pytest(tmp_path, SOLUTION, [SOLUTION / PUBLIC_TESTS, HIDDEN])
    not_passed = {t: o for t, o in outcomes.items() if o.status != "passed"}
    assert not not_passed, describe(not_passed)
    hidden = [o for t, o in outcomes.items() if is_hidden(t)]
    public = [o for t, o in outcomes.items() if not is_hidden(t)]
    assert len(public) >= 10 and len(hidden) >= 50
    assert all(o.points and o.points > 0 for o in hidden), "every hidden test must carry points"
    assert all(o.points is None for o in public)
    total = sum(o.points for o in hidden)
    assert f"score: {total:g} / {total:g} points" in output


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_released_stub_fails_every_test_with_not_implemented(tmp_path):
    outcomes, _ = run_pytest(tmp_path, STUB, [STUB / PUBLIC_TESTS, HIDDEN])
    wrong = {
        t: o for t, o in outcomes.items() if o.status != "failed" or "NotImplementedError" not in o.message
    }
    assert not wrong, "tests that did not fail with NotImplementedError:\n" + describe(wrong)
    for test_id, outcome in outcomes.items():
        assert "ImportError" not in outcome.message and "did not finish" not in outcome.message, test_id
    # every public test and every hidden test was run
    assert sum(is_hidden(t) for t in outcomes) >= 50 and sum(not is_hidden(t) for t in outcomes) >= 10


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_byte_budget_catches_a_gather_and_broadcast_allreduce(tmp_path):
    outcomes, _ = run_pytest(tmp_path, CHEAT, [HIDDEN], "-k", "ring_allreduce")
    correctness = {t: o for t, o in outcomes.items() if "budget" not in t}
    budget = {t: o for t, o in outcomes.items() if "budget" in t}
    assert len(correctness) >= 8 and len(budget) >= 3
    # the cheat computes the right values...
    assert all(o.status == "passed" for o in correctness.values()), describe(correctness)
    # ... but sends too much, and is told so
    assert all(o.status == "failed" for o in budget.values()), describe(budget)
    for outcome in budget.values():
        assert "over the budget" in outcome.message and "rank 0" in outcome.message


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_public_budget_test_catches_a_gather_and_broadcast_allreduce(tmp_path):
    folder = tmp_path / "cheat"  # the public tests beside the cheat, as a student would run them
    folder.mkdir()
    (folder / PUBLIC_TESTS).write_bytes((SOLUTION / PUBLIC_TESTS).read_bytes())
    (folder / "collectives.py").write_bytes((CHEAT / "collectives.py").read_bytes())
    outcomes, _ = run_pytest(tmp_path, folder, [folder / PUBLIC_TESTS], "-k", "ring_allreduce")
    budget = {t: o for t, o in outcomes.items() if "exactly" in t}
    values = {t: o for t, o in outcomes.items() if "exactly" not in t and "non_contiguous" not in t}
    assert len(budget) == 2 and len(values) == 3
    assert all(o.status == "passed" for o in values.values()), describe(values)
    assert all(o.status == "failed" for o in budget.values()), describe(budget)
    for outcome in budget.values():
        assert "rank 0" in outcome.message and "sends exactly" in outcome.message, outcome.message


def public_signatures(path: Path) -> dict[str, tuple]:
    """name -> (arguments, docstring) of every top-level function, read without importing."""
    tree = ast.parse(path.read_text())
    return {
        node.name: (
            ast.dump(node.args),
            ast.get_docstring(node),
            ast.dump(node.returns) if node.returns else None,
        )
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
    }


def test_stub_keeps_every_signature_and_docstring():
    solution, stub = (
        public_signatures(SOLUTION / "collectives.py"),
        public_signatures(STUB / "collectives.py"),
    )
    assert set(FUNCTIONS) <= set(solution)
    assert stub == solution


STUB_PROBE = """
import sys

import torch

import collectives

for task, name in enumerate(sys.argv[1:], start=1):
    extra = [0] if name == "tree_broadcast" else []  # src
    try:
        getattr(collectives, name)(None, torch.zeros(2), *extra)
    except NotImplementedError as error:
        assert f"TODO(task {task})" in str(error), (name, str(error))
    else:
        raise AssertionError(f"{name} did not raise NotImplementedError")
print("ok")
"""


def test_stub_imports_and_each_function_raises_not_implemented_with_its_task(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(STUB_PROBE)
    env = {**os.environ, "PYTHONPATH": str(STUB)}
    result = subprocess.run(
        [sys.executable, str(probe), *FUNCTIONS],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


# --- assignment 2: async parameter server and Hogwild -----------------------------------------
A2 = "a2_async"
A2_SOLUTION, A2_STUB, A2_HIDDEN = ROOT / "solutions" / A2, ROOT / "assignments" / A2, ROOT / "grader" / A2
A2_PUBLIC = "test_a2_async.py"
A2_FUNCTIONS = ["staleness_aware_lr", "run_server", "ps_worker", "hogwild_worker"]


def split_outcomes(outcomes: dict[str, Outcome]) -> tuple[list[Outcome], list[Outcome]]:
    hidden = [o for t, o in outcomes.items() if t.startswith(f"grader.{A2}.")]
    return hidden, [o for t, o in outcomes.items() if not t.startswith(f"grader.{A2}.")]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a2_solution_passes_public_and_hidden_tests(tmp_path):
    outcomes, output = run_pytest(tmp_path, A2_SOLUTION, [A2_SOLUTION / A2_PUBLIC, A2_HIDDEN], timeout=250)
    not_passed = {t: o for t, o in outcomes.items() if o.status != "passed"}
    assert not not_passed, describe(not_passed)
    hidden, public = split_outcomes(outcomes)
    assert len(public) >= 5 and len(hidden) >= 15
    assert all(o.points and o.points > 0 for o in hidden) and all(o.points is None for o in public)
    total = sum(o.points for o in hidden)
    assert f"score: {total:g} / {total:g} points" in output


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a2_released_stub_fails_every_test_with_not_implemented(tmp_path):
    outcomes, _ = run_pytest(tmp_path, A2_STUB, [A2_STUB / A2_PUBLIC, A2_HIDDEN], timeout=250)
    wrong = {
        t: o for t, o in outcomes.items() if o.status != "failed" or "NotImplementedError" not in o.message
    }
    assert not wrong, "tests that did not fail with NotImplementedError:\n" + describe(wrong)
    hidden, public = split_outcomes(outcomes)
    assert len(hidden) >= 15 and len(public) >= 5
    for test_id, outcome in outcomes.items():
        assert "did not finish" not in outcome.message and "TODO(task" in outcome.message, test_id


def test_a2_stub_keeps_every_signature_and_docstring():
    solution = public_signatures(A2_SOLUTION / "async_ps.py")
    assert set(A2_FUNCTIONS) <= set(solution)
    assert public_signatures(A2_STUB / "async_ps.py") == solution
    stub = (A2_STUB / "async_ps.py").read_text()
    for task, name in enumerate(A2_FUNCTIONS, start=1):
        assert f'raise NotImplementedError("TODO(task {task}): write {name}")' in stub


# --- assignment 3: bucketed DDP that overlaps backward ----------------------------------------
A3 = "a3_ddp"
A3_SOLUTION, A3_STUB, A3_HIDDEN = ROOT / "solutions" / A3, ROOT / "assignments" / A3, ROOT / "grader" / A3
A3_PUBLIC = "test_a3_ddp.py"
#: (task, what the stub's NotImplementedError names)
A3_TASKS = [
    (1, "assign_buckets"),
    (2, "_on_gradient_ready"),
    (2, "_launch"),
    (3, "_finish_backward"),
    (4, "no_sync"),
]


def a3_split(outcomes: dict[str, Outcome]) -> tuple[list[Outcome], list[Outcome]]:
    hidden = [o for t, o in outcomes.items() if t.startswith(f"grader.{A3}.")]
    return hidden, [o for t, o in outcomes.items() if not t.startswith(f"grader.{A3}.")]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a3_solution_passes_public_and_hidden_tests(tmp_path):
    outcomes, output = run_pytest(tmp_path, A3_SOLUTION, [A3_SOLUTION / A3_PUBLIC, A3_HIDDEN], timeout=350)
    not_passed = {t: o for t, o in outcomes.items() if o.status != "passed"}
    assert not not_passed, describe(not_passed)
    hidden, public = a3_split(outcomes)
    assert len(public) >= 8 and len(hidden) >= 12
    assert all(o.points and o.points > 0 for o in hidden) and all(o.points is None for o in public)
    total = sum(o.points for o in hidden)
    assert f"score: {total:g} / {total:g} points" in output


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a3_released_stub_fails_every_test_with_not_implemented(tmp_path):
    outcomes, _ = run_pytest(tmp_path, A3_STUB, [A3_STUB / A3_PUBLIC, A3_HIDDEN], timeout=350)
    wrong = {
        t: o for t, o in outcomes.items() if o.status != "failed" or "NotImplementedError" not in o.message
    }
    assert not wrong, "tests that did not fail with NotImplementedError:\n" + describe(wrong)
    hidden, public = a3_split(outcomes)
    assert len(hidden) >= 12 and len(public) >= 8
    for test_id, outcome in outcomes.items():
        assert "did not finish" not in outcome.message and "TODO(task" in outcome.message, test_id
        assert "fill in" in outcome.message or outcome.message.startswith("NotImplementedError"), test_id


def test_a3_stub_keeps_every_signature_and_docstring():
    solution = public_signatures(A3_SOLUTION / "ddp.py")
    assert "assign_buckets" in solution
    assert public_signatures(A3_STUB / "ddp.py") == solution
    stub = (A3_STUB / "ddp.py").read_text()
    for task, name in A3_TASKS:
        assert f'raise NotImplementedError("TODO(task {task}): write {name}")' in stub


A3_STUB_PROBE = """
import torch
from torch import nn

import ddp

param = nn.Parameter(torch.zeros(3))
blank = object.__new__(ddp.BucketedDDP)  # no __init__: it would stop at task 1
calls = {
    "assign_buckets": lambda: ddp.assign_buckets([("w", param)], 1.0),
    "_on_gradient_ready": lambda: blank._on_gradient_ready(param),
    "_launch": lambda: blank._launch(ddp.Bucket.of(0, ["w"], [param])),
    "_finish_backward": lambda: blank._finish_backward(),
    "no_sync": lambda: blank.no_sync().__enter__(),
}
for task, name in %r:
    try:
        calls[name]()
    except NotImplementedError as error:
        assert f"TODO(task {task}): write {name}" in str(error), (name, str(error))
    else:
        raise AssertionError(f"{name} did not raise NotImplementedError")
print("ok")
"""


def test_a3_stub_imports_and_each_part_raises_not_implemented_with_its_task(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(A3_STUB_PROBE % (A3_TASKS,))
    env = {**os.environ, "PYTHONPATH": str(A3_STUB)}
    result = subprocess.run(
        [sys.executable, str(probe)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


# --- assignment 4: Deep Gradient Compression as a DDP communication hook ----------------------
A4 = "a4_compression"
A4_SOLUTION, A4_STUB, A4_HIDDEN = ROOT / "solutions" / A4, ROOT / "assignments" / A4, ROOT / "grader" / A4
A4_PUBLIC = "test_a4_compression.py"
#: (task, what the stub's NotImplementedError names)
A4_TASKS = [
    (1, "sparsity_at"),
    (2, "clip_local"),
    (3, "select_indices"),
    (4, "compress_step"),
    (5, "SparseWork.wait"),
    (5, "DGCHook.__call__"),
]


def a4_split(outcomes: dict[str, Outcome]) -> tuple[list[Outcome], list[Outcome]]:
    hidden = [o for t, o in outcomes.items() if t.startswith(f"grader.{A4}.")]
    return hidden, [o for t, o in outcomes.items() if not t.startswith(f"grader.{A4}.")]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a4_solution_passes_public_and_hidden_tests(tmp_path):
    outcomes, output = run_pytest(tmp_path, A4_SOLUTION, [A4_SOLUTION / A4_PUBLIC, A4_HIDDEN], timeout=350)
    not_passed = {t: o for t, o in outcomes.items() if o.status != "passed"}
    assert not not_passed, describe(not_passed)
    hidden, public = a4_split(outcomes)
    assert len(public) >= 8 and len(hidden) >= 10
    assert all(o.points and o.points > 0 for o in hidden) and all(o.points is None for o in public)
    total = sum(o.points for o in hidden)
    assert f"score: {total:g} / {total:g} points" in output


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a4_released_stub_fails_every_test_with_not_implemented(tmp_path):
    outcomes, _ = run_pytest(tmp_path, A4_STUB, [A4_STUB / A4_PUBLIC, A4_HIDDEN], timeout=350)
    wrong = {
        t: o for t, o in outcomes.items() if o.status != "failed" or "NotImplementedError" not in o.message
    }
    assert not wrong, "tests that did not fail with NotImplementedError:\n" + describe(wrong)
    hidden, public = a4_split(outcomes)
    assert len(hidden) >= 10 and len(public) >= 8
    for test_id, outcome in outcomes.items():
        assert "did not finish" not in outcome.message and "TODO(task" in outcome.message, test_id


def test_a4_stub_keeps_every_signature_and_docstring():
    solution = public_signatures(A4_SOLUTION / "dgc.py")
    assert "select_indices" in solution
    assert public_signatures(A4_STUB / "dgc.py") == solution
    stub = (A4_STUB / "dgc.py").read_text()
    for task, name in A4_TASKS:
        assert f'raise NotImplementedError("TODO(task {task}): write {name}")' in stub


A4_STUB_PROBE = """
import torch

import dgc

config, grad = dgc.DGCConfig(), torch.ones(8)
calls = {
    "sparsity_at": lambda: dgc.sparsity_at(0, config),
    "clip_local": lambda: dgc.clip_local(grad, 1.0, 2),
    "select_indices": lambda: dgc.select_indices(grad, 2, config, torch.Generator()),
    "compress_step": lambda: dgc.compress_step(
        dgc.DGCState.zeros_like(grad), grad, config, 1, torch.Generator()
    ),
    "SparseWork.wait": lambda: dgc.SparseWork(None, 8, 1).wait(),
    "DGCHook.__call__": lambda: dgc.DGCHook(config)(None, grad, 0),
}
for task, name in %r:
    try:
        calls[name]()
    except NotImplementedError as error:
        assert f"TODO(task {task}): write {name}" in str(error), (name, str(error))
    else:
        raise AssertionError(f"{name} did not raise NotImplementedError")
print("ok")
"""


def test_a4_stub_imports_and_each_part_raises_not_implemented_with_its_task(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(A4_STUB_PROBE % (A4_TASKS,))
    env = {**os.environ, "PYTHONPATH": str(A4_STUB)}
    result = subprocess.run(
        [sys.executable, str(probe)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


# --- assignment 5: tensor-parallel MLP, the 1F1B schedule and its stage step ------------------
A5 = "a5_model_parallel"
A5_SOLUTION, A5_STUB, A5_HIDDEN = ROOT / "solutions" / A5, ROOT / "assignments" / A5, ROOT / "grader" / A5
A5_PUBLIC = "test_a5_model_parallel.py"
A5_FILES = ("tp_layers.py", "schedule.py")
#: (task, what the stub's NotImplementedError names)
A5_TASKS = [
    (1, "CopyToTensorParallel.forward"),
    (1, "CopyToTensorParallel.backward"),
    (2, "ReduceFromTensorParallel.forward"),
    (2, "ReduceFromTensorParallel.backward"),
    (3, "ColumnParallelLinear.__init__"),
    (3, "ColumnParallelLinear.load_dense"),
    (3, "ColumnParallelLinear.forward"),
    (4, "RowParallelLinear.__init__"),
    (4, "RowParallelLinear.load_dense"),
    (4, "RowParallelLinear.forward"),
    (5, "ParallelMLP.__init__"),
    (5, "ParallelMLP.load_dense"),
    (5, "ParallelMLP.forward"),
    (6, "one_f_one_b"),
    (7, "run_stage"),
]


def a5_split(outcomes: dict[str, Outcome]) -> tuple[list[Outcome], list[Outcome]]:
    hidden = [o for t, o in outcomes.items() if t.startswith(f"grader.{A5}.")]
    return hidden, [o for t, o in outcomes.items() if not t.startswith(f"grader.{A5}.")]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a5_solution_passes_public_and_hidden_tests(tmp_path):
    outcomes, output = run_pytest(tmp_path, A5_SOLUTION, [A5_SOLUTION / A5_PUBLIC, A5_HIDDEN], timeout=350)
    not_passed = {t: o for t, o in outcomes.items() if o.status != "passed"}
    assert not not_passed, describe(not_passed)
    hidden, public = a5_split(outcomes)
    assert len(public) >= 7 and len(hidden) >= 15
    assert all(o.points and o.points > 0 for o in hidden) and all(o.points is None for o in public)
    total = sum(o.points for o in hidden)
    assert f"score: {total:g} / {total:g} points" in output


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a5_released_stub_fails_every_test_with_not_implemented(tmp_path):
    outcomes, _ = run_pytest(tmp_path, A5_STUB, [A5_STUB / A5_PUBLIC, A5_HIDDEN], timeout=350)
    wrong = {
        t: o for t, o in outcomes.items() if o.status != "failed" or "NotImplementedError" not in o.message
    }
    assert not wrong, "tests that did not fail with NotImplementedError:\n" + describe(wrong)
    hidden, public = a5_split(outcomes)
    assert len(hidden) >= 15 and len(public) >= 7
    for test_id, outcome in outcomes.items():
        assert "did not finish" not in outcome.message and "TODO(task" in outcome.message, test_id


def a5_api(path: Path) -> dict[str, tuple]:
    """name -> (arguments, docstring) of every top-level function, class and method (not imported)."""
    tree = ast.parse(path.read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = (ast.dump(node.args), ast.get_docstring(node))
        elif isinstance(node, ast.ClassDef):
            out[node.name] = ([ast.dump(base) for base in node.bases], ast.get_docstring(node))
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    out[f"{node.name}.{item.name}"] = (ast.dump(item.args), ast.get_docstring(item))
    return out


def test_a5_stub_keeps_every_signature_and_docstring():
    for name in A5_FILES:
        solution = a5_api(A5_SOLUTION / name)
        assert a5_api(A5_STUB / name) == solution, name
    assert "ColumnParallelLinear.load_dense" in a5_api(A5_SOLUTION / "tp_layers.py")
    stubs = "".join((A5_STUB / name).read_text() for name in A5_FILES)
    for task, name in A5_TASKS:
        assert f'raise NotImplementedError("TODO(task {task}): write {name}")' in stubs


A5_STUB_PROBE = """
from types import SimpleNamespace

import torch
from torch import nn

import schedule
import tp_layers as tp

comm, x = SimpleNamespace(rank=0, world_size=2), torch.ones(2, 4)
ctx = SimpleNamespace(comm=comm)


def blank(cls):
    obj = cls.__new__(cls)
    nn.Module.__init__(obj)
    return obj


calls = {
    "CopyToTensorParallel.forward": lambda: tp.CopyToTensorParallel.forward(ctx, x, comm),
    "CopyToTensorParallel.backward": lambda: tp.CopyToTensorParallel.backward(ctx, x),
    "ReduceFromTensorParallel.forward": lambda: tp.ReduceFromTensorParallel.forward(ctx, x, comm),
    "ReduceFromTensorParallel.backward": lambda: tp.ReduceFromTensorParallel.backward(ctx, x),
    "one_f_one_b": lambda: schedule.one_f_one_b(2, 2),
    "run_stage": lambda: schedule.run_stage(nn.Identity(), comm, [("F", 0)], [x], None, None, (2, 4)),
}
for cls in ("ColumnParallelLinear", "RowParallelLinear"):
    calls[f"{cls}.__init__"] = lambda cls=cls: getattr(tp, cls)(4, 4, comm)
    calls[f"{cls}.load_dense"] = lambda cls=cls: blank(getattr(tp, cls)).load_dense(torch.ones(4, 4), None)
    calls[f"{cls}.forward"] = lambda cls=cls: blank(getattr(tp, cls)).forward(x)
calls["ParallelMLP.__init__"] = lambda: tp.ParallelMLP(4, 8, comm)
calls["ParallelMLP.load_dense"] = lambda: blank(tp.ParallelMLP).load_dense(None)
calls["ParallelMLP.forward"] = lambda: blank(tp.ParallelMLP).forward(x)
for task, name in %r:
    try:
        calls[name]()
    except NotImplementedError as error:
        assert f"TODO(task {task}): write {name}" in str(error), (name, str(error))
    else:
        raise AssertionError(f"{name} did not raise NotImplementedError")
print("ok")
"""


def test_a5_stub_imports_and_each_part_raises_not_implemented_with_its_task(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(A5_STUB_PROBE % (A5_TASKS,))
    env = {**os.environ, "PYTHONPATH": str(A5_STUB)}
    result = subprocess.run(
        [sys.executable, str(probe)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


# --- assignment 6: int8, NF4 and its packing, a KV-cached attention step, greedy generation ------
A6 = "a6_inference"
A6_SOLUTION, A6_STUB, A6_HIDDEN = ROOT / "solutions" / A6, ROOT / "assignments" / A6, ROOT / "grader" / A6
A6_PUBLIC = "test_a6_inference.py"
#: (task, what the stub's NotImplementedError names)
A6_TASKS = [
    (1, "quantize_int8"),
    (1, "dequantize_int8"),
    (2, "pack_4bit"),
    (2, "unpack_4bit"),
    (3, "quantize_nf4"),
    (3, "dequantize_nf4"),
    (4, "attention_step"),
    (5, "decoder_step"),
    (5, "generate"),
]


def a6_split(outcomes: dict[str, Outcome]) -> tuple[list[Outcome], list[Outcome]]:
    hidden = [o for t, o in outcomes.items() if t.startswith(f"grader.{A6}.")]
    return hidden, [o for t, o in outcomes.items() if not t.startswith(f"grader.{A6}.")]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a6_solution_passes_public_and_hidden_tests(tmp_path):
    outcomes, output = run_pytest(tmp_path, A6_SOLUTION, [A6_SOLUTION / A6_PUBLIC, A6_HIDDEN], timeout=350)
    not_passed = {t: o for t, o in outcomes.items() if o.status != "passed"}
    assert not not_passed, describe(not_passed)
    hidden, public = a6_split(outcomes)
    assert len(public) >= 8 and len(hidden) >= 15
    assert all(o.points and o.points > 0 for o in hidden) and all(o.points is None for o in public)
    total = sum(o.points for o in hidden)
    assert f"score: {total:g} / {total:g} points" in output


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a6_released_stub_fails_every_test_with_not_implemented(tmp_path):
    outcomes, _ = run_pytest(tmp_path, A6_STUB, [A6_STUB / A6_PUBLIC, A6_HIDDEN], timeout=350)
    wrong = {
        t: o for t, o in outcomes.items() if o.status != "failed" or "NotImplementedError" not in o.message
    }
    assert not wrong, "tests that did not fail with NotImplementedError:\n" + describe(wrong)
    hidden, public = a6_split(outcomes)
    assert len(hidden) >= 15 and len(public) >= 8
    for test_id, outcome in outcomes.items():
        assert "did not finish" not in outcome.message and "TODO(task" in outcome.message, test_id


def test_a6_stub_keeps_every_signature_and_docstring():
    solution = a5_api(A6_SOLUTION / "inference.py")
    assert a5_api(A6_STUB / "inference.py") == solution
    assert {"NF4Weight.nbytes", "TinyDecoder.__init__", "attention_step"} <= set(solution)
    stub = (A6_STUB / "inference.py").read_text()
    for task, name in A6_TASKS:
        assert f'raise NotImplementedError("TODO(task {task}): write {name}")' in stub


A6_STUB_PROBE = """
import torch
from torch import nn

import inference as a6

w, model = torch.ones(2, 4), a6.TinyDecoder(vocab=5, d=4, n_heads=2, n_layers=1, positions=8)
q = a6.NF4Weight(torch.zeros(2, dtype=torch.uint8), torch.ones(1), (4,), 4)
linear = nn.Linear(4, 4)
calls = {
    "quantize_int8": lambda: a6.quantize_int8(w),
    "dequantize_int8": lambda: a6.dequantize_int8(w.to(torch.int8), torch.ones(2, 1)),
    "pack_4bit": lambda: a6.pack_4bit(torch.zeros(4, dtype=torch.long)),
    "unpack_4bit": lambda: a6.unpack_4bit(torch.zeros(2, dtype=torch.uint8)),
    "quantize_nf4": lambda: a6.quantize_nf4(w, 4),
    "dequantize_nf4": lambda: a6.dequantize_nf4(q),
    "attention_step": lambda: a6.attention_step(linear, linear, linear, linear, 2, torch.ones(1, 3, 4)),
    "decoder_step": lambda: a6.decoder_step(model, torch.zeros(1, 3, dtype=torch.long)),
    "generate": lambda: a6.generate(model, torch.zeros(1, 3, dtype=torch.long), 2),
}
assert q.nbytes == 2 + 4  # given
for task, name in %r:
    try:
        calls[name]()
    except NotImplementedError as error:
        assert f"TODO(task {task}): write {name}" in str(error), (name, str(error))
    else:
        raise AssertionError(f"{name} did not raise NotImplementedError")
print("ok")
"""


def test_a6_stub_imports_and_each_part_raises_not_implemented_with_its_task(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(A6_STUB_PROBE % (A6_TASKS,))
    env = {**os.environ, "PYTHONPATH": str(A6_STUB)}
    result = subprocess.run(
        [sys.executable, str(probe)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr

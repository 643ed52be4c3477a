"""The notebook timing plugin: per-notebook times at the end of the run, and the hang guard."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]


def _run_nbval(folder: Path, guard_s: float) -> subprocess.CompletedProcess:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("import time\ntime.sleep(1.0)", execution_count=1),
        nbformat.v4.new_code_cell("print('second cell')", execution_count=2),
    ]
    notebook.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="second cell\n")]
    nbformat.write(notebook, folder / "sleepy.ipynb")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MINIDIST_NOTEBOOK_GUARD_S": str(guard_s)}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.plugins.notebook_times"]
    command += ["--nbval", "--nbval-current-env", "sleepy.ipynb"]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=180)


def test_times_are_printed_per_notebook_and_the_guard_fails_a_slow_one(tmp_path):
    fast = _run_nbval(tmp_path, guard_s=600)
    assert fast.returncode == 0, fast.stdout + fast.stderr
    assert "notebook execution times" in fast.stdout
    line = next(line for line in fast.stdout.splitlines() if line.rstrip().endswith("sleepy.ipynb"))
    seconds = float(line.split()[0])
    assert seconds >= 1.0  # the sleep alone; the kernel's start-up comes on top

    slow = _run_nbval(tmp_path, guard_s=0.5)
    assert slow.returncode == 1, slow.stdout + slow.stderr
    assert slow.stdout.count("more than the hang guard") >= 1
    # only the cell at which the running total passed the guard: the sleeping cell, or -- when
    # the kernel's start-up alone took longer than the guard -- the first cell's setup (an error)
    summary = slow.stdout.strip().splitlines()[-1]
    assert ("1 failed" in summary) != ("1 error" in summary), summary

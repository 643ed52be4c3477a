"""The library copied at import time, where a submission may start processes (a3, a4; a1's
``copy_at_import`` is in test_a1.py's batch, a6's ``quant_copy`` in test_a6.py's).

Issue 25: a copy of the library's DDP (a3) or DGC (a4) written into the working directory by
module-level code scored 34/37 and 30/36. Here the released stub gets a prologue that finds the
forbidden module's file in a child Python, reads it with ``cat``, copies it beside itself with
``cp`` and says what happened. Inside the sandbox the file is the grader's stand-in and the
working directory is not the student's to write (``grader/stubs.py``, ``sandbox._only_visible``,
``grade.Grader._run``), so the copy neither exists nor would hold the library's code. One test per
assignment, one batch each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grade_helpers import gradebook, run_grader, sandbox_processes

ROOT = Path(__file__).resolve().parents[3]

COPY = """

import subprocess as _subprocess
import sys as _sys

_MODULE = "minidist.par" + "allel.{module}"  # one string naming it would be refused at intake
_FIND = f"import {{_MODULE}} as m; print(m.__file__)"
_path = _subprocess.run([_sys.executable, "-c", _FIND], capture_output=True, text=True).stdout.strip()
_read = _subprocess.run(["cat", _path], capture_output=True, text=True).stdout
_copied = _subprocess.run(["cp", _path, "lib_copy.py"], capture_output=True).returncode == 0
_what = "the stand-in" if "Covered by the grader" in _read else "the library's code"
print(f"copied_at_import: read {{_what}}, copied into the working directory: {{_copied}}", flush=True)
"""
#: assignment -> (its hand-in, the forbidden module copied, one test that launches the workers)
CASES = {
    "a3_ddp": ("ddp.py", "ddp", "test_assign_buckets"),
    "a4_compression": ("dgc.py", "compression.dgc", "test_warmup_schedule"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("assignment", sorted(CASES))
def test_a_copy_made_at_import_holds_the_stand_in_and_is_not_written(assignment, tmp_path):
    hand_in, module, test = CASES[assignment]
    student = tmp_path / "subs" / "copier"
    student.mkdir(parents=True)
    stub = (ROOT / "assignments" / assignment / hand_in).read_text()
    (student / hand_in).write_text(stub + COPY.format(module=module))
    out = tmp_path / "out"
    run_grader(assignment, student.parent, out, "--tests", test, "--seed-key", "k", timeout=280)
    row = gradebook(out)["copier"]
    assert (row["status"], row["score"]) == ("ok", "0"), row  # the stub's part: nothing
    output = json.loads((out / "copier" / "results.json").read_text())["output"]
    assert "copied_at_import: read the stand-in, copied into the working directory: False" in output, output
    assert not sandbox_processes()

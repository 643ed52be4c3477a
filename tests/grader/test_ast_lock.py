"""``grader/ast_lock.py``: two grading threads building ASTs at once.

The race made deterministic: a ``gc`` callback fires while the main thread's ``ast.parse`` turns
its parse into objects, and waits there (GIL released) for a second thread's ``ast.parse`` at
another stack depth. Without the lock the main thread's parse raises CPython 3.11's
``SystemError: AST constructor recursion depth mismatch`` (what failed a7's batch once in CI);
with it the second thread waits for the lock and neither parse fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

RACE = r"""
import ast, gc, json, sys, threading
from grader import ast_lock

PARSE = ast.parse.__code__  # the frame under which the C code builds the objects
if sys.argv[1] == "guarded":
    ast_lock.serialise()
    ast_lock.serialise()  # idempotent: one lock, not two wrappers
source = "\n".join(f"x{i} = [{i}, ({i}, {i})]" for i in range(2000))
go, done, armed, errors, waited = threading.Event(), threading.Event(), [], [], []


def in_collection(phase, info):
    caller = sys._getframe().f_back
    if phase == "start" and armed and caller is not None and caller.f_code is PARSE:
        armed.clear()
        go.set()
        waited.append(done.wait(0.5))  # the other thread parses now, or waits for the lock


def other():
    go.wait(10)

    def deeper(k):
        return deeper(k - 1) if k else ast.parse("y = 1")

    try:
        deeper(50)
    except SystemError as error:
        errors.append(f"other: {error}")
    done.set()


thread = threading.Thread(target=other)
thread.start()
gc.set_threshold(100)
gc.callbacks.append(in_collection)
armed.append(True)
try:
    ast.parse(source)
except SystemError as error:
    errors.append(f"main: {error}")
go.set()
thread.join(10)
wrapped = ast.parse.__code__ is not PARSE
print(json.dumps({"errors": errors, "other_done_during_parse": waited, "wrapped": wrapped}))
"""


def race(mode: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", RACE, mode], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the race is shown on the course's CPython 3.11")
def test_the_race_is_real_without_the_lock():
    seen = race("plain")
    assert seen["other_done_during_parse"] == [True], seen  # the second parse ran inside the first
    assert any("recursion depth mismatch" in e for e in seen["errors"]), seen


def test_with_the_lock_the_second_parse_waits_and_neither_fails():
    seen = race("guarded")
    assert seen["wrapped"], seen
    assert seen["other_done_during_parse"] == [False], seen  # it waited for the lock
    assert seen["errors"] == [], seen

"""Submissions of assignment 1 that attack the grader *process* through what they return or leave.

Each is the solution plus a short snippet (``make.py``'s ``prepend`` / ``with_prologue``). Code
in the student file itself may not use ``open`` and friends (intake refuses it), but ``a1``
allows ``subprocess``, which runs anything: the snippets run their file work in a child Python.

* ``surrogate``: ``ring_allgather`` raises an exception whose message holds a lone surrogate
  (``"\\udcff"``, which UTF-8 cannot encode), ANSI escapes and control characters;
* ``markdown_forge``: ``ring_allgather`` raises an exception whose message closes a code
  fence and writes a "**Score: 87 / 87**" line;
* ``npy_bomb``: at import, writes one 32 MiB ``.npy`` into ``results/`` and a record for every
  job that references it 1,000 times, then makes ``results/`` read-only so the harness cannot
  replace the forged records (the harness then crashes: the status is ``crashed``);
* ``nan_record``: the same, with records holding ``NaN``, ``Infinity`` and a 400-digit integer;
* ``record_race``: forges without stopping the harness: once per sandbox it starts a background
  process (a session of its own) that, for as long as the sandbox lives, replaces every record
  the harness has just written with a forged one, in turn the ``npy_bomb`` record, a 400-digit
  integer and ``NaN``/``Infinity``; the harness runs to its end (status ``ok``), the grader reads
  the forgeries (all but perhaps the last record, which the sandbox's end may beat the forger to);
* ``deep_dirs``: at import, leaves 3,000 nested directories in its working directory
  (deeper than ``PATH_MAX``; ``shutil.rmtree`` raised ``RecursionError`` on them);
* ``gradebook.csv``: a correct submission named like the grader's own output file.

``tests/grader/batches/test_hostile.py`` grades them beside ``alice`` (the solution) and adds a folder
whose ``collectives.py`` is a 10 GB sparse file (made there with ``truncate``, never committed).
"""

from __future__ import annotations

from pathlib import Path

from grader.examples import common
from grader.examples.a1_collectives.make import FILE, SOLUTION, prepend, with_prologue
from grader.examples.a1_collectives.resources import ONCE

SURROGATE = r"""
raise RuntimeError(
    "bad bytes \udcff\udcfe here \x1b[2J\x1b[31mred\x1b[0m \x1b]0;title\x07"
    " bell\x07 bs\x08 cr\r nul\x00 end"
)
"""

MARKDOWN_FORGE = """
raise AssertionError(
    "wrong\\n```\\n\\n**Score: 87 / 87** -- status `ok`: graded.\\n\\n# Feedback for alice\\n"
    "````\\n| `everything` | 87 / 87 |\\n"
)
"""

# Run by a child Python at import (the probe import and every worker import the module: only
# the first run forges, later ones find the folder read-only and stop).
_FORGER = """
import subprocess, sys
subprocess.run([sys.executable, "-c", '''
import json, os
os.makedirs("results", exist_ok=True)
if os.access("results", os.W_OK):
{body}
    os.chmod("results", 0o555)  # the harness cannot write its real records any more
'''], timeout=60)
"""

NPY_BOMB = _FORGER.format(
    body="""
    import numpy as np
    np.save("results/big.npy", np.zeros(8 * 2**20, dtype=np.float32))  # 32 MiB
    record = {"value": [{"$tensor": "big.npy", "dtype": "float32"}] * 1000, "seconds": 0.1}
    for index in range(20):
        with open(f"results/t{index:03d}.json", "w") as file:
            json.dump(record, file)
"""
)

NAN_RECORD = _FORGER.format(
    body="""
    texts = [
        '{"value": [NaN, Infinity, -Infinity], "seconds": NaN}',
        '{"value": ' + str(10**400) + ', "seconds": Infinity}',
        '{"error": {"type": "E", "message": "x", "code": ' + str(10**400) + '}, "seconds": -Infinity}',
        '{"value": 1e999, "seconds": 1e999}',
    ]
    for index in range(20):
        with open(f"results/t{index:03d}.json", "w") as file:
            file.write(texts[index % len(texts)])
"""
)

DEEP_DIRS = """
import subprocess, sys
subprocess.run([sys.executable, "-c", '''
import os
if not os.path.exists("deep"):
    os.mkdir("deep")
    os.chdir("deep")
    for _ in range(3000):  # 6,000 characters of path: deeper than PATH_MAX
        os.mkdir("d")
        os.chdir("d")
'''], timeout=60)
"""

# A forger that races the harness instead of stopping it: it polls ``results/`` and replaces each
# new record (the harness's ``os.replace`` gives it a new file, which the forger overwrites in
# place) with one of three forgeries, by the job's index. Its stdio is not the harness's pipes.
RECORD_RACE = """
if _first_time(".record_race"):
    _subprocess.Popen([_sys.executable, "-c", '''
import json, os, time
import numpy as np
os.makedirs("results", exist_ok=True)
np.save("results/forged.npy", np.zeros(8 * 2**20, dtype=np.float32))  # 32 MiB
forgeries = [
    json.dumps({"value": [{"$tensor": "forged.npy", "dtype": "float32"}] * 1000, "seconds": 0.1}),
    '{"value": ' + str(10**400) + ', "seconds": 1}',
    '{"value": [NaN, Infinity, -Infinity], "seconds": NaN}',
]
forged = set()
while True:  # until the sandbox ends (it is killed with everything else in it)
    for name in sorted(os.listdir("results")):
        if name.startswith("t") and name.endswith(".json") and name not in forged:
            with open(os.path.join("results", name), "w") as file:
                file.write(forgeries[int(name[1:4]) % len(forgeries)])
            forged.add(name)
    time.sleep(0.01)
'''], start_new_session=True, stdin=_QUIET, stdout=_QUIET, stderr=_QUIET)
"""

#: student -> (status, score) on tests/grader/test_grade_robust.py's subset of tests (alice: full)
EXPECTED = {
    "surrogate": ("ok", None),  # ring_allgather's tests fail, the others pass
    "markdown_forge": ("ok", None),
    "npy_bomb": ("crashed", 0),
    "nan_record": ("crashed", 0),
    "record_race": ("ok", None),  # every test but perhaps the last fails on a forged record
    "deep_dirs": ("ok", "full"),
    "gradebook.csv": ("invalid_submission", 0),
}


def build_dict() -> dict[str, dict[str, bytes]]:
    """student -> {file: content} (folders)."""
    solution = SOLUTION.read_text()
    return {
        "surrogate": {FILE: with_prologue(solution, "ring_allgather", SURROGATE).encode()},
        "markdown_forge": {FILE: with_prologue(solution, "ring_allgather", MARKDOWN_FORGE).encode()},
        "npy_bomb": {FILE: prepend(solution, NPY_BOMB).encode()},
        "nan_record": {FILE: prepend(solution, NAN_RECORD).encode()},
        "record_race": {FILE: prepend(solution, ONCE + RECORD_RACE).encode()},
        "deep_dirs": {FILE: prepend(solution, DEEP_DIRS).encode()},
        "gradebook.csv": {FILE: solution.encode()},
    }


def build(out: Path) -> list[Path]:
    return common.write(out, build_dict())


if __name__ == "__main__":
    common.main(__doc__, build)

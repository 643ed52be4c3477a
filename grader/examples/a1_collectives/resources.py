"""Example submissions of assignment 1 that attack the machine's resources, not the grader.

Each is the solution (so its own tests would pass) plus a snippet run when ``collectives.py``
is first imported in its sandbox (a marker file makes it run once per sandbox, not once per
test). ``tests/grader/batches/test_hostile.py`` grades them in one batch beside ``alice`` (the
solution), whose score must stay full:

* ``cpu_hog``: 150 busy-looping processes, each in a session of its own (``setsid``), for the
  whole run -- without a CPU cgroup they outnumber the other slot's few processes;
* ``disk_fill``: fills its working directory and ``/tmp`` with 1 MiB files until ``ENOSPC``
  -- on a shared disk the other slot's results could no longer be written;
* ``mem_hog``: 16 processes touching 512 MiB each (8 GiB, more than a sandbox may hold; each
  under the per-process address-space limit).

``subprocess`` is allowed in assignment 1 (only the library and ``torch.distributed`` are
forbidden), so these are legitimate-looking imports.

``python -m grader.examples.a1_collectives.resources OUT`` writes them (and ``alice``) into OUT.
"""

from __future__ import annotations

from pathlib import Path

from grader.examples import common
from grader.examples.a1_collectives.make import FILE, SOLUTION, prepend

#: imports and ``_first_time(name)`` (True once per sandbox: a marker in its working directory)
ONCE = """
import os as _os
import subprocess as _subprocess
import sys as _sys

_QUIET = _subprocess.DEVNULL  # not the harness's pipes: its reader would wait for them to close

def _first_time(name):
    try:
        _os.close(_os.open(_os.path.join(_os.environ.get("HOME", "."), name), _os.O_CREAT | _os.O_EXCL))
        return True
    except OSError:
        return False
"""

CPU_HOG = """
if _first_time(".cpu_hog"):
    for _ in range(150):
        _subprocess.Popen(
            ["setsid", "sh", "-c", "while :; do :; done"], stdin=_QUIET, stdout=_QUIET, stderr=_QUIET
        )
"""

DISK_FILL = """
if _first_time(".disk_fill"):
    _chunk = b"x" * 2**20
    for _where in (_os.environ.get("HOME", "."), "/tmp"):
        for _i in range(100000):
            try:
                _fd = _os.open(_os.path.join(_where, f"fill{_i}"), _os.O_WRONLY | _os.O_CREAT, 0o600)
                try:
                    _os.write(_fd, _chunk)
                finally:
                    _os.close(_fd)
            except OSError:
                break
"""

MEM_HOG = """
if _first_time(".mem_hog"):  # bytearray() alone maps zero pages: each page is written
    _touch = (
        "import time\\nb = bytearray(512 * 2**20)\\n"
        "for i in range(0, len(b), 4096): b[i] = 1\\ntime.sleep(600)"
    )
    for _ in range(16):
        _subprocess.Popen(
            [_sys.executable, "-c", _touch], stdin=_QUIET, stdout=_QUIET, stderr=_QUIET, start_new_session=1
        )
"""

#: name -> snippet run once per sandbox
ATTACKS = {"cpu_hog": CPU_HOG, "disk_fill": DISK_FILL, "mem_hog": MEM_HOG}


def beside_alice(attacks: dict[str, str]) -> dict[str, dict[str, bytes]]:
    """``alice`` (the solution) and, per attack, the solution running ``ONCE`` + its snippet at
    import, as {student: {file: bytes}} (``isolation.py`` builds its students the same way)."""
    solution = SOLUTION.read_text()
    submissions = {"alice": {FILE: solution.encode()}}
    for name, snippet in attacks.items():
        submissions[name] = {FILE: prepend(solution, ONCE + snippet).encode()}
    return submissions


def build_dict() -> dict[str, dict[str, bytes]]:
    """``alice`` (the solution) and one submission per attack, as {student: {file: bytes}}."""
    return beside_alice(ATTACKS)


def build(out: Path) -> list[Path]:
    return common.write(out, build_dict())


if __name__ == "__main__":
    common.main(__doc__, build)

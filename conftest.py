"""Checks for the whole pytest session: the tests *and* the notebooks (nbval).

Per-test checks (processes, /dev/shm) live in tests/conftest.py; a notebook keeps
its kernel and objects alive from cell to cell, so for notebooks the check is
made once, after every kernel has shut down.
"""

import os
import time

import pytest

# per-notebook execution times at the end of the run, and the 6-minute hang guard
pytest_plugins = ["tests.plugins.notebook_times"]

SHM_DIR = "/dev/shm"


SETTLE = 5.0  # s a new file may take to go: torch names a shared block for an instant


def shm_files() -> set[str]:
    return set(os.listdir(SHM_DIR)) if os.path.isdir(SHM_DIR) else set()


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_at_the_end():
    """Fail the session if it leaves a file in /dev/shm.

    Only a file seen in every listing for SETTLE seconds counts. torch creates each shared block
    under a name (``torch_<pid>_...``) and unlinks it right after mapping it, so a listing can
    catch one for an instant, and a stream of such files must not fail the check either. CI
    once failed on a file seen only at the last listing (whose process, unknown); a real leak
    stays and still fails.
    """
    before = shm_files()
    yield
    deadline, leaked = time.monotonic() + SETTLE, shm_files() - before
    while leaked and time.monotonic() < deadline:  # a leak is a file seen in every listing
        time.sleep(0.1)
        leaked &= shm_files()
    assert not leaked, f"shared-memory files left in {SHM_DIR} by this session: {describe(leaked)}"


def describe(names: set[str]) -> list[str]:
    """Each name, with the process that made it where the name says (torch's ``torch_<pid>_...``)."""
    described = []
    for name in sorted(names):
        parts = name.split("_")
        if len(parts) > 2 and parts[0] == "torch" and parts[1].isdigit():
            try:
                with open(f"/proc/{parts[1]}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
                name += f" (made by pid {parts[1]}: {command})"
            except OSError:
                name += f" (made by pid {parts[1]}, which has exited; this session's pid is {os.getpid()})"
        described.append(name)
    return described

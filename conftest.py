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

    A file that goes within SETTLE seconds is not a leak: torch creates each shared block under
    a name (``torch_<pid>_...``) and unlinks it right after mapping it, so another process on
    the machine (the pretrained decoder training beside CI's pytest, a concurrent test run) can
    show one for an instant; CI once failed on such a file seen at the last listing.
    """
    before = shm_files()
    yield
    deadline = time.monotonic() + SETTLE
    while (leaked := shm_files() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
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

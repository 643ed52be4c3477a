"""Checks for the whole pytest session: the tests *and* the notebooks (nbval).

Per-test checks (processes, /dev/shm) live in tests/conftest.py; a notebook keeps
its kernel and objects alive from cell to cell, so for notebooks the check is
made once, after every kernel has shut down.
"""

import os

import pytest

# per-notebook execution times at the end of the run, and the 6-minute hang guard
pytest_plugins = ["tests.plugins.notebook_times"]

SHM_DIR = "/dev/shm"


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_at_the_end():
    before = set(os.listdir(SHM_DIR)) if os.path.isdir(SHM_DIR) else set()
    yield
    after = set(os.listdir(SHM_DIR)) if os.path.isdir(SHM_DIR) else set()
    leaked = sorted(after - before)
    assert not leaked, f"shared-memory files left in {SHM_DIR} by this session: {leaked}"

"""Shared fixtures: every test must leave no process and no shared-memory file behind."""

from __future__ import annotations

import os
import socket
import sys
import time

import psutil
import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
# `import workers`, `import ddp_workers`, ... from any test and in md.launch's worker processes:
# worker modules live beside their tests under tests/lib/<layer>/ and tests/grader/, and every
# such folder is on sys.path before the first fork server starts (it copies sys.path then).
# `from conftest import wait_until` finds this file through TESTS.
WORKER_DIRS = [
    TESTS,
    *sorted(os.path.join(TESTS, "lib", d) for d in os.listdir(os.path.join(TESTS, "lib"))),
    os.path.join(TESTS, "grader"),
]
for _folder in reversed(WORKER_DIRS):
    if os.path.isdir(_folder) and _folder not in sys.path:
        sys.path.insert(0, _folder)

SHM_DIR = "/dev/shm"


def _is_multiprocessing_helper(proc: psutil.Process) -> bool:
    """The fork server and the resource tracker live as long as the test session."""
    try:
        cmdline = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return "forkserver" in cmdline or "resource_tracker" in cmdline


def leftover_processes() -> list[psutil.Process]:
    """Live descendants of this test process, apart from the fork server itself.

    A worker started by the fork server is the fork server's child, so the
    fork server's descendants are counted: they are ours.
    """
    found = []
    for child in psutil.Process().children(recursive=False):
        try:
            if not _is_multiprocessing_helper(child):
                found.append(child)
            found.extend(child.children(recursive=True))
        except psutil.NoSuchProcess:
            continue
    alive = []
    for proc in found:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    return alive


def shm_files() -> set[str]:
    return set(os.listdir(SHM_DIR)) if os.path.isdir(SHM_DIR) else set()


def free_port() -> int:
    """A TCP port the OS says is free now (for servers a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, timeout: float = 5.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves a process or a /dev/shm file behind."""
    shm_before = shm_files()
    yield
    assert wait_until(lambda: not leftover_processes()), (
        f"processes left behind: {[(p.pid, p.name()) for p in leftover_processes()]}"
    )
    assert wait_until(lambda: not (shm_files() - shm_before)), (
        f"shared-memory files left behind: {sorted(shm_files() - shm_before)}"
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

"""Checks for the whole pytest session: the tests *and* the notebooks (nbval).

Per-test checks (processes, /dev/shm) live in tests/conftest.py; a notebook keeps
its kernel and objects alive from cell to cell, so for notebooks the check is
made once, after every kernel has shut down.
"""

import os
import time

import pytest

# per-notebook execution times at the end of the run, and the 6-minute hang guard; a per-file
# time table (where the suite's minutes go)
pytest_plugins = ["tests.plugins.notebook_times", "tests.plugins.file_times"]

# --- the tiers, by path (tests/README.md) -----------------------------------------------------------
# A test's tier markers come from where it lives, never from a decorator: `make check` runs what is
# "not slow and not notebooks and not browser and not gpu"; `make test` runs everything. A path is
# a file or a folder (ending in "/"), relative to the repository root; a notebook is anything that
# nbval collects (*.ipynb).
PATH_MARKERS: dict[str, tuple[str, ...]] = {
    "slow": (
        # sandboxed grading batches: each grades example students, solutions and stubs in the grader
        "tests/grader/batches/",
        "tests/grader/test_grade_isolation.py",  # grades from inside a sandbox
        "tests/grader/test_grade_limits.py",  # grades the solution under a memory limit
        "tests/grader/test_grade_release.py",  # installs the student repository in a fresh .venv
        # pytest runs of every assignment's public and hidden tests on the solutions and stubs
        "tests/course/test_assignments.py",
        # two lectures' student copies run to the end (their exercises unsolved)
        "tests/course/test_student_lectures.py",
        # the public tests of the solutions, as `make test` collects them
        "solutions/",
        # whole benchmarks and multi-node launches
        "tests/lib/tools/test_bench.py",
        "tests/lib/launch/test_torchrun.py",
    ),
    "browser": ("tests/course/browser/",),
    "gpu": ("tests/lib/test_gpu.py",),  # and every test whose name says "cuda" (markers_for)
}
ROOT = os.path.dirname(os.path.abspath(__file__))


def markers_for(path: str, name: str = "") -> list[str]:
    """The tier markers of test ``name`` in file ``path`` (relative to the repository root, with ``/``).

    A CUDA test lives beside the CPU tests of the same code and says so in its name
    (``test_..._on_cuda``): it is marked ``gpu`` wherever it is.
    """
    if path.endswith(".ipynb"):
        return ["notebooks"]  # its own tier, wherever it lives
    found = []
    if "cuda" in name.lower():
        found.append("gpu")
    for marker, prefixes in PATH_MARKERS.items():
        if any(path == prefix or (prefix.endswith("/") and path.startswith(prefix)) for prefix in prefixes):
            found.append(marker)
    return found


@pytest.hookimpl(tryfirst=True)  # before the hooks that read the markers (the GPU skip, -m)
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = os.path.relpath(str(item.path), ROOT).replace(os.sep, "/")
        for marker in markers_for(path, item.name):
            if item.get_closest_marker(marker) is None:
                item.add_marker(marker)


SHM_DIR = "/dev/shm"

# The assignment notebooks end with a cell that runs their public tests (run_public_tests in
# aN_trace.py / aN_run.py). The whole public test files are collected once from solutions/; under
# nbval (and in the browser tests' lab, which inherits this environment) each notebook runs one
# public test per task, enough to show the cell works.
os.environ.setdefault("MINIDIST_PUBLIC_TESTS", "one-per-task")


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

"""A per-file time table at the end of every run: where the suite spends its minutes.

pytest's ``--durations`` names the slowest single tests; a file of a hundred 2-second tests
never appears there, yet costs more than any of them. This plugin adds up setup, call and
teardown of every test per file (a notebook is one file: nbval makes an item of each cell) and
prints the files that took the most, with their share of the run, their tier (``fast``, or the
markers ``conftest.py`` gave them by path) and the total. It prints when pytest was asked for
``--durations`` (``make check`` and ``make test`` are), so a student's run of the public tests
stays short. ``MINIDIST_FILE_TIMES`` sets how many rows are printed (default 30; 0 prints none).
"""

from __future__ import annotations

import os
import time

import pytest

_seconds: dict[str, float] = {}
_tests: dict[str, int] = {}
_tiers: dict[str, set[str]] = {}
_start = time.monotonic()


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items) -> None:
    for item in items:
        tier = [m for m in ("slow", "notebooks", "browser", "gpu") if item.get_closest_marker(m)]
        _tiers.setdefault(_file_of(item.nodeid), set()).add(",".join(tier) or "fast")


def pytest_runtest_logreport(report) -> None:
    path = _file_of(report.nodeid)
    _seconds[path] = _seconds.get(path, 0.0) + report.duration
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _tests[path] = _tests.get(path, 0) + 1


def pytest_terminal_summary(terminalreporter, config) -> None:
    rows = int(os.environ.get("MINIDIST_FILE_TIMES", "30"))
    if not _seconds or rows <= 0 or config.getoption("durations") is None:
        return
    total = sum(_seconds.values())
    terminalreporter.section(f"time per file (the {min(rows, len(_seconds))} slowest of {len(_seconds)})")
    for path, seconds in sorted(_seconds.items(), key=lambda kv: -kv[1])[:rows]:
        terminalreporter.write_line(
            f"{seconds:8.1f} s {100 * seconds / total:5.1f}%  {_tests.get(path, 0):4d} tests  "
            f"{'+'.join(sorted(_tiers.get(path, {'?'}))):9s} {path}"
        )
    wall = time.monotonic() - _start
    terminalreporter.write_line(f"{total:8.1f} s in tests, {wall:.1f} s of wall time since start-up")

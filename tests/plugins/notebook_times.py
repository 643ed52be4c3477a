"""How long each notebook takes under nbval, printed at the end of the run, with a hang guard.

nbval turns every code cell of a notebook into one test item, so no single item says what a
notebook costs. This plugin adds up, per notebook file, the setup and call time of its cells
(the kernel's start-up is in the first cell's setup), prints one line per notebook at the end
of the run, and fails the cell at which a notebook's running total passes the hang guard:
twice the course's 3-minute budget by default (``MINIDIST_NOTEBOOK_GUARD_S`` overrides it).
A notebook between 3 and 6 minutes passes but is marked "over budget" in the summary.
"""

from __future__ import annotations

import os

import pytest

BUDGET_S = 180.0  # what the course promises per notebook on a 2-core laptop


def guard_seconds() -> float:
    return float(os.environ.get("MINIDIST_NOTEBOOK_GUARD_S", 2 * BUDGET_S))


_seconds: dict[str, float] = {}


def _notebook_of(item) -> str | None:
    path = str(getattr(item, "path", getattr(item, "fspath", "")))
    return path if path.endswith(".ipynb") else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    notebook = _notebook_of(item)
    if notebook is None or call.when not in ("setup", "call"):
        return
    before = _seconds.get(notebook, 0.0)
    total = _seconds[notebook] = before + call.duration
    guard = guard_seconds()
    report = outcome.get_result()
    if before <= guard < total and report.outcome != "failed":
        report.outcome = "failed"
        report.longrepr = (
            f"{os.path.basename(notebook)} has run for {total:.0f} s, more than the hang guard of "
            f"{guard:.0f} s (twice the {BUDGET_S:.0f} s budget of a notebook on 2 cores): "
            "make its experiments smaller or find what hangs"
        )


def pytest_terminal_summary(terminalreporter) -> None:
    if not _seconds:
        return
    terminalreporter.section("notebook execution times")
    cwd = os.getcwd()
    for notebook, seconds in sorted(_seconds.items()):
        note = "  OVER THE 3-MINUTE BUDGET" if seconds > BUDGET_S else ""
        terminalreporter.write_line(f"{seconds:7.1f} s  {os.path.relpath(notebook, cwd)}{note}")

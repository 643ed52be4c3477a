"""Points for the hidden tests: a pytest plugin that ``grader/conftest.py`` loads for every assignment.

Convention: every test under ``grader/`` has a marker ``@pytest.mark.points(n)``, ``n`` a
positive number (a parametrized test is worth ``n`` per parameter set). A test without one
is a collection error, so no test is silently worth nothing. For each test the points are

* recorded as the property ``points`` of its ``<testcase>`` in the JUnit XML report
  (``pytest --junitxml=report.xml``; ``-o junit_family=xunit1`` for a report that also
  validates against the schema), which is what the grading pipeline reads, and
* added up in the terminal summary: ``score: earned / total points``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent  # grader/: hidden tests live in its sub-folders


def pytest_configure(config):
    config.addinivalue_line("markers", "points(n): what a hidden test is worth (grader/ only)")


def _ours(item) -> bool:
    return HERE in Path(str(item.path)).resolve().parents


def points_of(item) -> float:
    marker = item.get_closest_marker("points")
    if marker is None or len(marker.args) != 1 or not isinstance(marker.args[0], (int, float)):
        raise pytest.UsageError(f"{item.nodeid}: hidden tests need exactly one @pytest.mark.points(n)")
    if marker.args[0] <= 0:
        raise pytest.UsageError(f"{item.nodeid}: points must be positive, got {marker.args[0]}")
    return marker.args[0]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _ours(item):
            points_of(item)  # raises for a test without points


@pytest.fixture(autouse=True)
def _record_points(request):
    # What record_property does, without its warning under the default junit_family (xunit2),
    # whose schema has no per-test properties; pytest writes them all the same.
    request.node.user_properties.append(("points", points_of(request.node)))


def pytest_terminal_summary(terminalreporter):
    worth: dict[str, float] = {}
    lost: set[str] = set()
    skipped: set[str] = set()
    for reports in terminalreporter.stats.values():
        for report in reports:
            if not hasattr(report, "when") or not hasattr(report, "user_properties"):
                continue  # warnings and collection reports
            if "points" in dict(report.user_properties):
                worth[report.nodeid] = dict(report.user_properties)["points"]
            if report.skipped:
                skipped.add(report.nodeid)
            elif report.failed or (report.when == "call" and not report.passed):
                lost.add(report.nodeid)
    counted = {nodeid: points for nodeid, points in worth.items() if nodeid not in skipped}
    if counted:
        earned = sum(points for nodeid, points in counted.items() if nodeid not in lost)
        terminalreporter.write_line(f"score: {earned:g} / {sum(counted.values()):g} points")

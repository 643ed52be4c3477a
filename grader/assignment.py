"""An assignment, declared once: its files, rules, tasks and a table of cases with their points.

Every assignment ``grader/<name>/`` holds one ``Assignment`` (in ``grading.py``) and the parts
only it can have:

    grading.py     ASSIGNMENT = Assignment.of(__package__, hints=..., similar_to=..., ...)
    cases.py       cases(seed) -> list[Case]: every hidden test, its points, worker, arguments, check
    workers.py     what runs in the sandbox with the student's code (the jobs' entry points)
    reference.py   the trusted second implementation the checks compare with (run by the grader)
    rules.py       what a submission may not use (``grader/forbidden.py``)
    test_hidden.py two lines: ``globals().update(ASSIGNMENT.pytest_tests())``

From that one declaration come

* the grader's jobs and trusted checks (``graded_tests(seed)``: a ``Job`` per case, with seeds
  only the grading run knows; the check runs in the grader on the reports read back);
* the hidden pytest tests (``pytest_tests()``: a test function per case name, parametrised like
  ``test_overlap[tied-2-shm]``, each carrying ``@pytest.mark.points(n)`` from the table), run
  with seed 0 in this process through the same workers and checks;
* the course's own tests (``tests/grader/``), which read both.

A case's points are written once, in its ``Case``: nothing else restates them.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from grader.forbidden import Rules
from grader.plan import GradedTest, Job
from grader.tiers import Tiers

__all__ = ["Assignment", "Case"]


@dataclass(frozen=True)
class Case:
    """One hidden test: ``worker`` of the assignment's ``workers.py`` on ``world_size`` ranks with
    JSON ``args``; ``check(outs)`` raises when the reports are wrong (``outs[0]`` alone for an
    assignment whose jobs run one process). A measured case (``tiers`` given, ``grader/tiers.py``)
    returns the measured value when the reports are right: it earns a fraction of ``points``."""

    name: str  # test_function or test_function[parameters]: the name students see
    points: float
    function: str  # the student function it grades (hints, tasks, failure messages)
    worker: str
    world_size: int
    args: list
    check: Callable[[Any], Any]
    transport: str = "shm"
    tiers: Tiers | None = None

    @property
    def test_function(self) -> str:
        return self.name.split("[", 1)[0]

    @property
    def parameters(self) -> str | None:
        return self.name[len(self.test_function) + 1 : -1] if "[" in self.name else None


#: the exceptions that say "the student's module did not import"
IMPORT_ERRORS = ("ImportError", "ModuleNotFoundError", "SyntaxError")


def import_failure_of(error: dict, marker: str) -> str | None:
    """A one-line summary when a job failed because the student's module could not be imported.

    The failure counts as one when the exception is an import or syntax error, or when the
    traceback ``text`` shows the worker's import line (``marker``, e.g. ``"import_module("``).
    """
    text, exc_type = str(error.get("text", "")), str(error.get("exc_type", ""))
    if error.get("kind") != "worker":
        return None
    if exc_type in IMPORT_ERRORS or marker in text:
        return f"{exc_type or 'the process died'}: {str(error.get('summary', ''))[:200]}"
    return None


#: ", expected <value>" up to a following " (N of M elements differ)" or the end of the line
EXPECTED_VALUE = re.compile(r", expected (?:(?! \(\d+ of )[^\n])*")


def redact_expected(message: str) -> str:
    """What a student may see: the wrong value, not the expected one (``EXPECTED_VALUE``)."""
    return EXPECTED_VALUE.sub(", which is wrong", message)


@dataclass(frozen=True)
class Assignment:
    """What ``python -m grader grade NAME`` and the hidden tests need to know about one assignment."""

    name: str  # the folder: grader/<name>, solutions/<name>, assignments/<name>
    student_files: tuple[str, ...]  # what a student hands in; everything else is ignored
    rules: ModuleType  # rules.py: refused at intake and, in the sandbox, at run time
    tasks: Mapping[str, int]  # student function -> its TODO(task N)
    hints: Mapping[str, str]  # student function -> one line of feedback when its tests fail
    cases: Callable[[int], list[Case]]  # seed -> every hidden test
    similar_to: tuple[str, ...]  # globs of library files a submission is compared with
    given_functions: tuple[str, ...] = ()  # functions the stub gives: not compared
    timeout: float = 30.0  # seconds per launch under pytest: a deadlock fails one test
    student_code: str = ""  # how failure texts name the student's code ("ddp.py")
    deadlock_hint: str = ""  # said when a job does not finish
    import_marker: str = "import_module("  # a traceback line that shows the student import failed
    one_process: bool = False  # every job is one process: checks read outs[0]
    redact: Callable[[str], str] = redact_expected  # what a student may see of a failure
    sandbox_files: tuple[str, ...] = ("workers.py", "rules.py")  # of grader/<name>/, for the sandbox
    workers_module: str = "workers"
    #: modules the sandbox's harness imports once before it forks the workers: those every worker
    #: would import again (torch.optim imports torch._dynamo: ~0.8 CPU-s per worker that trains)
    sandbox_preload: tuple[str, ...] = ()

    @classmethod
    def of(cls, package: str, **fields: Any) -> Assignment:
        """The assignment of ``grader/<name>/`` (``package``: its ``__package__``): the student
        files from its ``__init__``, ``rules.py``, and the tasks and cases of ``cases.py``; the
        rest (hints, similar_to, ...) as keywords."""
        cases = importlib.import_module(f"{package}.cases")
        return cls(
            name=package.rsplit(".", 1)[-1],
            student_files=importlib.import_module(package).STUDENT_FILES,
            rules=importlib.import_module(f"{package}.rules"),
            tasks=cases.TASKS,
            cases=cases.cases,
            **fields,
        )

    @functools.cached_property
    def forbidden(self) -> Rules:
        return Rules.of(self.rules)

    # --- the grader's side ----------------------------------------------------------------------
    def graded_tests(self, seed: int) -> list[GradedTest]:
        """Every case as (job for the sandbox, trusted check for the grader), in table order."""
        tests = []
        cases = self.cases(seed)
        _one_column_per_quantity(self.name, cases)
        for case in cases:
            job = Job(self.workers_module, case.worker, case.world_size, case.args, case.transport)
            check = _first_report(case.check) if self.one_process else case.check
            tests.append(GradedTest(case.name, case.points, case.function, job, check, case.tiers))
        return tests

    def measured(self) -> list[Case]:
        """The measured cases (seed 0): the ones graded in tiers."""
        return [case for case in self.cases(0) if case.tiers is not None]

    def failure_message(self, test: GradedTest, error: dict, seconds: float) -> str:
        """The student-facing message for a job that did not return (``error`` as the harness wrote it)."""
        job, text = test.job, str(error.get("text", ""))
        if error.get("kind") == "timeout":
            return self.timeout_failure(test.function, job.world_size, job.transport, seconds, text)
        if error.get("kind") == "worker":
            exc_type, summary = str(error.get("exc_type", "")), str(error.get("summary", ""))
            rank = error.get("rank", "?")
            return self.worker_failure(
                test.function, job.world_size, job.transport, exc_type, rank, summary, text
            )
        return f"{test.function}: the test harness failed: {text}"

    def import_failure(self, error: dict) -> str | None:
        """A one-line summary when a job failed because the student's code could not be imported."""
        return import_failure_of(error, self.import_marker)

    # --- failure texts, the same under pytest and in the grader ---------------------------------
    def _where(self, world_size: int, transport: str) -> str:
        return "" if self.one_process else f" on {world_size} rank(s) (transport {transport!r})"

    def worker_failure(
        self,
        function: str,
        world_size: int,
        transport: str,
        exc_type: str,
        rank: Any,
        summary: str,
        text: str,
    ) -> str:
        """What to tell the student when a rank raised (md.WorkerError's fields)."""
        code = self.student_code or "your code"
        if exc_type == "NotImplementedError":
            who = function if self.one_process else f"rank {rank}"
            task = self.tasks.get(function)
            todo = f"TODO(task {task}) in {code}" if task is not None else f"that TODO in {code}"
            return f"{who} raised {exc_type}: {summary} (fill in {todo})"
        if exc_type in IMPORT_ERRORS:
            return f"could not import {code}: {text}"
        return f"{function} failed{self._where(world_size, transport)}: {text}"

    def timeout_failure(
        self, function: str, world_size: int, transport: str, seconds: float, text: str
    ) -> str:
        """What to tell the student when a job did not finish in time."""
        hint = f" {self.deadlock_hint}" if self.deadlock_hint else ""
        where = self._where(world_size, transport)
        return f"{function}: did not finish within {seconds:g} s{where};{hint} {text}"

    # --- the pytest side --------------------------------------------------------------------------
    def run(self, case: Case) -> None:
        """Run ``case`` with md.launch in this process and check it; ``pytest.fail`` with the
        student-facing text when a rank raises or the launch times out."""
        import pytest

        import minidist as md

        workers = importlib.import_module(f"grader.{self.name}.{self.workers_module}")
        try:
            outs = md.launch(
                getattr(workers, case.worker),
                case.world_size,
                args=tuple(case.args),
                transport=case.transport,
                timeout=self.timeout,
            )
        except md.WorkerError as error:
            failure = self.worker_failure(
                case.function,
                case.world_size,
                case.transport,
                error.exc_type,
                error.rank,
                error.summary,
                str(error),
            )
        except md.LaunchTimeout as error:
            failure = self.timeout_failure(
                case.function, case.world_size, case.transport, self.timeout, str(error)
            )
        else:
            value = (_first_report(case.check) if self.one_process else case.check)(outs)
            if case.tiers is None:
                return
            outcome = case.tiers.outcome(value, case.points)
            if outcome.tier == 1:
                return
            failure = outcome.message  # under pytest a measured case passes at the top tier only
        pytest.fail(failure, pytrace=False)

    def pytest_tests(self) -> dict[str, Callable]:
        """The hidden tests as pytest functions, one per test function name of the table (seed 0).

        ``test_overlap[tied-2-shm]`` becomes ``test_overlap`` parametrised with ``tied-2-shm``;
        each parameter set carries the ``points`` of its case.
        """
        import pytest

        groups: dict[str, list[Case]] = {}
        for case in self.cases(0):
            groups.setdefault(case.test_function, []).append(case)
        tests = {}
        for name, group in groups.items():
            if len({case.parameters is None for case in group}) > 1:
                raise ValueError(f"{self.name}: cases of {name} must all have parameters or none")
            if group[0].parameters is None:
                if len(group) != 1:
                    raise ValueError(
                        f"{self.name}: {len(group)} cases are named {name}; give them parameters"
                    )
                tests[name] = self._single_test(name, group[0], pytest)
            else:
                tests[name] = self._parametrized_test(name, group, pytest)
        return tests

    def _single_test(self, name: str, case: Case, pytest: ModuleType) -> Callable:
        def test() -> None:
            self.run(case)

        test.__name__ = test.__qualname__ = name
        return pytest.mark.points(case.points)(test)

    def _parametrized_test(self, name: str, group: list[Case], pytest: ModuleType) -> Callable:
        by_parameters = {case.parameters: case for case in group}

        def test(setup: str) -> None:
            self.run(by_parameters[setup])

        test.__name__ = test.__qualname__ = name
        params = [
            pytest.param(c.parameters, id=c.parameters, marks=pytest.mark.points(c.points)) for c in group
        ]
        return pytest.mark.parametrize("setup", params)(test)


def _first_report(check: Callable[[Any], Any]) -> Callable[[list], Any]:
    """A one-process case checks its one report (``md.launch`` returns a list of one)."""

    def check_first(outs: list) -> Any:
        return check(outs[0])

    return check_first


def _one_column_per_quantity(name: str, cases: list[Case]) -> None:
    """Each measured case names its own quantity: it is the leaderboard's column."""
    seen: dict[str, str] = {}
    for case in cases:
        if case.tiers is not None:
            other = seen.setdefault(case.tiers.quantity, case.name)
            if other != case.name:
                raise ValueError(f"{name}: {other} and {case.name} both measure {case.tiers.quantity!r}")

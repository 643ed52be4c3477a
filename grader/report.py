"""What grading writes: ``results.json`` (Gradescope's schema), ``feedback.md``, ``gradebook.csv``.

``results.json`` follows Gradescope's autograder format (``score``, ``execution_time``,
``output``, ``visibility``, ``tests[]`` with ``name``, ``score``, ``max_score``, ``status``,
``output``, ``visibility``); our own fields live in ``extra_data`` (the grading status, its
reason, and the hash of what was graded, which makes a finished submission reusable).

Nothing written here contains the hidden tests' source or expected values: messages come from
the trusted checks, redacted by the assignment's ``redact``.

Every string a submission can influence (messages, reasons, its output, its id) is sanitised
here, where it is written (``grader/text.py``): in ``feedback.md`` it sits in a fenced code
block it cannot close, in ``gradebook.csv`` it is one line that cannot start a formula, in the
terminal summary it carries no escape sequence; every file is valid UTF-8, and the JSON files
are strict JSON (no NaN or Infinity).
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from . import text
from .plan import TestResult
from .tiers import Tiers, leaderboard_rows

STATUS_HELP = {
    "ok": "graded",
    "timeout": "the whole run went over the time limit; tests that had not finished score 0",
    "crashed": "the grading process in the sandbox died; tests without a result score 0",
    "invalid_submission": "the submission could not be graded (see the reason)",
    "forbidden": (
        "your code uses the library's implementation of the task, which is not allowed; every test scores 0"
    ),
    "import_error": "your module could not be imported, so no test could run",
    "error": "the grader itself failed on this submission; tell the instructor",
}
MAX_MESSAGE = 3000
MAX_OUTPUT = 4000  # characters of the sandbox's stderr shown


@dataclass
class Graded:
    student: str
    status: str
    reason: str
    tests: list[TestResult]
    seconds: float
    digest: str
    output: str = ""
    notes: list[str] = field(default_factory=list)
    similarity: float = 0.0  # for the instructor only: closest library function (grader/similarity.py)
    similar_to: str = ""
    instead: str = ""  # with status "forbidden": what to use instead

    @property
    def score(self) -> float:
        return sum(t.points for t in self.tests)

    @property
    def max_score(self) -> float:
        return sum(t.max_points for t in self.tests)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8", errors="replace")  # the text is clean; never die on it
    os.replace(tmp, path)


def _json(data: dict, indent: int | None = None) -> str:
    """Strict JSON (no NaN / Infinity: non-finite numbers become null)."""
    return json.dumps(text.finite(data), indent=indent, allow_nan=False) + "\n"


def results_json(graded: Graded) -> dict:
    data = {
        "score": graded.score,
        "max_score": graded.max_score,
        "execution_time": round(graded.seconds, 1),
        "visibility": "visible",
        "output": _top_output(graded),
        "tests": [
            {
                "name": t.name,
                "score": t.points,
                "max_score": t.max_points,
                "status": "passed" if t.passed else "failed",
                "output": text.clean(t.message, limit=MAX_MESSAGE),
                "visibility": "visible",
            }
            for t in graded.tests
        ],
        "extra_data": {
            "status": graded.status,
            "reason": text.clean(graded.reason),
            "input_sha256": graded.digest,
            "tests_seconds": round(sum(t.seconds for t in graded.tests), 2),  # inside md.launch
        },
    }
    measured = [t for t in graded.tests if t.quantity]
    if measured:  # the measured tests (grader/tiers.py): their values, and Gradescope's leaderboard
        data["extra_data"]["measured"] = {t.name: t.measured for t in measured}
        data["leaderboard"] = [
            {"name": t.quantity, "value": t.measured, "order": t.order}
            for t in measured
            if t.measured is not None
        ]
    return text.finite(data)


def _top_output(graded: Graded) -> str:
    out = f"status: {graded.status} ({STATUS_HELP.get(graded.status, '')})"
    if graded.reason:
        out += f"\nreason: {text.clean(graded.reason)}"
    if graded.output.strip():
        out += "\n\nlast lines of the run's output:\n" + text.clean(graded.output[-MAX_OUTPUT:])
    return out


def write_student(folder: Path, graded: Graded, hints: dict[str, str]) -> None:
    """``feedback.md`` first, ``results.json`` last: a results.json means the student is done.

    ``instructor.json`` (the similarity to the library) is never shown to the student: Gradescope
    gets ``results.json`` only.
    """
    folder.mkdir(parents=True, exist_ok=True)
    instructor = {"similarity": graded.similarity, "similar_to": graded.similar_to}
    _write_atomic(folder / "instructor.json", _json(instructor))
    _write_atomic(folder / "feedback.md", feedback_md(graded, hints))
    _write_atomic(folder / "results.json", _json(results_json(graded), indent=1))


def read_instructor(folder: Path) -> dict:
    """What ``write_student`` kept for the instructor (empty when missing)."""
    try:
        data = json.loads((folder / "instructor.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_student(folder: Path) -> dict | None:
    try:
        data = json.loads((folder / "results.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("tests"), list) else None


def feedback_md(graded: Graded, hints: dict[str, str]) -> str:
    lines = [
        f"# Feedback for {text.inline(graded.student)}",
        "",
        f"**Score: {graded.score:g} / {graded.max_score:g}** -- status `{graded.status}`: "
        f"{STATUS_HELP.get(graded.status, '')}.",
    ]
    if graded.reason:
        lines += ["", "Reason:", "", *text.fenced(graded.reason)]
    if graded.status == "forbidden" and graded.instead:
        lines += ["", f"What you may use instead: {graded.instead}."]
    by_function: dict[str, list[TestResult]] = {}
    for test in graded.tests:
        by_function.setdefault(test.function, []).append(test)
    if by_function:
        lines += ["", "| function | tests passed | points |", "|---|---|---|"]
        for function, tests in by_function.items():
            passed = sum(t.passed for t in tests)
            lines.append(
                f"| `{function}` | {passed} / {len(tests)} | "
                f"{sum(t.points for t in tests):g} / {sum(t.max_points for t in tests):g} |"
            )
    measured = [t for t in graded.tests if t.quantity and t.measured is not None]
    if measured:  # right, and graded in tiers: what was measured and what it earned
        lines += ["", "## Measured", ""]
        lines += [f"- `{t.name}`: {text.inline(t.message)}" for t in measured]
    failed = [t for t in graded.tests if not t.passed and t not in measured]
    if failed:
        lines += ["", "## What failed, and why", ""]
        shown: set[str] = set()
        for test in failed:
            message = test.message.strip()
            if len(message) > 1200:
                message = message[:1200] + " [...]"
            lines += [f"### {test.name} ({test.max_points:g} points)", "", *text.fenced(message), ""]
            if test.function in hints and test.function not in shown:
                lines += [f"Hint: {hints[test.function]}", ""]
                shown.add(test.function)
    elif graded.tests and all(t.passed for t in graded.tests):
        lines += ["", "Every test passed. Well done."]
    elif graded.tests:  # right everywhere, a measured test below its top tier
        lines += ["", "Every result was right; the measured tests above say what their top tier needs."]
    lines += [
        "",
        "The hidden tests run your code on other sizes and numbers of ranks than the public "
        "tests, compare every result with a trusted computation, and check what your code sends.",
    ]
    return "\n".join(lines) + "\n"


def write_gradebook(path: Path, rows: list[dict], test_names: list[str]) -> None:
    """One row per submission: id, score, max_score, status, reason, similarity, similar_to, points per test.

    ``similarity`` (0..1) and ``similar_to`` are the closest match of the submission's code in the
    library (``grader/similarity.py``); they are for the instructor and appear nowhere a student sees.
    """
    columns = ["id", "score", "max_score", "status", "reason", "similarity", "similar_to", *test_names]
    rows = [{key: text.csv_cell(value) for key, value in row.items()} for row in rows]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="", encoding="utf-8", errors="replace") as file:
        writer = csv.DictWriter(file, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow(row)
    os.replace(tmp, path)


def write_leaderboards(out: Path, results: dict[str, dict], measured: dict[str, Tiers]) -> None:
    """``OUT/leaderboard/<test>.csv`` per measured test: rank, id, value, points, best first.

    ``results``: each graded student's ``results.json``; a submission whose result was wrong (or
    that was not graded) has no measured value and no row.
    """
    folder = out / "leaderboard"
    folder.mkdir(exist_ok=True)
    for name, tiers in measured.items():
        entries = []
        for student, data in results.items():
            extra = data.get("extra_data") if isinstance(data.get("extra_data"), dict) else {}
            values = extra.get("measured") if isinstance(extra.get("measured"), dict) else {}
            value = values.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                tests = data.get("tests") if isinstance(data.get("tests"), list) else []
                points = next(
                    (t.get("score", 0) for t in tests if isinstance(t, dict) and t.get("name") == name), 0
                )
                entries.append((student, float(value), _num(points)))
        rows = [{k: text.csv_cell(v) for k, v in row.items()} for row in leaderboard_rows(entries, tiers)]
        path = folder / f"{re.sub(r'[^A-Za-z0-9_.=-]+', '_', name).strip('_')}.csv"
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as file:
            file.write(f"# {tiers.quantity} ({'lower' if tiers.lower_is_better else 'higher'} is better)\n")
            writer = csv.DictWriter(file, fieldnames=["rank", "id", "value", "points"])
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, path)


def gradebook_row(student: str, results: dict, test_names: list[str], instructor: dict | None = None) -> dict:
    """The gradebook row from a ``results.json`` (tolerant: a damaged file from an earlier run gives 0s)."""
    extra = results.get("extra_data") if isinstance(results.get("extra_data"), dict) else {}
    instructor = instructor or {}
    tests = results.get("tests") if isinstance(results.get("tests"), list) else []
    scores = {t.get("name"): t.get("score", 0) for t in tests if isinstance(t, dict)}
    row = {
        "id": student,
        "score": f"{_num(results.get('score')):g}",
        "max_score": f"{_num(results.get('max_score')):g}",
        "status": text.clean(extra.get("status", ""), multiline=False, limit=40),
        "reason": text.clean(extra.get("reason", ""), multiline=False, limit=200),
        "similarity": f"{_num(instructor.get('similarity')):g}",
        "similar_to": text.clean(instructor.get("similar_to", ""), multiline=False, limit=200),
    }
    for name in test_names:
        row[name] = f"{_num(scores.get(name)):g}"
    return row


def _num(value) -> float:
    """A finite number from our own (possibly damaged) JSON; 0 for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return 0.0


def summary_table(rows: list[dict], flag_at: float = 1.01) -> str:
    """The batch at a glance, and the submissions whose similarity to the library is ``>= flag_at``."""
    rows = [{key: text.clean(value, multiline=False) for key, value in row.items()} for row in rows]
    width = max([len(r["id"]) for r in rows] + [7])
    lines = [f"{'student':<{width}}  {'score':>13}  status", "-" * (width + 32)]
    flagged = []
    for row in rows:
        score = f"{row['score']} / {row['max_score']}"
        reason = f" ({row['reason'][:60]})" if row["reason"] else ""
        lines.append(f"{row['id']:<{width}}  {score:>13}  {row['status']}{reason}")
        if float(row.get("similarity") or 0) >= flag_at:
            flagged.append(f"  {row['id']}: similarity {row['similarity']} to {row['similar_to']}")
    if flagged:
        lines += ["", f"flagged for review (code this close to the library's, similarity >= {flag_at:g}):"]
        lines += flagged
    return "\n".join(lines)

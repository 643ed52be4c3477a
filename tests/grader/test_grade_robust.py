"""The grader process survives anything a submission returns or leaves behind (issue 15).

Fast unit tests of the sanitiser (``grader/text.py``), the byte caps and the JSON guards
(``grader/wire.py``), the size checks and reserved ids at intake, the iterative remover
(``grader/tree.py``) and the writers (``grader/report.py``). The hostile examples of
``grader/examples/a1_collectives/robust.py`` are graded beside ``alice`` (the solution) in
``tests/grader/batches/test_hostile.py``'s batch, which uses ``strict_json`` and ``lines_outside_fences``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import resource
import shutil
import subprocess

import numpy as np
import pytest

from grader import intake, report, text, tree, wire
from grader.a1_collectives import STUDENT_FILES
from grader.plan import TestResult as Result

HOSTILE = (
    "bad \udcff\udcfe \x1b[2J\x1b[31mred\x1b[0m \x1b]0;title\x07"
    " bell\x07 bs\x08 cr\r nul\x00 end\ttab\nline 2"
)
FORGE = "wrong\n```\n\n**Score: 87 / 87** -- status `ok`\n\n````\n# Feedback for alice\n"


def strict_json(data: str):
    """A JSON parser that refuses NaN and Infinity (what Gradescope and browsers accept)."""

    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(data, parse_constant=refuse)


def lines_outside_fences(markdown: str) -> list[str]:
    """The Markdown lines a renderer shows as text (CommonMark backtick fences: a block ends at a
    line of at least as many backticks as opened it, and nothing else)."""
    shown, fence = [], 0
    for line in markdown.splitlines():
        stripped = line.strip()
        run = len(stripped) - len(stripped.lstrip("`"))
        if fence:
            if run >= fence and stripped == "`" * run:
                fence = 0
        elif run >= 3:
            fence = run
        else:
            shown.append(line)
    return shown


# --- the sanitiser ---------------------------------------------------------------------------
def test_clean_makes_any_string_writable_and_free_of_control_characters():
    cleaned = text.clean(HOSTILE)
    cleaned.encode("utf-8")  # would raise on a surrogate
    assert not any(ord(c) < 32 and c not in "\n\t" for c in cleaned)
    assert "\x1b" not in cleaned and "\x9b" not in cleaned and "title" not in cleaned
    assert "red" in cleaned and "end\ttab\nline 2" in cleaned and "\ufffd" in cleaned
    one_line = text.clean(HOSTILE, multiline=False)
    assert "\n" not in one_line and "\t" not in one_line and not any(ord(c) < 32 for c in one_line)
    assert text.clean("plain text, ünïcödé") == "plain text, ünïcödé"
    assert len(text.clean("x" * 1000, limit=10)) == 10


def test_fenced_text_cannot_close_its_fence_or_forge_a_line():
    for body in (FORGE, "`" * 10, "a ``` b\n```` c", HOSTILE):
        block = text.fenced(body)
        document = "\n".join(["**Score: 1 / 2**", "", *block, "after"])
        shown = lines_outside_fences(document)
        assert shown == ["**Score: 1 / 2**", "", "after"], (body, shown)


def test_csv_cells_never_start_a_formula():
    for value, expected in [("=1+1", "'=1+1"), ("+A1", "'+A1"), ("-2", "'-2"), ("@SUM(A1)", "'@SUM(A1)")]:
        assert text.csv_cell(value) == expected
    assert text.csv_cell("alice") == "alice"
    buffer = io.StringIO()
    csv.writer(buffer).writerow([text.csv_cell(HOSTILE)])
    assert len(list(csv.reader(io.StringIO(buffer.getvalue())))) == 1  # one line, one row


def test_finite_replaces_non_finite_numbers_for_strict_json():
    data = {"a": [1.5, math.nan, {"b": math.inf}], "c": -math.inf, "d": 3}
    assert strict_json(json.dumps(text.finite(data), allow_nan=False)) == {
        "a": [1.5, None, {"b": None}],
        "c": None,
        "d": 3,
    }


# --- the wire: JSON guards and byte caps -----------------------------------------------------
def test_records_with_nan_infinity_and_huge_integers_never_escape_as_exceptions(tmp_path):
    (tmp_path / "t0.json").write_text('{"value": [NaN, Infinity], "seconds": NaN}')
    record = wire.read_record(tmp_path, "t0")
    assert math.isnan(record["value"][0]) and record["value"][1] == math.inf and record["seconds"] == 0.0
    (tmp_path / "t1.json").write_text('{"value": ' + str(10**400) + ', "seconds": 1}')
    with pytest.raises(wire.WireError, match="digits"):
        wire.read_record(tmp_path, "t1")
    (tmp_path / "t2.json").write_text('{"error": {"code": -' + str(10**400) + "}}")
    with pytest.raises(wire.WireError, match="digits"):
        wire.read_record(tmp_path, "t2")
    (tmp_path / "t3.json").write_text('{"value": 1, "seconds": 1e999}')
    assert wire.read_record(tmp_path, "t3")["seconds"] == 0.0
    (tmp_path / "t4.json").write_text('{"value": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(wire.WireError):
        wire.read_record(tmp_path, "t4")


def test_decoded_bytes_are_capped_per_record_and_per_submission(tmp_path, monkeypatch):
    array = np.zeros(2**18, dtype=np.float32)  # 1 MiB
    np.save(tmp_path / "big.npy", array)
    size = (tmp_path / "big.npy").stat().st_size
    monkeypatch.setattr(wire, "MAX_RECORD_BYTES", 3 * size)
    monkeypatch.setattr(wire, "MAX_SUBMISSION_BYTES", 5 * size)
    entry = {"$tensor": "big.npy", "dtype": "float32"}
    (tmp_path / "bomb.json").write_text(json.dumps({"value": [entry] * 1000}))
    with pytest.raises(wire.WireError, match="add up to more than"):
        wire.read_record(tmp_path, "bomb")
    (tmp_path / "three.json").write_text(json.dumps({"value": [entry] * 3}))
    folder = tmp_path / "sub"
    folder.mkdir()
    shutil.copy(tmp_path / "big.npy", folder)
    (folder / "two.json").write_text(json.dumps({"value": [entry] * 2}))
    budget = wire.Budget()  # the grader makes one per submission
    assert len(wire.read_record(folder, "two", budget)["value"]) == 2  # within both caps
    assert len(wire.read_record(folder, "two", budget)["value"]) == 2  # 4 of the submission's 5
    with pytest.raises(wire.WireError, match="results of this submission"):
        wire.read_record(folder, "two", budget)  # 6 > 5: the submission's cap
    assert len(wire.read_record(folder, "two", wire.Budget())["value"]) == 2  # another submission's


# --- intake: sizes before reading, reserved ids ------------------------------------------------
def test_a_huge_sparse_student_file_is_refused_without_being_read(tmp_path):
    folder = tmp_path / "sparse"
    folder.mkdir()
    subprocess.run(["truncate", "-s", "10G", str(folder / "collectives.py")], check=True, timeout=30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    submission = intake.load(folder, STUDENT_FILES)
    assert "larger than" in submission.error and not submission.files
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 512 * 1024, grown_kib  # far below the file's 10 GiB: it was not read


def test_reserved_and_unsafe_names_are_refused_as_student_ids(tmp_path):
    for name in ("gradebook.csv", "GradeBook.CSV", "gradebook.csv.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "collectives.py").write_text("x = 1\n")
        submission = intake.load(tmp_path / name, STUDENT_FILES)
        assert "reserved" in submission.error, name
        assert not intake.usable_id(name)
    for name in (".sandbox", ".seed-key", "..", "a/b", "a b", "\x1b[31m", ""):
        assert not intake.usable_id(name), name
    assert intake.usable_id("alice") and intake.usable_id("bob.smith@uni")


# --- the iterative remover ------------------------------------------------------------------
def test_remove_tree_removes_3000_nested_directories_and_follows_no_link(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("must survive")
    root = tmp_path / "work"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:  # 3,000 levels by descriptor: the path is longer than PATH_MAX
        for level in range(3000):
            os.mkdir("d", dir_fd=fd)
            with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "w") as file:
                file.write("x")
            if level % 1000 == 10:
                os.symlink(outside, "link", dir_fd=fd)
            down = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            if level % 1000 == 20:
                os.chmod("d", 0, dir_fd=fd)
            os.close(fd)
            fd = down
    finally:
        os.close(fd)
    assert tree.remove_tree(root) == []
    assert not root.exists() and (outside / "keep").read_text() == "must survive"
    assert tree.remove_tree(root) == []  # already gone: nothing to do, no error
    (tmp_path / "file").write_text("x")
    assert tree.remove_tree(tmp_path / "file") == [] and not (tmp_path / "file").exists()


def test_remove_tree_reports_what_it_cannot_remove_and_still_ends(tmp_path, monkeypatch):
    root = tmp_path / "work"
    (root / "a" / "stuck").mkdir(parents=True)
    (root / "a" / "stuck" / "f").write_text("x")
    (root / "b").mkdir()
    real_rmdir = os.rmdir

    def rmdir(path, *, dir_fd=None):  # a mount point, say
        if os.fspath(path) == "stuck":
            raise OSError(16, "Device or resource busy")
        return real_rmdir(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "rmdir", rmdir)
    failed = tree.remove_tree(root)
    assert any(f.endswith("stuck: Device or resource busy") for f in failed), failed
    assert (root / "a" / "stuck").is_dir() and not (root / "b").exists()
    assert not (root / "a" / "stuck" / "f").exists()


# --- the writers -----------------------------------------------------------------------------
def test_feedback_results_and_gradebook_survive_hostile_text(tmp_path):
    tests = [
        Result("test_a[3]", 0.0, 1.0, False, "ring_allgather", HOSTILE),
        Result("test_b[3]", 0.0, 1.0, False, "ring_allgather", FORGE),
        Result("test_c[3]", 1.0, 1.0, True, "tree_broadcast", ""),
    ]
    tests[0].seconds = math.nan
    graded = report.Graded("mallory", "ok", FORGE + HOSTILE, tests, math.inf, "d", output=HOSTILE)
    report.write_student(tmp_path / "mallory", graded, {"ring_allgather": "a hint"})
    for path in (tmp_path / "mallory").iterdir():
        data = path.read_bytes()
        data.decode("utf-8")  # strict
        assert b"\x1b" not in data, path
    feedback = (tmp_path / "mallory" / "feedback.md").read_text()
    scores = [line for line in lines_outside_fences(feedback) if "Score:" in line]
    assert scores == ["**Score: 1 / 3** -- status `ok`: graded."], scores
    results = strict_json((tmp_path / "mallory" / "results.json").read_text())
    assert results["score"] == 1.0 and results["execution_time"] is None
    row = report.gradebook_row("mallory", results, ["test_a[3]", "test_c[3]"])
    report.write_gradebook(tmp_path / "gradebook.csv", [row], ["test_a[3]", "test_c[3]"])
    with open(tmp_path / "gradebook.csv", newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 1 and rows[0]["score"] == "1" and rows[0]["test_c[3]"] == "1"
    assert "\n" not in rows[0]["reason"] and "\x1b" not in rows[0]["reason"]
    assert "\x1b" not in report.summary_table([row])


def test_a_damaged_results_file_from_an_earlier_run_gives_a_row_not_a_crash():
    for damaged in (
        {},
        {"score": "x", "tests": "no"},
        {"score": math.nan, "extra_data": [1]},
        {"tests": [1]},
    ):
        row = report.gradebook_row("alice", damaged, ["t"])
        assert row["score"] == "0" and row["t"] == "0"

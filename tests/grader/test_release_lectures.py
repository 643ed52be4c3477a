"""``python -m grader release lectures``: solutions/lectures/ -> notebooks/, exercises unsolved.

The rules that make Run All reach the end of a student copy are enforced by the release
(grader/release_lectures.py); each is checked here on a small notebook, then on the course's own.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from grader import release_lectures  # noqa: E402
from grader.release import ReleaseError, source_files  # noqa: E402

EXERCISE = '''def double(x):
    """Twice x."""
    # hint: kept
    ### BEGIN SOLUTION TODO(Try it 1): write it
    return 2 * x
    ### END SOLUTION'''
CHECK = 'with md.exercise("Try it 1"):\n    assert double(3) == 6'


def notebook(*sources: str) -> str:
    cells = [
        {
            "cell_type": "code",
            "execution_count": 7,
            "metadata": {},
            "outputs": [{"name": "stdout", "output_type": "stream", "text": [f"out {i}\n"]}],
            "source": source,
        }
        for i, source in enumerate(sources)
    ]
    return json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5})


def released(*sources: str) -> list[dict]:
    return json.loads(release_lectures.release_lecture_notebook(notebook(*sources), "nb.ipynb", 110))["cells"]


def test_exercise_stubbed_check_and_exercise_outputs_cleared_others_kept():
    cells = released("import minidist as md", EXERCISE, CHECK, "print(md.allreduce)")
    source = cells[1]["source"]
    assert 'raise NotImplementedError("TODO(Try it 1): write it")' in source
    assert "# hint: kept" in source and "return 2 * x" not in source
    assert [bool(c["outputs"]) for c in cells] == [True, False, False, True]
    assert [c["execution_count"] for c in cells] == [7, None, None, 7]


def test_a_module_written_by_writefile_may_hold_the_exercise():
    cells = released(
        "%%writefile lecture99/mod.py\nimport torch\n\n\n" + EXERCISE, "from lecture99.mod import x", CHECK
    )
    assert cells[0]["source"].startswith("%%writefile lecture99/mod.py")
    assert "raise NotImplementedError" in cells[0]["source"]


@pytest.mark.parametrize(
    ("sources", "words"),
    [
        (("x = 1\n### BEGIN SOLUTION\nx = 2\n### END SOLUTION", CHECK), "not inside a function body"),
        ((EXERCISE, "print(double(2))", CHECK), "cell 2): uses `double`"),
        ((EXERCISE, "print(1)"), "has no check cell"),
        ((EXERCISE, CHECK, "y = double(4)"), "cell 3): uses `double`"),
    ],
)
def test_a_student_copy_that_could_stop_run_all_is_refused(sources, words):
    with pytest.raises(ReleaseError, match=None) as error:
        released(*sources)
    assert words in str(error.value)


def test_a_library_function_of_the_same_name_is_not_a_use():
    cells = released(EXERCISE, CHECK, "md.double(4)")
    assert cells[2]["outputs"], "a cell that calls md.double does not depend on the student's double"


def test_every_lecture_has_two_or_three_code_exercises_each_checked():
    """The student copies as committed: every lecture's exercises unsolved, each with its check cell."""
    lectures = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert len(lectures) >= 9
    for path in lectures:
        text = path.read_text()
        exercises, checks = release_lectures.exercise_count(text)
        assert exercises >= 2, f"{path.name}: {exercises} unsolved exercises (want 2-3)"
        assert checks >= exercises, f"{path.name}: {exercises} exercises but {checks} check cells"
        assert "BEGIN SOLUTION" not in text


def test_released_lectures_match_their_solved_copies():
    solved = {p.with_suffix("").name for p in (ROOT / "solutions" / "lectures").glob("*.ipynb")}
    student = {p.with_suffix("").name for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert solved == student
    assert {p.as_posix() for p in source_files(ROOT / "notebooks")} == {
        p.as_posix() for p in source_files(ROOT / "solutions" / "lectures")
    }

"""``python -m grader release``: stubbing, errors, determinism, --check, nothing secret released."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `grader` is a folder of the repository, not an installed package
    sys.path.append(str(ROOT))

from grader import grade, release  # noqa: E402

SOLUTION = '''"""A module with solution regions."""

import math

TAU = 2 * math.pi  # keeps `math` used in the stub too (ruff would flag an unused import)


def area(radius: float) -> float:
    """Area of a circle."""
    # TODO(task 1): pi r^2
    ### BEGIN SOLUTION TODO(task 1): compute the area
    result = math.pi * radius**2
    return result
    ### END SOLUTION


class Shape:
    def scaled(self, factor: float, *, clamp: bool = False) -> float:
        """Scale the shape."""
        if clamp:
            factor = min(factor, 1.0)
        ### BEGIN SOLUTION
        return factor * 2
        ### END SOLUTION


def nested(values: list[int]) -> int:
    """Sum of squares."""
    total = 0
    for value in values:
        ### BEGIN SOLUTION TODO(task 2): a message long enough that its stub will not fit on one line
        total += value * value
        ### END SOLUTION
    return total
'''

EXPECTED_STUB = '''"""A module with solution regions."""

import math

TAU = 2 * math.pi  # keeps `math` used in the stub too (ruff would flag an unused import)


def area(radius: float) -> float:
    """Area of a circle."""
    # TODO(task 1): pi r^2
    raise NotImplementedError("TODO(task 1): compute the area")


class Shape:
    def scaled(self, factor: float, *, clamp: bool = False) -> float:
        """Scale the shape."""
        if clamp:
            factor = min(factor, 1.0)
        raise NotImplementedError("TODO: your code here")


def nested(values: list[int]) -> int:
    """Sum of squares."""
    total = 0
    for value in values:
        raise NotImplementedError(
            "TODO(task 2): a message long enough that its stub will not fit on one line"
        )
    return total
'''


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stub_keeps_signatures_docstrings_hints_and_indentation(tmp_path):
    stubbed = release.release_python(SOLUTION, "synthetic.py", max_length=110)
    assert stubbed == EXPECTED_STUB
    (tmp_path / "solved.py").write_text(SOLUTION)
    (tmp_path / "stub.py").write_text(stubbed)
    solved, stub = load(tmp_path / "solved.py", "release_solved"), load(tmp_path / "stub.py", "release_stub")
    for name in ["area", "nested"]:
        assert inspect.signature(getattr(stub, name)) == inspect.signature(getattr(solved, name))
        assert getattr(stub, name).__doc__ == getattr(solved, name).__doc__
    assert inspect.signature(stub.Shape.scaled) == inspect.signature(solved.Shape.scaled)
    assert solved.area(1.0) == pytest.approx(3.14159, rel=1e-5)
    with pytest.raises(NotImplementedError, match=r"TODO\(task 1\): compute the area"):
        stub.area(1.0)
    with pytest.raises(NotImplementedError, match="TODO: your code here"):
        stub.Shape().scaled(2.0)
    assert stub.nested([]) == 0  # the loop body never ran


def test_stubs_are_ruff_clean(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.ruff]\nline-length = 110\n")
    (tmp_path / "stub.py").write_text(release.release_python(SOLUTION, "synthetic.py", max_length=110))
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.skip("ruff is not installed next to this python")
    for command in (["format", "--check"], ["check", "--select", "E,F,W,I"]):
        result = subprocess.run(
            [str(ruff), *command, "stub.py"], cwd=tmp_path, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_crlf_files_keep_their_line_endings():
    stubbed = release.release_python(SOLUTION.replace("\n", "\r\n"), "crlf.py", max_length=110)
    assert stubbed == EXPECTED_STUB.replace("\n", "\r\n")


@pytest.mark.parametrize(
    "source, line, words",
    [
        ("def f():\n    ### BEGIN SOLUTION\n    return 1\n", 2, ["never closed"]),
        ("def f():\n    return 1\n    ### END SOLUTION\n", 3, ["without a '### BEGIN SOLUTION'"]),
        (
            "def f():\n    ### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n    ### END SOLUTION\n",
            3,
            ["cannot nest", "line 2"],
        ),
        ("def f():\n    ### BEGIN SOLUTION\n    x = 1\n### END SOLUTION\n", 4, ["indented differently"]),
        ("def f():\n    # BEGIN SOLUTION\n    return 1\n", 2, ["malformed"]),
        ("def f():\n    return 1  ### BEGIN SOLUTION\n", 2, ["malformed"]),
        ("X = 1\n### BEGIN SOLUTION\nY = 2\n### END SOLUTION\n", 2, ["not inside a function"]),
        ("class C:\n    ### BEGIN SOLUTION\n    y = 2\n    ### END SOLUTION\n", 2, ["not inside a function"]),
        ("def f(:\n    pass\n", 1, ["does not parse"]),
    ],
)
def test_bad_regions_are_clear_errors_naming_file_and_line(source, line, words):
    with pytest.raises(release.ReleaseError) as info:
        release.release_python(source, "solutions/a9/mod.py", max_length=110)
    message = str(info.value)
    assert f"solutions/a9/mod.py:{line}" in message, message
    for word in words:
        assert word in message, message


def test_message_that_cannot_fit_is_an_error():
    source = "def f():\n    ### BEGIN SOLUTION " + "x" * 120 + "\n    pass\n    ### END SOLUTION\n"
    with pytest.raises(release.ReleaseError, match="too long"):
        release.release_python(source, "m.py", max_length=110)


@pytest.mark.parametrize(
    "message, literal",
    [('say "hi"', "'say \"hi\"'"), ("it's", '"it\'s"'), ("plain", '"plain"')],
)
def test_stub_messages_are_quoted_the_way_ruff_formats_them(message, literal):
    source = f"def f():\n    ### BEGIN SOLUTION {message}\n    pass\n    ### END SOLUTION\n"
    assert release.release_python(source, "m.py", max_length=110) == (
        f"def f():\n    raise NotImplementedError({literal})\n"
    )


def test_markers_in_other_file_types_are_errors(tmp_path):
    folder = tmp_path / "solutions" / "a9_demo"
    folder.mkdir(parents=True)
    (folder / "notes.md").write_text("# Notes\n### BEGIN SOLUTION\nanswer\n### END SOLUTION\n")
    with pytest.raises(release.ReleaseError, match=r"solutions/a9_demo/notes.md:2: .*only in \.py files"):
        release.build(tmp_path, tmp_path / "out")


def make_notebook(cells: list[dict]) -> str:
    return json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}, indent=1)


def test_notebook_outputs_cleared_and_code_cells_stubbed():
    text = make_notebook(
        [
            {"cell_type": "markdown", "id": "a", "metadata": {}, "source": ["# Title\n", "text"]},
            {
                "cell_type": "code",
                "id": "b",
                "execution_count": 7,
                "metadata": {"execution": {"iopub.status.busy": "2020"}, "tags": ["keep"]},
                "outputs": [{"output_type": "stream", "name": "stdout", "text": ["42\n"]}],
                "source": [
                    "def answer():\n",
                    "    # hint: think\n",
                    "    ### BEGIN SOLUTION TODO: find it\n",
                    "    return 42\n",
                    "    ### END SOLUTION\n",
                    "\n",
                    "\n",
                    "answer()",
                ],
            },
            {
                "cell_type": "code",
                "id": "c",
                "execution_count": 8,
                "metadata": {},
                "outputs": [],
                "source": "### BEGIN SOLUTION\nx = 1\n### END SOLUTION",
            },
        ]
    )
    out = json.loads(release.release_notebook(text, "nb.ipynb", max_length=110))
    markdown, first, second = out["cells"]
    assert markdown["source"] == ["# Title\n", "text"]
    assert first["outputs"] == [] and first["execution_count"] is None
    assert first["metadata"] == {"tags": ["keep"]}
    assert first["source"] == [
        "def answer():\n",
        "    # hint: think\n",
        '    raise NotImplementedError("TODO: find it")\n',
        "\n",
        "\n",
        "answer()",
    ]
    assert second["source"] == 'raise NotImplementedError("TODO: your code here")'  # top level is fine here


def test_markers_outside_code_are_errors():
    text = make_notebook([{"cell_type": "markdown", "metadata": {}, "source": "### BEGIN SOLUTION\nx"}])
    with pytest.raises(release.ReleaseError, match=r"nb.ipynb \(cell 1\).*markdown"):
        release.release_notebook(text, "nb.ipynb", max_length=110)


def copy_tree(tmp_path: Path) -> Path:
    """A throwaway copy of what the release reads and writes."""
    root = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__", ".pytest_cache", ".ipynb_checkpoints")
    for name in ["solutions", "assignments", "notebooks", "grader"]:
        shutil.copytree(ROOT / name, root / name, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def run_release(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "grader", "release", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_committed_assignments_are_up_to_date():
    result = run_release("--check")
    assert result.returncode == 0, result.stderr


def test_release_is_deterministic(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    files = release.build(ROOT, first)
    assert files == release.build(ROOT, second)
    assert files, "nothing released"
    for relative in files:
        assert (first / relative).read_bytes() == (second / relative).read_bytes(), relative
        assert (first / relative).read_bytes() == (ROOT / "assignments" / relative).read_bytes(), relative


def test_check_names_stale_missing_and_extra_files(tmp_path):
    root = copy_tree(tmp_path)
    assert run_release("--root", str(root), "--check").returncode == 0

    with open(root / "solutions" / "a1_collectives" / "collectives.py", "a") as f:
        f.write("\n# an instructor's late edit\n")
    (root / "assignments" / "a1_collectives" / "test_a1_collectives.py").unlink()
    (root / "assignments" / "a1_collectives" / "notes.txt").write_text("left over")
    (root / "assignments" / "a1_collectives" / "__pycache__").mkdir()  # caches are ignored
    (root / "assignments" / "a1_collectives" / "__pycache__" / "x.pyc").write_bytes(b"")
    result = run_release("--root", str(root), "--check")
    assert result.returncode == 1
    assert "assignments/a1_collectives/collectives.py: differs" in result.stderr
    assert "assignments/a1_collectives/test_a1_collectives.py: missing" in result.stderr
    assert "assignments/a1_collectives/notes.txt: not generated" in result.stderr
    assert "__pycache__" not in result.stderr
    assert "python -m grader release" in result.stderr

    assert run_release("--root", str(root)).returncode == 0
    assert run_release("--root", str(root), "--check").returncode == 0
    assert not (root / "assignments" / "a1_collectives" / "notes.txt").exists()


def test_a_broken_solution_fails_the_release_and_touches_nothing(tmp_path):
    root = copy_tree(tmp_path)
    module = root / "solutions" / "a1_collectives" / "collectives.py"
    lines = module.read_text().splitlines(keepends=True)
    end = next(i for i, line in enumerate(lines) if line.strip() == "### END SOLUTION")
    module.write_text("".join(lines[:end] + lines[end + 1 :]))  # drop the first END marker
    before = (root / "assignments" / "a1_collectives" / "collectives.py").read_bytes()
    result = run_release("--root", str(root))
    assert result.returncode == 2
    assert "solutions/a1_collectives/collectives.py:" in result.stderr
    assert "cannot nest" in result.stderr
    assert (root / "assignments" / "a1_collectives" / "collectives.py").read_bytes() == before


def test_a_hidden_test_in_solutions_is_refused(tmp_path):
    root = copy_tree(tmp_path)
    shutil.copy(root / "grader" / "a1_collectives" / "test_hidden.py", root / "solutions" / "a1_collectives")
    result = run_release("--root", str(root))
    assert result.returncode == 2 and "hidden tests" in result.stderr


def region_lines(text: str) -> list[str]:
    """The non-trivial lines inside solution regions."""
    inside, lines = False, []
    for line in text.splitlines():
        if line.strip().startswith("### BEGIN SOLUTION"):
            inside = True
        elif line.strip() == "### END SOLUTION":
            inside = False
        elif inside and len(line.strip()) > 25:
            lines.append(line.rstrip())
    return lines


def test_no_solution_and_no_hidden_test_reaches_assignments():
    released = [p for p in (ROOT / "assignments").rglob("*") if p.is_file() and not release.is_skipped(p)]
    names = release.assignment_names(ROOT / "solutions")
    hidden_files = [p for name in names for p in (ROOT / "grader" / name).glob("*.py")]
    public_files = [p for name in names for p in (ROOT / "solutions" / name).glob("test_*.py")]

    def test_names(files):
        return {
            line.split("(")[0].removeprefix("def ")
            for p in files
            for line in p.read_text().splitlines()
            if line.startswith("def test_")
        }

    hidden_tests = {case.test_function for name in names for case in grade.load_assignment(name).cases(0)}
    hidden_only = hidden_tests - test_names(public_files)
    assert hidden_only, "no hidden tests found"
    hidden_names = {p.name for p in hidden_files} - {"__init__.py"}
    for path in released:
        text = path.read_text(errors="replace")
        assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text, path
        assert path.name not in hidden_names, path
        for test_name in hidden_only:
            assert test_name not in text, (path, test_name)

    # no line of a solution region (beyond trivial ones) survives in the released file
    for solution in (ROOT / "solutions").rglob("*"):
        if solution.relative_to(ROOT / "solutions").parts[0] == "lectures":
            continue  # released into notebooks/: tests/grader/test_release_lectures.py
        if solution.suffix == ".py":
            secret = region_lines(solution.read_text())
        elif solution.suffix == ".ipynb":
            cells = json.loads(solution.read_text())["cells"]
            secret = [line for cell in cells for line in region_lines("".join(cell["source"]))]
        else:
            continue
        released_text = (ROOT / "assignments" / solution.relative_to(ROOT / "solutions")).read_text()
        # a file the student hands in has something to write; helpers and tests may have nothing
        hand_in = importlib.import_module(f"grader.{solution.parent.name}").STUDENT_FILES
        assert secret or solution.name not in hand_in, solution
        released_lines = {line.strip() for line in released_text.splitlines()}
        if solution.suffix == ".ipynb":
            cells = json.loads(released_text)["cells"]
            released_lines = {line.strip() for cell in cells for line in "".join(cell["source"]).splitlines()}
        for line in secret:
            assert line.strip() not in released_lines, (solution, line)

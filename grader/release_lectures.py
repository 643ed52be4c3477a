"""Releasing the lectures: ``solutions/lectures/`` (solved) -> ``notebooks/`` (what students get).

A lecture's "Try it" is a function the student writes, followed by a *check cell*::

    def ring_reduce_scatter(comm, x):          # the exercise cell
        \"\"\"Contract, cost, hints (kept).\"\"\"
        ### BEGIN SOLUTION
        ...
        ### END SOLUTION

    with md.exercise("Try it 1: ..."):        # the check cell
        assert torch.equal(ring_reduce_scatter_on_4_ranks(), reference)

The release stubs each region (``raise NotImplementedError``, as for assignments) and keeps the
stored outputs of every other cell, so the student sees the lecture's plots and tables before
running anything. What it enforces, so that **Run All reaches the end** of every student copy:

* every region is inside a function body (a stub at the top level would stop the notebook);
  a ``%%writefile`` cell's module counts as code, so an exercise may be a module the ranks import;
* each function with a stub is used by a later check cell (``with md.exercise(...)``, which
  reports "not done yet" for a ``NotImplementedError`` instead of raising it), and by no other
  later cell: nothing after an exercise depends on the student's answer;
* the outputs of exercise and check cells are cleared (they would show the solved run).
"""

from __future__ import annotations

import ast
import filecmp
import json
import re
import shutil
import tempfile
from pathlib import Path

from .release import _ANY_MARKER_RE, ReleaseError, _as_source_list, stub_lines

LECTURES = "lectures"  # solutions/lectures/ -> notebooks/
CHECK_CELL_RE = re.compile(r"^[ \t]*with[ \t]+(?:md\.)?exercise\(", re.MULTILINE)
_MAGIC_RE = re.compile(r"^([ \t]*)[%!].*$")


def is_check_cell(source: str) -> bool:
    return bool(CHECK_CELL_RE.search(source))


def _as_python(lines: list[str]) -> list[str]:
    """A cell's lines as plain Python: a leading ``%%writefile`` dropped, line magics made ``pass``."""
    if lines and lines[0].startswith("%%writefile"):
        return ["", *lines[1:]]  # keep the line numbers
    return [_MAGIC_RE.sub(r"\1pass", line) for line in lines]


def stubbed_functions(stubbed: list[str], stubs: list[tuple[int, object]], where: str) -> set[str]:
    """The names of the top-level functions (or classes) whose bodies hold the stubs.

    Raises when a stub is not inside a function body: it would run when the cell runs."""
    try:
        tree = ast.parse("\n".join(_as_python(stubbed)), filename=where)
    except SyntaxError as error:
        raise ReleaseError(
            f"{where}: the stubbed cell does not parse ({error.msg}, line {error.lineno})"
        ) from None
    names: set[str] = set()
    for line, region in stubs:
        owner = None
        for top in tree.body:
            if not isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for node in ast.walk(top):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    sub.lineno == line
                    for statement in node.body
                    for sub in ast.walk(statement)
                    if isinstance(sub, ast.stmt)
                ):
                    owner = top.name
        if owner is None:
            raise ReleaseError(
                f"{where}: the solution region at line {region.begin} is not inside a function body; "
                "in a lecture an exercise is a function the student writes (its stub must not run "
                "when the cell runs, or Run All stops there)"
            )
        names.add(owner)
    return names


def _text(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def _uses(source: str, name: str) -> bool:
    """``name`` used as a name (not as an attribute: ``md.ring_allreduce`` is the library's)."""
    return re.search(rf"(?<![.\w]){re.escape(name)}\b", source) is not None


def release_lecture_notebook(text: str, where: str, max_length: int) -> str:
    """The student copy of a solved lecture notebook (see the module docstring)."""
    try:
        notebook = json.loads(text)
    except json.JSONDecodeError as error:
        raise ReleaseError(f"{where}: not a valid notebook (JSON error at line {error.lineno})") from None
    cells = notebook.get("cells", [])
    exercises: list[tuple[int, set[str]]] = []  # (cell number, function names)
    for index, cell in enumerate(cells, start=1):
        source_text = _text(cell)
        cell_where = f"{where} (cell {index})"
        if cell.get("cell_type") != "code":
            if _ANY_MARKER_RE.search(source_text):
                raise ReleaseError(f"{cell_where}: solution markers in a {cell.get('cell_type')} cell")
            continue
        out, stubs = stub_lines(source_text.split("\n"), cell_where, max_length)
        if stubs:
            exercises.append((index, stubbed_functions(out, stubs, cell_where)))
            source = cell.get("source", "")
            cell["source"] = _as_source_list(out) if isinstance(source, list) else "\n".join(out)
        if stubs or is_check_cell(source_text):
            cell["outputs"] = []
            cell["execution_count"] = None
            cell.get("metadata", {}).pop("execution", None)
    # what Run All sees: the student copy's text (a use inside a solution region is gone there)
    for number, names in exercises:
        for name in sorted(names):
            checked = False
            for later, cell in enumerate(cells[number:], start=number + 1):
                source_text = _text(cell)
                if cell.get("cell_type") != "code" or not _uses(source_text, name):
                    continue
                if not is_check_cell(source_text):
                    raise ReleaseError(
                        f"{where} (cell {later}): uses `{name}`, which the student writes in cell {number}; "
                        "no cell after an exercise may depend on the student's answer (use the library's "
                        "version here, or move this into the check cell `with md.exercise(...)`)"
                    )
                checked = True
            if not checked:
                raise ReleaseError(
                    f"{where} (cell {number}): the exercise `{name}` has no check cell after it "
                    '(a code cell `with md.exercise("..."):` that calls it)'
                )
    return json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def exercise_count(text: str) -> tuple[int, int]:
    """(exercises, check cells) of a released lecture notebook.

    An exercise is a top-level function or class with a stub in its body (a class whose
    ``__init__`` and ``forward`` are both stubbed is one exercise)."""
    notebook = json.loads(text)
    exercises = checks = 0
    for cell in notebook.get("cells", []):
        source = "".join(cell.get("source", ""))
        if cell.get("cell_type") != "code":
            continue
        checks += is_check_cell(source)
        if "raise NotImplementedError(" not in source:
            continue
        tree = ast.parse("\n".join(_as_python(source.split("\n"))))
        for top in tree.body:
            if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and any(
                isinstance(node, ast.Raise) and "NotImplementedError" in ast.unparse(node)
                for node in ast.walk(top)
            ):
                exercises += 1
    return exercises, checks


def build(root: Path, out: Path) -> list[Path]:
    """Release ``root/solutions/lectures`` into ``out`` (the future ``notebooks/``); the files written."""
    from . import release

    folder = root / "solutions" / LECTURES
    if not folder.is_dir():
        raise ReleaseError(f"{folder}: no such folder (the solved lecture notebooks)")
    max_length = release.line_length(root)
    written: list[Path] = []
    for relative in release.source_files(folder):
        where = f"solutions/{LECTURES}/{relative.as_posix()}"
        source = folder / relative
        if source.suffix == ".ipynb":
            data = release_lecture_notebook(source.read_text("utf-8"), where, max_length).encode("utf-8")
        else:
            data = release.release_file(source, where, max_length)
        if _ANY_MARKER_RE.search(data.decode("utf-8", errors="replace")):
            raise ReleaseError(f"{where}: solution marker text left in the released file")
        target = out / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        written.append(relative)
    return written


def check(root: Path, notebooks: Path) -> list[str]:
    """What is stale in ``notebooks`` (empty: up to date)."""
    from . import release

    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="grader-release-") as tmp:
        fresh = Path(tmp)
        expected = set(build(root, fresh))
        present = set(release.source_files(notebooks)) if notebooks.is_dir() else set()
        for relative in sorted(expected | present):
            shown = f"{notebooks.name}/{relative.as_posix()}"
            if relative not in present:
                problems.append(f"{shown}: missing")
            elif relative not in expected:
                problems.append(f"{shown}: not generated from solutions/{LECTURES}/ (delete it)")
            elif not filecmp.cmp(fresh / relative, notebooks / relative, shallow=False):
                problems.append(f"{shown}: differs from what solutions/{LECTURES}/{relative} generates")
    return problems


def write(root: Path, notebooks: Path) -> list[Path]:
    """Release into ``notebooks``, replacing what was there (it is generated, all of it)."""
    with tempfile.TemporaryDirectory(prefix="grader-release-") as tmp:
        fresh = Path(tmp) / "notebooks"
        written = build(root, fresh)  # all errors surface before anything is touched
        if notebooks.exists():
            shutil.rmtree(notebooks)
        shutil.copytree(fresh, notebooks)
    return written

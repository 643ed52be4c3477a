"""``python -m grader release``: generate ``assignments/`` from ``solutions/``.

``solutions/<name>/`` is the single source of an assignment. Releasing copies it to
``assignments/<name>/`` and replaces every solution region with a stub::

    def ring_allgather(comm, tensor):                def ring_allgather(comm, tensor):
        \"\"\"Docstring (kept).\"\"\"                        \"\"\"Docstring (kept).\"\"\"
        # TODO(task 2): hints (kept)                    # TODO(task 2): hints (kept)
        ### BEGIN SOLUTION TODO(task 2): write it       raise NotImplementedError("TODO(task 2): write it")
        out = ...                              -->
        return out
        ### END SOLUTION

The marker convention (nbgrader's markers, plus one addition):

* A region starts at a line that is exactly ``### BEGIN SOLUTION`` (after indentation),
  optionally followed by a message on the same line, and ends at the next line that is
  exactly ``### END SOLUTION``, at the same indentation. Regions do not nest.
* The region is replaced by ``raise NotImplementedError(<message>)`` at the indentation of
  the BEGIN line; without a message the stub says ``"TODO: your code here"``. Put the hints
  *before* the BEGIN line, as comments: they are kept.
* In ``.py`` files a region must be inside a function body, so that the stubbed module
  still imports. In notebooks, regions may be in any code cell.
* Files: ``.py`` modules are stubbed; ``.ipynb`` notebooks get their solution regions
  stubbed in code cells, and their outputs and execution counts cleared; any other file is
  copied as it is, and must not contain a marker. Caches (``__pycache__``,
  ``.ipynb_checkpoints``, ...) and hidden files are skipped.

The result is deterministic: releasing twice writes the same bytes. ``--check`` releases
into a temporary folder and compares it with ``assignments/``; it exits with status 1 and
lists the stale files when they differ (CI runs it).
"""

from __future__ import annotations

import argparse
import ast
import filecmp
import json
import re
import shutil
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
DEFAULT_MESSAGE = "TODO: your code here"
_BEGIN_RE = re.compile(r"^(?P<indent>[ \t]*)### BEGIN SOLUTION(?:[ \t]+(?P<message>.*?))?[ \t]*$")
_END_RE = re.compile(r"^(?P<indent>[ \t]*)### END SOLUTION[ \t]*$")
_ANY_MARKER_RE = re.compile(r"(BEGIN|END) SOLUTION")

#: names never copied from solutions/ (and ignored when comparing with assignments/)
SKIPPED_NAMES = {"__pycache__", ".ipynb_checkpoints", ".pytest_cache", ".ruff_cache", ".DS_Store"}
SKIPPED_SUFFIXES = (".pyc", ".pyo")


class ReleaseError(Exception):
    """A problem in solutions/ that stops the release; the message names file and line."""


@dataclass(frozen=True)
class Region:
    begin: int  # 1-based line number of the BEGIN marker
    end: int  # 1-based line number of the END marker
    indent: str
    message: str


def line_length(root: Path = ROOT) -> int:
    """ruff's line length from pyproject.toml: stubs must pass ``ruff format --check`` too."""
    try:
        config = tomllib.loads((root / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        config = {}
    return int(config.get("tool", {}).get("ruff", {}).get("line-length", 88))


# --- stubbing text -----------------------------------------------------------------------
def find_regions(lines: list[str], where: str) -> list[Region]:
    """The solution regions of ``lines`` (without line endings); ``where`` names the file for errors."""
    regions: list[Region] = []
    open_at: int | None = None
    indent = message = ""
    for number, line in enumerate(lines, start=1):
        begin, end = _BEGIN_RE.match(line), _END_RE.match(line)
        if begin:
            if open_at is not None:
                raise ReleaseError(
                    f"{where}:{number}: '{BEGIN}' inside the region opened at line {open_at}: "
                    "regions cannot nest (close the first one with "
                    f"'{END}' before opening another)"
                )
            open_at, indent = number, begin["indent"]
            message = begin["message"] or DEFAULT_MESSAGE
        elif end:
            if open_at is None:
                raise ReleaseError(f"{where}:{number}: '{END}' without a '{BEGIN}' before it")
            if end["indent"] != indent:
                raise ReleaseError(
                    f"{where}:{number}: '{END}' is indented differently from the '{BEGIN}' "
                    f"at line {open_at}: put both at the indentation of the code they enclose"
                )
            regions.append(Region(open_at, number, indent, message))
            open_at = None
        elif _ANY_MARKER_RE.search(line):
            raise ReleaseError(
                f"{where}:{number}: a malformed solution marker: {line.strip()!r}. A marker is a line "
                f"of its own, exactly '{BEGIN}' (optionally followed by the stub's message) or '{END}'"
            )
    if open_at is not None:
        raise ReleaseError(f"{where}:{open_at}: '{BEGIN}' is never closed by '{END}'")
    return regions


def stub_statement(region: Region, max_length: int, where: str) -> list[str]:
    """``raise NotImplementedError("...")``, laid out the way ``ruff format`` would."""
    message = region.message
    if "\\" in message or any(ord(ch) < 32 for ch in message):
        raise ReleaseError(f"{where}:{region.begin}: the stub message must not contain backslashes")
    if '"' in message and "'" not in message:
        literal = f"'{message}'"
    elif '"' in message:
        raise ReleaseError(f"{where}:{region.begin}: the stub message must not contain both quote kinds")
    else:
        literal = f'"{message}"'
    one_line = f"{region.indent}raise NotImplementedError({literal})"
    if len(one_line) <= max_length:
        return [one_line]
    inner = f"{region.indent}    {literal}"
    if len(inner) > max_length:
        raise ReleaseError(
            f"{where}:{region.begin}: the stub message is too long for a line of {max_length} "
            "characters: shorten the text after the BEGIN marker"
        )
    return [f"{region.indent}raise NotImplementedError(", inner, f"{region.indent})"]


def stub_lines(lines: list[str], where: str, max_length: int) -> tuple[list[str], list[tuple[int, Region]]]:
    """Replace each region by its stub. Returns the new lines and, per region, the stub's line number."""
    regions = find_regions(lines, where)
    out: list[str] = []
    stubs: list[tuple[int, Region]] = []
    position = 0
    for region in regions:
        out.extend(lines[position : region.begin - 1])
        stubs.append((len(out) + 1, region))
        out.extend(stub_statement(region, max_length, where))
        position = region.end
    out.extend(lines[position:])
    return out, stubs


def _split_keeping_newline(text: str) -> tuple[list[str], str]:
    """Lines without their endings, and the ending the text uses ("\\n" or "\\r\\n")."""
    newline = "\r\n" if "\r\n" in text else "\n"
    return text.split(newline), newline


def release_python(text: str, where: str, max_length: int) -> str:
    """Stub a Python module; check that the result still imports (no region outside a function)."""
    lines, newline = _split_keeping_newline(text)
    out, stubs = stub_lines(lines, where, max_length)  # marker errors first: they name the line
    try:
        ast.parse(text, filename=where)
    except SyntaxError as error:
        raise ReleaseError(f"{where}:{error.lineno}: the solution does not parse: {error.msg}") from None
    result = newline.join(out)
    if not stubs:
        return result
    try:
        tree = ast.parse(result, filename=where)
    except SyntaxError as error:
        raise ReleaseError(
            f"{where}: the stubbed module does not parse ({error.msg}, line {error.lineno} of the stub); "
            "does a region enclose only part of a statement?"
        ) from None
    in_function = _lines_inside_function_bodies(tree)
    for line, region in stubs:
        if line not in in_function:
            raise ReleaseError(
                f"{where}:{region.begin}: this solution region is not inside a function body; its stub "
                "(raise NotImplementedError) would run when the module is imported. Move the code into "
                "a function, or out of the region."
            )
    return result


def _lines_inside_function_bodies(tree: ast.AST) -> set[int]:
    """Line numbers of statements that run only when some function is called."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for statement in node.body:
                inside.update(sub.lineno for sub in ast.walk(statement) if isinstance(sub, ast.stmt))
    return inside


def release_notebook(text: str, where: str, max_length: int) -> str:
    """Clear outputs and execution counts; stub solution regions in code cells."""
    try:
        notebook = json.loads(text)
    except json.JSONDecodeError as error:
        raise ReleaseError(f"{where}: not a valid notebook (JSON error at line {error.lineno})") from None
    for index, cell in enumerate(notebook.get("cells", []), start=1):
        source = cell.get("source", "")
        source_text = "".join(source) if isinstance(source, list) else source
        cell_where = f"{where} (cell {index})"
        if cell.get("cell_type") != "code":
            if _ANY_MARKER_RE.search(source_text):
                raise ReleaseError(
                    f"{cell_where}: solution markers in a {cell.get('cell_type')} cell; "
                    "regions are supported only in code cells"
                )
            continue
        lines = source_text.split("\n")
        out, stubs = stub_lines(lines, cell_where, max_length)
        if stubs:
            cell["source"] = _as_source_list(out) if isinstance(source, list) else "\n".join(out)
        cell["outputs"] = []
        cell["execution_count"] = None
        cell.get("metadata", {}).pop("execution", None)  # JupyterLab's timing record
    return json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def _as_source_list(lines: list[str]) -> list[str]:
    """nbformat's list form: every line but the last keeps its newline."""
    return [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def release_file(source: Path, where: str, max_length: int) -> bytes:
    """The released bytes of one file of solutions/."""
    data = source.read_bytes()
    if source.suffix == ".py":
        return release_python(data.decode("utf-8"), where, max_length).encode("utf-8")
    if source.suffix == ".ipynb":
        return release_notebook(data.decode("utf-8"), where, max_length).encode("utf-8")
    text = data.decode("utf-8", errors="replace")
    marker = _ANY_MARKER_RE.search(text)
    if marker:
        line = text[: marker.start()].count("\n") + 1
        raise ReleaseError(
            f"{where}:{line}: solution markers in a {source.suffix or 'plain'} file: regions are "
            "supported only in .py files and in notebook code cells"
        )
    return data


# --- the release -------------------------------------------------------------------------
def is_skipped(path: Path) -> bool:
    return path.name in SKIPPED_NAMES or path.name.startswith(".") or path.name.endswith(SKIPPED_SUFFIXES)


def source_files(folder: Path) -> list[Path]:
    """Files of an assignment folder, relative, sorted, caches and hidden files left out."""
    found: list[Path] = []

    def walk(directory: Path) -> None:
        for entry in sorted(directory.iterdir()):
            if is_skipped(entry):
                continue
            if entry.is_dir():
                walk(entry)
            elif entry.is_file():
                found.append(entry.relative_to(folder))

    walk(folder)
    return found


def assignment_names(solutions: Path) -> list[str]:
    """Every folder of solutions/ is an assignment, but ``lectures/`` (released into notebooks/)."""
    if not solutions.is_dir():
        raise ReleaseError(f"{solutions}: no such folder")
    return sorted(
        p.name for p in solutions.iterdir() if p.is_dir() and not is_skipped(p) and p.name != "lectures"
    )


def build(root: Path, out: Path, names: list[str] | None = None) -> list[Path]:
    """Release the assignments of ``root/solutions`` into ``out``; return the files written."""
    solutions = root / "solutions"
    names = assignment_names(solutions) if names is None else names
    max_length = line_length(root)
    written: list[Path] = []
    for name in names:
        folder = solutions / name
        if not folder.is_dir():
            raise ReleaseError(f"{folder}: no such assignment")
        # the grader's files of this assignment (hidden tests, cases, references) never reach students
        hidden = {p.name for p in (root / "grader" / name).glob("*.py")} - {"__init__.py"}
        for relative in source_files(folder):
            where = f"solutions/{name}/{relative.as_posix()}"
            if relative.name in hidden:
                raise ReleaseError(
                    f"{where}: grader/{name}/ has a file of this name (hidden tests, cases or references); "
                    "it must not be released to students (rename one of them)"
                )
            data = release_file(folder / relative, where, max_length)
            if _ANY_MARKER_RE.search(data.decode("utf-8", errors="replace")):  # belt and braces
                raise ReleaseError(f"{where}: solution marker text left in the released file")
            target = out / name / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            written.append(target.relative_to(out))
    return written


def existing_files(out: Path, names: list[str]) -> list[Path]:
    files: list[Path] = []
    for name in names:
        if (out / name).is_dir():
            files += [Path(name) / f for f in source_files(out / name)]
    return files


def check(root: Path, assignments: Path, names: list[str] | None = None) -> list[str]:
    """What is stale in ``assignments`` (empty: up to date)."""
    names = assignment_names(root / "solutions") if names is None else names
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="grader-release-") as tmp:
        fresh = Path(tmp)
        expected = set(build(root, fresh, names))
        present = set(existing_files(assignments, names))
        for relative in sorted(expected | present):
            shown = f"{assignments.name}/{relative.as_posix()}"
            if relative not in present:
                problems.append(f"{shown}: missing")
            elif relative not in expected:
                problems.append(f"{shown}: not generated from solutions/ (delete it)")
            elif not filecmp.cmp(fresh / relative, assignments / relative, shallow=False):
                problems.append(f"{shown}: differs from what solutions/{relative.as_posix()} generates")
    if assignments.is_dir():
        known = set(assignment_names(root / "solutions"))
        for folder in sorted(p for p in assignments.iterdir() if p.is_dir() and not is_skipped(p)):
            if folder.name not in known:
                problems.append(f"{assignments.name}/{folder.name}/: no such assignment in solutions/")
    return problems


def write(root: Path, assignments: Path, names: list[str] | None = None) -> list[Path]:
    """Release into ``assignments``, removing files the release no longer produces."""
    names = assignment_names(root / "solutions") if names is None else names
    with tempfile.TemporaryDirectory(prefix="grader-release-") as tmp:
        fresh = Path(tmp)
        written = build(root, fresh, names)  # all errors surface before anything is touched
        for name in names:
            target = assignments / name
            if target.exists():
                shutil.rmtree(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            if (fresh / name).exists():
                shutil.copytree(fresh / name, target)
    return written


# --- command line ------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "assignments",
        nargs="*",
        metavar="ASSIGNMENT",
        help="default: all of solutions/ ('lectures': the lecture notebooks, released into notebooks/)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 and list the stale files if the output differs from a fresh release",
    )
    parser.add_argument("--root", type=Path, default=ROOT, help="course repository (default: this one)")
    parser.add_argument(
        "--assignments-dir",
        dest="out",
        type=Path,
        default=None,
        help="where the generated assignments go (default: ROOT/assignments)",
    )
    parser.add_argument(
        "--out",
        "--repo",
        dest="repo",
        type=Path,
        default=None,
        metavar="DIR",
        help="instead: build the whole repository students receive into DIR (no solutions/, no grader/)",
    )


def main(args: argparse.Namespace) -> int:
    root = args.root.resolve()
    if args.repo is not None:
        from . import student_repo

        try:
            written = student_repo.build(root, args.repo.resolve())
        except ReleaseError as error:
            print(f"release failed: {error}", file=sys.stderr)
            return 2
        print(f"wrote the student repository ({len(written)} files) into {args.repo}")
        return 0
    out = (args.out or root / "assignments").resolve()
    names = args.assignments or None
    lectures = names is None or "lectures" in names  # `release lectures` alone: only notebooks/
    names = None if names is None else [n for n in names if n != "lectures"]
    assignments = names is None or bool(names)
    notebooks = root / "notebooks"
    from . import release_lectures

    try:
        if args.check:
            problems = check(root, out, names) if assignments else []
            if lectures:
                problems += release_lectures.check(root, notebooks)
            if problems:
                print("out of date with solutions/:", file=sys.stderr)
                for problem in problems:
                    print(f"  {problem}", file=sys.stderr)
                print("run `python -m grader release` and commit the result", file=sys.stderr)
                return 1
            checked = [n for n, on in ((out.name, assignments), ("notebooks", lectures)) if on]
            print("up to date: " + ", ".join(checked))
            return 0
        written = write(root, out, names) if assignments else []
        lecture_files = release_lectures.write(root, notebooks) if lectures else []
    except ReleaseError as error:
        print(f"release failed: {error}", file=sys.stderr)
        return 2
    if assignments:
        print(f"released {len(written)} files into {out}")
    if lectures:
        print(f"released {len(lecture_files)} files into {notebooks}")
    if assignments:
        known = set(assignment_names(root / "solutions"))
        for folder in sorted(p for p in out.iterdir() if p.is_dir() and not is_skipped(p)):
            if folder.name not in known:
                print(
                    f"warning: {folder} has no source in solutions/; delete it if it is obsolete",
                    file=sys.stderr,
                )
    return 0

"""The course's Markdown: every relative link reaches a file (and a heading), and the README stays short.

A link is checked the way GitHub renders it: relative to the file that holds it; ``path#anchor``
into a Markdown file must name one of that file's headings, turned into an anchor by GitHub's rule
(lower case, punctuation dropped except ``-`` and ``_``, spaces to ``-``, ``-1``, ``-2`` ... for
repeats). Links inside code (fenced blocks, inline code) are text, not links. Pure file reading:
no subprocess, well under a second.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from grader import release
from grader.student_repo import student_readme

ROOT = Path(__file__).resolve().parents[2]
README_LIMIT_BYTES = 15_000
# generated or ignored folders (.gitignore) that may hold Markdown nobody commits
SKIPPED_DIRS = {
    "__pycache__",
    "build",
    "dist",
    "bench-results",
    "grader-results",
    "browser-artifacts",
    "node_modules",
}
# what a student repository (``python -m grader release --out``) leaves out: links must not lead there
NOT_IN_STUDENT_REPO = ("solutions", "grader", "tests/grader")

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target "title") and ![alt](target); the text may hold one level of brackets
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)"
)
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_LINK = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
ATX_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SETEXT_UNDERLINE = re.compile(r"^\s{0,3}(=+|-+)\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files() -> list[Path]:
    """Every ``*.md`` of the repository, hidden folders (``.venv``, ``.git``) and build outputs left out."""
    found: list[Path] = []
    for directory, subdirs, files in os.walk(ROOT):
        subdirs[:] = sorted(
            d
            for d in subdirs
            if not d.startswith(".") and d not in SKIPPED_DIRS and not d.endswith(".egg-info")
        )
        found += [Path(directory) / name for name in sorted(files) if name.endswith(".md")]
    return found


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code spans blanked."""
    lines, inside = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            lines.append((number, CODE_SPAN.sub(lambda m: "x" * len(m.group(0)), line)))
    return lines


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link and image in the prose of a Markdown text."""
    found = []
    for number, line in prose_lines(text):
        targets = [m.group(1) for m in INLINE_LINK.finditer(line)] + [
            m.group(1) for m in HTML_LINK.finditer(line)
        ]
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            targets.append(definition.group(1))
        found += [(number, target.strip("<>")) for target in targets]
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before repeats get their ``-N``)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()  # HTML tags
    return "".join(ch for ch in text if ch.isalnum() or ch in "-_ ").replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown text (repeats numbered -1, -2, ...)."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    previous = ""
    inside = False
    for line in text.splitlines():
        if FENCE.match(line):
            inside, previous = not inside, ""
            continue
        if inside:
            continue
        heading = ATX_HEADING.match(line)
        title = heading.group(2) if heading else None
        if (
            title is None
            and SETEXT_UNDERLINE.match(line)
            and previous.strip()
            and not previous.lstrip().startswith("|")
        ):
            title = previous.strip()
        if title is not None:
            base = slug(title)
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
        previous = line
    return found


_anchor_cache: dict[Path, set[str]] = {}


def anchors_of(path: Path) -> set[str]:
    if path not in _anchor_cache:
        _anchor_cache[path] = anchors(path.read_text(encoding="utf-8"))
    return _anchor_cache[path]


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the relative links of one Markdown file (empty: nothing)."""
    text = path.read_text(encoding="utf-8")
    where = path.relative_to(root).as_posix()
    problems = []
    for number, target in links(text):
        if SCHEME.match(target) or target.startswith("//"):
            continue  # a URL (https:, mailto:): not checked offline
        file_part, _, anchor = target.partition("#")
        file_part = unquote(file_part.split("?")[0])
        resolved = path if not file_part else (path.parent / file_part).resolve()
        if not resolved.exists():
            problems.append(f"{where}:{number}: {target}: no such file ({os.path.relpath(resolved, root)})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors_of(resolved):
            shown = resolved.relative_to(root).as_posix()
            problems.append(f"{where}:{number}: {target}: {shown} has no heading with the anchor #{anchor}")
    return problems


MARKDOWN = markdown_files()


def test_the_markdown_files_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in MARKDOWN}
    assert {
        "README.md",
        "grader/README.md",
        "tests/README.md",
        "docs/library.md",
        "docs/benchmarks.md",
    } <= names
    assert not any(name.startswith((".venv/", ".git/")) for name in names)


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_reaches_a_file_and_a_heading(path):
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_assignment_has_a_readme_in_solutions_and_assignments():
    names = release.assignment_names(ROOT / "solutions")  # every folder but lectures/
    assert names, "no assignment in solutions/"
    for name in names:
        assert (ROOT / "solutions" / name / "README.md").is_file(), name
        assert (ROOT / "assignments" / name / "README.md").is_file(), name


def test_what_students_receive_links_only_to_what_they_receive():
    """The student repository has no solutions/ or grader/: its README (without the instructors'
    section), docs/ and the assignments' READMEs must not link there."""
    excluded = [(ROOT / folder).resolve() for folder in NOT_IN_STUDENT_REPO]
    problems = []
    for path in MARKDOWN:
        relative = path.relative_to(ROOT)
        if relative.parts[0] in ("solutions", "grader") or relative.as_posix().startswith("tests/grader/"):
            continue
        text = path.read_text(encoding="utf-8")
        if relative.as_posix() == "README.md":
            text = student_readme(text)
        for number, target in links(text):
            if SCHEME.match(target) or target.startswith("//") or target.startswith("#"):
                continue
            resolved = (path.parent / unquote(target.partition("#")[0])).resolve()
            if any(resolved == folder or folder in resolved.parents for folder in excluded):
                problems.append(f"{relative.as_posix()}:{number}: {target}")
    assert not problems, "links to what a student repository leaves out:\n" + "\n".join(problems)


def test_the_readme_is_short():
    size = (ROOT / "README.md").stat().st_size
    assert size < README_LIMIT_BYTES, (
        f"README.md is {size:,} bytes; keep it under {README_LIMIT_BYTES:,} (move detail to docs/)"
    )


# --- the checker itself ---------------------------------------------------------------------
def test_slugs_follow_githubs_rule():
    assert slug("Lecture 9's measurements") == "lecture-9s-measurements"
    assert (
        slug("The course in a real browser (`make test-browser`)")
        == "the-course-in-a-real-browser-make-test-browser"
    )
    assert slug("Quantization from scratch (`minidist.quant`)") == "quantization-from-scratch-minidistquant"
    assert slug("a_b - c") == "a_b---c"
    assert slug("See [the docs](docs/x.md)!") == "see-the-docs"
    assert anchors("# A\n## A\n```\n# not a heading\n```\nB\n---\n") == {"a", "a-1", "b"}


def test_the_checker_finds_broken_links_and_ignores_code(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text("# Real heading\n")
    page = tmp_path / "page.md"
    text = (
        "[ok](docs/x.md#real-heading) [dir](docs/) [url](https://example.com) [self](#top)\n"
        "# Top\n"
        "[missing](docs/y.md) [bad anchor](docs/x.md#nope) ![image](img.png)\n"
        "`[in code](nowhere.md)`\n"
        "```\n[in a fence](nowhere.md)\n```\n"
        "[ref]: docs/gone.md\n"
    )
    page.write_text(text)
    _anchor_cache.clear()
    problems = broken_links(page, root=tmp_path)
    _anchor_cache.clear()
    assert [p.split(": ")[1] for p in problems] == [
        "docs/y.md",
        "docs/x.md#nope",
        "img.png",
        "docs/gone.md",
    ], problems

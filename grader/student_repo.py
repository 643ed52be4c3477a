"""``python -m grader release --out DIR``: the repository students receive.

Everything git tracks, except what students must not see or cannot use:

* ``solutions/`` and ``grader/`` (hidden tests, the grading pipeline, its examples);
* the tests of those (``tests/grader/``, ``tests/course/test_assignments.py``);
* the instructors' parts of ``README.md`` and the Makefile targets that need ``grader/``.

``assignments/`` and ``notebooks/`` are released fresh from ``solutions/`` (not copied), any other ``.py`` or
``.ipynb`` file with solution regions (library code that would answer an assignment) is
stubbed the same way, and the result is checked: no solution marker text may remain anywhere.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from . import release, release_lectures

EXCLUDED_DIRS = ("solutions/", "grader/", "tests/grader/", "assignments/", "notebooks/")
EXCLUDED_FILES = re.compile(r"^tests/course/test_assignments\.py$")
_MARKER = re.compile(r"(BEGIN|END) SOLUTION")


def tracked_files(root: Path) -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    return sorted(name for name in listed.decode().split("\0") if name)


def student_readme(text: str) -> str:
    """The README without its "Instructors" section (it points at ``grader/``, which students lack)."""
    start = text.find("\n## Instructors\n")
    if start < 0:
        return text
    end = text.find("\n## ", start + 1)
    return text[:start] + (text[end:] if end >= 0 else "\n")


def student_makefile(text: str) -> str:
    """The Makefile without the targets that run the grader."""
    text = text.replace("test: lint release-check", "test: lint")
    text = text.replace("check: lint release-check", "check: lint")
    # pytest paths: no solutions/ there; the student copies of the lectures run to the end (their
    # exercises unsolved, so their check cells print "not done yet" instead of the stored output)
    lax = "notebooks $(NBVAL) --nbval-lax"
    text = text.replace("$(PYTEST) tests solutions $(NBVAL)", f"$(PYTEST) tests {lax}")
    text = text.replace("$(PYTEST) solutions $(NBVAL)", f"$(PYTEST) {lax}")
    text = re.sub(r"(?m)^\t@echo \"make (release|grade) .*\n", "", text)
    text = re.sub(r"(?ms)^# assignments/ is generated.*?(?=^format:)", "", text)
    text = text.replace(" release release-check grade", "")
    return text


def build(root: Path, out: Path) -> list[Path]:
    """Write the student repository into ``out`` (which must not exist or be empty)."""
    if out.exists() and any(out.iterdir()):
        raise release.ReleaseError(f"{out}: not empty; give a new folder")
    max_length = release.line_length(root)
    written: list[Path] = []
    for name in tracked_files(root):
        if name.startswith(EXCLUDED_DIRS) or EXCLUDED_FILES.match(name) or not (root / name).is_file():
            continue
        source, target = root / name, out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if name == "README.md":
            target.write_text(student_readme(source.read_text()))
        elif name == "Makefile":
            target.write_text(student_makefile(source.read_text()))
        elif source.suffix in (".py", ".ipynb") and _MARKER.search(source.read_text(errors="replace")):
            target.write_bytes(release.release_file(source, name, max_length))
        else:
            shutil.copy2(source, target)
        written.append(target)
    written += [out / "assignments" / p for p in release.build(root, out / "assignments")]
    written += [out / "notebooks" / p for p in release_lectures.build(root, out / "notebooks")]
    leaks = [p for p in written if _MARKER.search(p.read_text(errors="replace"))]
    if leaks:
        raise release.ReleaseError(f"solution marker text left in {[str(p.relative_to(out)) for p in leaks]}")
    return written

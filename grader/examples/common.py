"""What every ``grader/examples/*`` module shares: writing submissions out and its command line.

Each example module builds its students as ``{student id: {file name: bytes}}`` (a folder) or
``{student id: bytes}`` (a file, e.g. a ``.zip``), and is run as
``python -m grader.examples.<module> OUT [--bad]``. The writing and the command line are the
same for all of them, so they live here once.
"""

from __future__ import annotations

import argparse
import io
import zipfile
from collections.abc import Callable
from pathlib import Path

Submissions = dict[str, dict[str, bytes] | bytes]


def zip_bytes(files: dict[str, bytes]) -> bytes:
    """``files`` ({name inside the archive: content}) as the bytes of a deflated zip, sorted by name."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in sorted(files.items()):
            archive.writestr(name, data)
    return buffer.getvalue()


def write(out: Path, submissions: Submissions) -> list[Path]:
    """Write each submission into ``out`` (a folder of files, or one file); the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in submissions.items():
        target = out / name
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            for file, data in content.items():
                (target / file).parent.mkdir(parents=True, exist_ok=True)
                (target / file).write_bytes(data)
        written.append(target)
    return written


def edit(source: str, old: str, new: str) -> str:
    """``source`` with ``old`` (which must occur exactly once) replaced by ``new``.

    Examples are edits of the solutions; when a solution changes so that an edit no longer
    applies, this says which, instead of silently writing an unchanged (correct) student.
    """
    if source.count(old) != 1:
        raise ValueError(f"the solution changed: {old!r} occurs {source.count(old)} times")
    return source.replace(old, new)


def main(doc: str | None, build: Callable[..., list[Path]], bad: bool = False) -> None:
    """The command line of an example module: ``OUT`` (and ``--bad`` when ``bad``), then ``build``.

    ``doc`` is the module's docstring (its first paragraph is the help text); ``build(out)`` (or
    ``build(out, bad=...)``) writes the submissions.
    """
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder to write the submissions into")
    if bad:
        parser.add_argument("--bad", action="store_true", help="also the hostile and broken cases")
    args = parser.parse_args()
    written = build(args.out, bad=args.bad) if bad else build(args.out)
    print(f"wrote {len(written)} submissions into {args.out}")

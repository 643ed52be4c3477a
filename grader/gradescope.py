"""``python -m grader gradescope ASSIGNMENT --out DIR``: a Gradescope autograder zip.

Gradescope unpacks the zip into ``/autograder/source``, runs ``setup.sh`` once to build the
image, then for each submission runs ``run_autograder``, which must leave
``/autograder/results/results.json``. Ours grades ``/autograder/submission`` with the very
same ``python -m grader grade`` (one submission, the student id ``submission``) and copies its
``results.json``, already in Gradescope's schema, into place.

The zip holds the course library (``lib/``, ``pyproject.toml``), the grader package with this
assignment's hidden tests only, and the solution of no assignment. Gradescope's containers
run as root but may refuse mount namespaces; the grader then says so and runs the submission
without them (limits, a session, and the trusted checks still apply).
"""

from __future__ import annotations

import argparse
import io
import tomllib
import zipfile
from pathlib import Path

from .release import ROOT, is_skipped

GRADER_MODULES = (
    "__init__.py",
    "__main__.py",
    "assignment.py",
    "ast_lock.py",
    "conftest.py",
    "grade.py",
    "forbidden.py",
    "gradescope.py",
    "guard.py",
    "harness.py",
    "instruments.py",
    "intake.py",
    "plan.py",
    "points.py",
    "release.py",
    "report.py",
    "sandbox.py",
    "similarity.py",
    "stubs.py",
    "student_comm.py",
    "seeding.py",
    "text.py",
    "tiers.py",
    "tree.py",
    "cgroups.py",
    "wire.py",
)

SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once, as root, to build the autograder image.
set -euo pipefail
cd /autograder/source
apt-get update -qq && apt-get install -y -qq python3 python3-venv python3-pip > /dev/null
python3 -m venv /autograder/venv
/autograder/venv/bin/pip install -q --upgrade pip
/autograder/venv/bin/pip install -q --index-url https://download.pytorch.org/whl/cpu "torch=={torch}"
/autograder/venv/bin/pip install -q -e . "pytest==9.2.0"
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for each submission: grade /autograder/submission, write results.json.
set -uo pipefail
cd /autograder/source
rm -rf /autograder/work && mkdir -p /autograder/work/submissions /autograder/results
cp -r /autograder/submission /autograder/work/submissions/submission
# The seed key goes through a file only root can read, never the command line (/proc/*/cmdline).
key_file=/autograder/work/seed-key
(umask 077 && printf '%s' "${{GRADER_SEED_KEY:-gradescope}}" > "$key_file")
/autograder/venv/bin/python -m grader grade {assignment} /autograder/work/submissions \\
    --out /autograder/work/out --timeout {timeout:g} --seed-key-file "$key_file"
cp /autograder/work/out/submission/results.json /autograder/results/results.json
"""


def bundle(assignment: str, timeout: float = 600.0) -> bytes:
    """The autograder zip's bytes (deterministic: fixed timestamps, sorted members)."""
    hidden = ROOT / "grader" / assignment
    if not (hidden / "grading.py").is_file():
        raise SystemExit(f"gradescope: grader/{assignment}/grading.py not found")
    torch = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["minidist"]["torch"]
    members: dict[str, tuple[bytes, int]] = {
        "setup.sh": (SETUP_SH.format(torch=torch).encode(), 0o755),
        "run_autograder": (RUN_AUTOGRADER.format(assignment=assignment, timeout=timeout).encode(), 0o755),
        "pyproject.toml": ((ROOT / "pyproject.toml").read_bytes(), 0o644),
        "README.md": ((ROOT / "README.md").read_bytes(), 0o644),
    }
    for path in sorted((ROOT / "lib").rglob("*")):
        if path.is_file() and not any(is_skipped(Path(part)) for part in path.relative_to(ROOT).parts):
            members[path.relative_to(ROOT).as_posix()] = (path.read_bytes(), 0o644)
    for name in GRADER_MODULES:
        members[f"grader/{name}"] = ((ROOT / "grader" / name).read_bytes(), 0o644)
    for path in sorted(hidden.iterdir()):
        if path.is_file() and not is_skipped(path):
            members[f"grader/{assignment}/{path.name}"] = (path.read_bytes(), 0o644)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in sorted(members):
            data, mode = members[name]
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    return buffer.getvalue()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("assignment", metavar="ASSIGNMENT")
    parser.add_argument("--out", type=Path, required=True, help="folder for <ASSIGNMENT>-autograder.zip")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per submission (default 600)")


def main(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / f"{args.assignment}-autograder.zip"
    target.write_bytes(bundle(args.assignment, args.timeout))
    print(f"wrote {target}: upload it as the assignment's autograder (Configure Autograder -> Zip file)")
    return 0

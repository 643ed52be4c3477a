"""``python -m grader release --out DIR``: the student repository holds no solution and still works."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOLUTION_LINE = "exchange(comm, chunk((rank - step) % p), right, chunk((rank - step - 1) % p), left)"


@pytest.mark.timeout(900)
def test_the_student_repository_has_no_solution_and_its_public_tests_fail_cleanly(tmp_path):
    repo = tmp_path / "student"
    subprocess.run(
        [sys.executable, "-m", "grader", "release", "--out", str(repo)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    files = [p for p in repo.rglob("*") if p.is_file()]
    names = {p.relative_to(repo).as_posix() for p in files}
    assert {"README.md", "Makefile", "pyproject.toml", "lib/minidist/launch/__init__.py"} <= names
    assert "assignments/a1_collectives/collectives.py" in names
    assert not any(n.startswith(("solutions/", "grader/")) or "test_hidden" in n for n in names)
    assert SOLUTION_LINE in (ROOT / "solutions/a1_collectives/collectives.py").read_text()
    for path in files:
        text = path.read_text(errors="replace")
        assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text, path
        assert SOLUTION_LINE not in text, path
    # the Makefile still parses and no longer needs the grader
    dry_run = subprocess.run(["make", "-n", "test"], cwd=repo, capture_output=True, text=True, timeout=60)
    assert dry_run.returncode == 0 and "grader" not in dry_run.stdout, dry_run.stdout + dry_run.stderr
    assert "tests notebooks --nbval" in dry_run.stdout and "--nbval-lax" in dry_run.stdout, dry_run.stdout
    assert "notebooks/05_bert_data_parallel.ipynb" in names and "notebooks/lecture05/hooks.py" in names
    # it installs with its own setup command (a fresh .venv inside it) ... without byte-compiling
    # the ~11,000 installed modules (PIP_COMPILE=0, pip's --no-compile: about 25 of the ~60
    # CPU-seconds of the install, measured); what is imported below is compiled when imported.
    setup = subprocess.run(
        ["make", "setup"],
        cwd=repo,
        env={**os.environ, "PIP_COMPILE": "0"},
        capture_output=True,
        text=True,
        timeout=700,
    )
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    python = repo / ".venv" / "bin" / "python"
    where = subprocess.run(
        [str(python), "-c", "import minidist; print(minidist.__file__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert where.stdout.strip().startswith(str(repo / "lib")), where.stdout + where.stderr
    # ... and its public tests fail cleanly, with NotImplementedError, not with an import error
    folder = repo / "assignments" / "a1_collectives"
    result = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "test_a1_collectives.py"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert result.returncode == 1, result.stdout[-3000:]
    assert "NotImplementedError" in result.stdout and "ImportError" not in result.stdout, result.stdout[
        -3000:
    ]

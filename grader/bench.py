"""``python -m grader.bench``: the cost of isolation, per submission, measured against its baseline.

Writes ``N`` copies of the realistic examples that finish (``alice`` correct, ``bob`` partial,
``carol`` wrong, ``erin`` import error, ``frank`` zip; not ``dave``, whose deadlock costs
timeouts, not grading) and grades the SAME copies twice in one run, with the same seed key:
isolated (as root: namespaces, private mounts, a cgroup and a tmpfs per sandbox, its own user)
and with ``--no-isolation`` (the baseline: the same sandbox process, limits and checks, none of
the isolation). A performance claim needs its baseline measured on the same machine at the same
time, so the two alternate (``--rounds``: round 1 isolated first, round 2 the baseline first,
...). It prints, per mode and per example student:

* sandbox seconds per submission (start to cleanup, from each ``results.json``), of which the
  tests' md.launch calls, and the rest (interpreter and torch start-up, namespaces, mounts,
  cgroup, cleanup);
* wall time of the batch / N (what an instructor waits per submission, with ``--jobs`` slots);
* the ratio isolated / baseline of each, i.e. the isolation overhead;

and checks that both modes gave every submission the same score and status (isolation must
change costs, never grades).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import sandbox
from .examples.a1_collectives import make

ROOT = Path(__file__).resolve().parent.parent
STUDENTS = ("alice", "bob", "carol", "erin", "frank.zip")
MODES = ("isolated", "baseline")  # baseline: --no-isolation
SECONDS_PER_SUBMISSION = 300  # generous bound on one grading run: copies * this / jobs


@dataclass
class Batch:
    """One grading run of all the copies in one mode."""

    mode: str
    wall: float
    #: per submission id: (example student, sandbox seconds, tests seconds, score, status)
    rows: dict[str, tuple[str, float, float, float, str]] = field(default_factory=dict)


def copies(count: int) -> dict[str, object]:
    """``count`` submissions named ``<example><index>``, cycling through ``STUDENTS``."""
    examples = make.build_dict()
    out = {}
    for copy in range(count):
        name = STUDENTS[copy % len(STUDENTS)]
        stem, dot, suffix = name.partition(".")
        out[f"{stem}{copy:03d}{dot}{suffix}"] = examples[name]
    return out


def example_of(submission: str) -> str:
    """``alice007`` -> ``alice`` (the example a copy was made from)."""
    return submission.rstrip("0123456789")


def read_batch(mode: str, wall: float, out: Path) -> Batch:
    """The batch's per-submission numbers from ``out/<id>/results.json``."""
    batch = Batch(mode, wall)
    for path in sorted(out.glob("*/results.json")):
        result = json.loads(path.read_text())
        extra = result["extra_data"]
        student = path.parent.name
        batch.rows[student] = (
            example_of(student),
            float(result["execution_time"]),
            float(extra["tests_seconds"]),
            float(result["score"]),
            extra["status"],
        )
    return batch


def grade(submissions: Path, out: Path, mode: str, args: argparse.Namespace) -> Batch:
    """Grade ``submissions`` into ``out`` (a fresh folder: nothing reused) in ``mode``."""
    command = [sys.executable, "-m", "grader", "grade", "a1_collectives", str(submissions)]
    command += ["--out", str(out), "--jobs", str(args.jobs), "--seed-key", "bench"]
    for pattern in args.tests or []:
        command += ["--tests", pattern]
    if mode == "baseline":
        command.append("--no-isolation")
    limit = 120 + SECONDS_PER_SUBMISSION * args.copies / args.jobs
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=limit)
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"bench: grading ({mode}) failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return read_batch(mode, wall, out)


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def summary(batches: list[Batch], jobs: int) -> list[str]:
    """The table: per example and overall, sandbox / tests / rest seconds per submission in each
    mode (means over copies and rounds), the batch wall time per submission, and the ratios."""
    by_mode = {mode: [b for b in batches if b.mode == mode] for mode in MODES}
    examples = sorted({row[0] for b in batches for row in b.rows.values()})
    lines = [
        f"{'submission':<12} {'isolated s':>10} {'baseline s':>10} {'ratio':>6}   "
        f"{'tests iso':>9} {'tests base':>10}   {'rest iso':>8} {'rest base':>9}"
    ]

    def row(label: str, pick) -> str:
        sandbox_s, tests_s = {}, {}
        for mode in MODES:
            picked = [r for b in by_mode[mode] for r in b.rows.values() if pick(r)]
            sandbox_s[mode] = _mean([r[1] for r in picked])
            tests_s[mode] = _mean([r[2] for r in picked])
        iso, base = sandbox_s["isolated"], sandbox_s["baseline"]
        ratio = f"{iso / base:6.2f}" if base > 0 else f"{'-':>6}"
        rest = {mode: sandbox_s[mode] - tests_s[mode] for mode in MODES}
        return (
            f"{label:<12} {iso:10.2f} {base:10.2f} {ratio}   {tests_s['isolated']:9.2f} "
            f"{tests_s['baseline']:10.2f}   {rest['isolated']:8.2f} {rest['baseline']:9.2f}"
        )

    for example in examples:
        lines.append(row(example, lambda r, e=example: r[0] == e))
    lines.append(row("all", lambda r: True))
    wall = {mode: _mean([b.wall / max(1, len(b.rows)) for b in by_mode[mode]]) for mode in MODES}
    ratio = wall["isolated"] / wall["baseline"] if wall["baseline"] > 0 else float("nan")
    lines.append(
        f"batch wall time per submission (--jobs {jobs}): isolated {wall['isolated']:.2f} s, "
        f"baseline {wall['baseline']:.2f} s, ratio {ratio:.2f}"
    )
    return lines


def differences(batches: list[Batch]) -> list[str]:
    """Submissions whose score or status differs between any two batches (should be none)."""
    found = []
    students = sorted({s for b in batches for s in b.rows})
    for student in students:
        seen = {(b.rows[student][3], b.rows[student][4]) if student in b.rows else None for b in batches}
        if len(seen) > 1:
            found.append(f"{student}: {sorted(map(str, seen))}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=20, help="submissions per batch (default 20)")
    parser.add_argument("--jobs", type=int, default=2, help="submissions graded at once (default 2)")
    parser.add_argument("--rounds", type=int, default=1, help="batches per mode, alternating (default 1)")
    parser.add_argument("--tests", action="append", help="a subset of tests (glob), as for grade")
    args = parser.parse_args(argv)
    if min(args.copies, args.jobs, args.rounds) < 1:
        parser.error("--copies, --jobs and --rounds must be at least 1")
    if not sandbox.can_isolate():
        raise SystemExit("bench: isolation needs root (and mount namespaces): nothing to compare here")
    batches = []
    with tempfile.TemporaryDirectory(prefix="grader-bench-") as tmp:
        submissions = Path(tmp) / "subs"
        make.write(submissions, copies(args.copies))
        for round_ in range(args.rounds):
            order = MODES if round_ % 2 == 0 else MODES[::-1]
            for mode in order:
                out = Path(tmp) / f"out-{mode}-{round_}"
                batches.append(grade(submissions, out, mode, args))
                print(f"round {round_ + 1}, {mode}: {batches[-1].wall:.1f} s", file=sys.stderr, flush=True)
    print(
        f"{args.copies} copies, --jobs {args.jobs}, {args.rounds} round(s); seconds per submission "
        "(sandbox start to cleanup; tests = md.launch; rest = start-up, isolation, cleanup):"
    )
    for line in summary(batches, args.jobs):
        print(line)
    changed = differences(batches)
    if changed:
        print("scores differ between the modes (or rounds):", *changed, sep="\n  ")
        return 1
    print("scores and statuses: the same in every batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())

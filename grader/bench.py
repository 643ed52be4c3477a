"""``python -m grader.bench``: grade N copies of the example students, report seconds per submission.

Writes ``N`` copies of the realistic examples that finish (``alice`` correct, ``bob`` partial,
``carol`` wrong, ``erin`` import error, ``frank`` zip; not ``dave``, whose deadlock costs
timeouts, not grading), grades them with ``--jobs``, and prints per submission:

* wall time of the batch / N  (what an instructor waits, per submission);
* sandbox time (start to cleanup) and the part spent inside the tests' md.launch calls;
* overhead = sandbox time - test time (interpreter and torch start-up, forkserver, cleanup)
  plus the grader's own checking and writing (batch time * jobs - sandbox time).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .examples.a1_collectives import make

ROOT = Path(__file__).resolve().parent.parent
STUDENTS = ("alice", "bob", "carol", "erin", "frank.zip")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--tests", action="append", help="a subset of tests (glob), as for grade")
    args = parser.parse_args()
    examples = make.build_dict()
    with tempfile.TemporaryDirectory(prefix="grader-bench-") as tmp:
        submissions = {}
        for copy in range(args.copies):
            name = STUDENTS[copy % len(STUDENTS)]
            stem, dot, suffix = name.partition(".")
            submissions[f"{stem}{copy:03d}{dot}{suffix}"] = examples[name]
        make.write(Path(tmp) / "subs", submissions)
        command = [
            sys.executable,
            "-m",
            "grader",
            "grade",
            "a1_collectives",
            f"{tmp}/subs",
            "--out",
            f"{tmp}/out",
        ]
        command += ["--jobs", str(args.jobs), "--seed-key", "bench"]
        for pattern in args.tests or []:
            command += ["--tests", pattern]
        start = time.monotonic()
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
        wall = time.monotonic() - start
        results = [json.loads(p.read_text()) for p in Path(tmp, "out").glob("*/results.json")]
    sandbox = sum(r["execution_time"] for r in results)
    tests = sum(r["extra_data"]["tests_seconds"] for r in results)
    n = len(results)
    print(f"{n} submissions, --jobs {args.jobs}: {wall:.1f} s in all, {wall / n:.2f} s per submission")
    print(f"per submission: sandbox {sandbox / n:.2f} s, of which tests (md.launch) {tests / n:.2f} s")
    print(f"overhead per submission: in the sandbox {(sandbox - tests) / n:.2f} s, ", end="")
    print(f"in the grader {max(0.0, wall * args.jobs - sandbox) / n:.2f} s (of {args.jobs} slots)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

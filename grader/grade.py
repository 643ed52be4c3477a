"""``python -m grader grade ASSIGNMENT SUBMISSIONS_DIR --out OUT_DIR``: grade a folder of submissions.

For each submission (a folder or a .zip named by student id; see ``intake.py``):

1. keep only the student files (``collectives.py``); an unusable submission gets the status
   ``invalid_submission`` with the reason, one that uses what the assignment forbids (the
   library's implementation of the task, ``forbidden.py``) the status ``forbidden``, and the
   batch goes on;
2. build a fresh working directory with those files, the assignment's worker modules and
   ``rules.py``, ``guard.py``, ``student_comm.py`` and ``harness.py`` -- never
   ``cases.py`` or ``reference.py``, never a student's tests or ``conftest.py``;
3. run the harness there in a sandbox (``sandbox.py``: own session, limits, private mounts,
   an unprivileged user of its own when run as root); it launches each hidden test's job --
   each worker installs the guard, then imports the student's module and calls it with a
   point-to-point-only communicator -- and writes the raw results as JSON and .npy;
4. check every test's results *here*, against references computed here from seeds the
   grader chose for this student (``grader/<name>/cases.py``): a missing or malformed
   result, or a value other than the reference's, fails the test, whatever the student's code
   printed or wrote. The traffic counts behind a1's budget tests are the one thing measured
   inside the student's processes: they are cross-checked between ranks, against the
   transport's own counters and against the formula, but code in those processes can forge
   them (``grader/README.md``, "What the budgets trust"). A worker that called a forbidden
   function makes the submission ``forbidden``;
5. write ``OUT_DIR/<id>/feedback.md`` and ``results.json`` (Gradescope's schema), the
   similarity of the code to the library for the instructor (``instructor.json``,
   ``similarity.py``), and at the end ``OUT_DIR/gradebook.csv``.

Deterministic: the seeds are a hash of a key (``OUT_DIR/.seed-key``, created once, or
``--seed-key``), the assignment and the student id. Resumable: a submission whose
``results.json`` records the same input hash (its files, the hidden tests, the options, the
key) is not graded again unless ``--force``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import fnmatch
import hashlib
import importlib
import json
import math
import os
import queue
import re
import secrets
import shutil
import signal
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import pytest
import torch
from tqdm import tqdm

from . import ast_lock, cgroups, guard, intake, report, sandbox, similarity, stubs
from .assignment import Assignment
from .plan import GradedTest, TestResult
from .text import clean as clean_text
from .tree import remove_tree
from .wire import Budget, WireError, read_probe, read_record

ROOT = Path(__file__).resolve().parent.parent
HARNESS = Path(__file__).resolve().parent / "harness.py"
#: sandbox-side modules every assignment's workers import (copied beside harness.py)
SHARED_SANDBOX_FILES = ("guard.py", "student_comm.py", "seeding.py", "instruments.py")
#: trusted modules whose change changes grades (part of the hash that decides what to regrade)
TRUSTED_FILES = ("forbidden.py", "similarity.py", "assignment.py", "plan.py", "stubs.py", "tiers.py")
UID_BASE = 64000  # sandbox user ids: UID_BASE + slot, one per parallel job
#: held by an isolated grading run: the sandbox user ids are the same in every run, and a run's
#: cleanup kills every process of its ids, so two runs at once would kill each other's sandboxes
SANDBOX_USERS_LOCK = Path("/run/minidist-grader-sandbox-users.lock")
GID = 65534  # nogroup
# Per-sandbox limits when isolated; the defaults of --sandbox-memory, --sandbox-disk, --sandbox-pids.
SANDBOX_MEMORY_BYTES = 6 * 2**30  # per sandbox cgroup: every page its processes touch, tmpfs too
SANDBOX_CPU_SHARES = 1024  # equal CPU between busy sandboxes, whatever their process counts
SANDBOX_MAX_PIDS = 512  # processes and threads (torch starts a few threads per rank)
SANDBOX_DISK_BYTES = 512 * 2**20  # the working directory's tmpfs (its pages count as memory too)
_SIZE = re.compile(r"([0-9]+)([KMGT]?)(?:I?B)?", re.IGNORECASE)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
MAX_SIZE_BYTES = 2**50  # 1 PiB: above it a size is a typo (the kernel's counters are 64-bit)
MAX_PIDS = 4194304  # the kernel's largest pid_max: pids.max refuses more


def parse_size(text: str) -> int:
    """``"6G"`` -> 6 GiB in bytes: a positive whole number with an optional binary suffix
    (``K``, ``M``, ``G``, ``T``; ``MB``, ``MiB`` read the same). argparse shows the error."""
    match = _SIZE.fullmatch(text.strip())
    value = int(match.group(1)) * _UNITS[match.group(2).upper()] if match else 0
    if not 0 < value <= MAX_SIZE_BYTES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a usable size: write a positive whole number of bytes, optionally with "
            f"a suffix K, M, G or T (powers of 1024), e.g. 6G or 512M; at most {size_text(MAX_SIZE_BYTES)}"
        )
    return value


def parse_count(text: str) -> int:
    """``"512"`` -> 512: a positive whole number of processes (argparse shows the error)."""
    value = int(text) if re.fullmatch(r"\s*[0-9]+\s*", text) else 0
    if not 0 < value <= MAX_PIDS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a usable count: write a whole number from 1 to {MAX_PIDS}, e.g. 512"
        )
    return value


def size_text(value: int) -> str:
    """Bytes as a person writes them: ``6 GiB``, ``512 MiB``, ``1536 KiB``, ``100 bytes``."""
    for unit, name in ((2**50, "PiB"), (2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if value % unit == 0:
            return f"{value // unit} {name}"
    return f"{value} bytes"


def load_assignment(name: str) -> Assignment:
    """``grader/<name>/grading.py``'s ``ASSIGNMENT``: everything the grader needs to know of it."""
    module_name = f"grader.{name}.grading"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name in (module_name, f"grader.{name}"):
            raise SystemExit(
                f"grade: no assignment {name!r} (expected {module_name.replace('.', '/')}.py)"
            ) from None
        raise
    assignment = getattr(module, "ASSIGNMENT", None)
    if not isinstance(assignment, Assignment):
        raise SystemExit(
            f"grade: {module_name.replace('.', '/')}.py declares no ASSIGNMENT = Assignment(...)"
        )
    return assignment


def select(tests: list[GradedTest], patterns: list[str] | None) -> list[GradedTest]:
    if not patterns:
        return tests
    return [t for t in tests if any(fnmatch.fnmatchcase(t.name, p) for p in patterns)]


def config_digest(name: str, args: argparse.Namespace, seed_key: str) -> str:
    """A hash of everything besides the submission that decides a grade."""
    h = hashlib.sha256()
    shared = [ROOT / "grader" / f for f in SHARED_SANDBOX_FILES + TRUSTED_FILES]
    for path in sorted((ROOT / "grader" / name).glob("*.py")) + [HARNESS, *shared]:
        h.update(path.name.encode() + path.read_bytes())
    options = {"tests": args.tests, "test_timeout": args.test_timeout, "timeout": args.timeout}
    # a tighter limit can fail a test that passed: another limit must grade again on resume
    options |= {"memory": args.sandbox_memory, "disk": args.sandbox_disk, "pids": args.sandbox_pids}
    options["no_isolation"] = bool(getattr(args, "no_isolation", False))  # isolated runs share no state
    h.update(json.dumps(options, sort_keys=True).encode() + seed_key.encode())
    return h.hexdigest()


def student_seed(seed_key: str, assignment: str, student: str) -> int:
    digest = hashlib.sha256(f"{seed_key}\0{assignment}\0{student}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


class Grader:
    def __init__(self, name: str, args: argparse.Namespace, out: Path, seed_key: str) -> None:
        self.name, self.args, self.out, self.seed_key = name, args, out, seed_key
        self.assignment = load_assignment(name)
        self.isolated = sandbox.can_isolate() and not args.no_isolation
        protections = sandbox.probe_protections()  # each one tried, in a forked child
        off = ["isolation (--no-isolation)"] if args.no_isolation else []
        off += [name for name, works in protections.items() if not works]
        if protections.get("root"):
            off += [f"cgroup {name}" for name, works in cgroups.probe().items() if not works]
        if off:
            how = "isolated in part" if self.isolated else "limited, not isolated, under the grader's user"
            print(
                f"warning: protections OFF: {', '.join(off)}; submissions {how} (grader/README.md)",
                file=sys.stderr,
            )
        if self.isolated:
            print(
                f"sandbox limits per submission: memory {size_text(args.sandbox_memory)} (tmpfs and shm "
                f"included; --sandbox-memory), disk {size_text(args.sandbox_disk)} (--sandbox-disk), "
                f"{args.sandbox_pids} processes and threads (--sandbox-pids), "
                f"CPU shares {SANDBOX_CPU_SHARES}",
                file=sys.stderr,
            )
        self.work_root = out / ".sandbox"
        # isolated: the forbidden modules' files are covered by stand-ins inside every sandbox
        self.overlays = tuple(stubs.build(self.assignment.rules, out / ".stubs")) if self.isolated else ()
        self.test_names = [t.name for t in select(self.assignment.graded_tests(0), args.tests)]
        if not self.test_names:
            raise SystemExit(f"grade: no test of {name} matches {args.tests} (glob patterns; '[[]' is a '[')")
        self.config = config_digest(name, args, seed_key)
        self.slots: queue.Queue[int] = queue.Queue()
        for slot in range(args.jobs):
            self.slots.put(slot)
        hide = [ROOT / "solutions", ROOT / "grader", ROOT / ".git", out, Path(args.submissions)]
        self.hide = tuple(str(p.resolve()) for p in hide)
        library = sorted({path for pattern in self.assignment.similar_to for path in ROOT.glob(pattern)})
        self.library = similarity.library_functions(library, ROOT)

    def similarity(self, submission: intake.Submission) -> similarity.Match:
        """The closest library function to any function of the submission (for the instructor)."""
        best = similarity.Match(0.0, "", "")
        for data in submission.files.values():
            match = similarity.best_match(data.decode(), self.library, self.assignment.given_functions)
            best = max(best, match, key=lambda m: m.score)
        return best

    def grade(self, submission: intake.Submission) -> report.Graded:
        graded = self._grade(submission)
        if not submission.error:
            match = self.similarity(submission)
            graded.similarity, graded.similar_to = match.score, match.library
        return graded

    def _grade(self, submission: intake.Submission) -> report.Graded:
        digest = hashlib.sha256((submission.digest() + self.config).encode()).hexdigest()
        if submission.error:
            return self._all_failed(submission, "invalid_submission", submission.error, digest)
        if submission.refused:
            return self._forbidden(self._all_failed(submission, "forbidden", submission.refused, digest))
        slot = self.slots.get()
        try:
            graded = self._run(submission, slot, digest)
        except Exception as error:  # a bug of ours: one submission's problem, not the batch's
            return self._all_failed(submission, "error", f"{type(error).__name__}: {error}", digest)
        finally:
            self.slots.put(slot)
        if graded.status == "forbidden":  # refused while the probe imported it
            return self._forbidden(graded)
        refused = next((t.message for t in graded.tests if guard.MARKER in t.message), None)
        if refused is not None:  # the run time guard caught a forbidden call: the same as at intake
            line = next(line for line in refused.splitlines() if guard.MARKER in line)
            refusal = line[line.index(guard.MARKER) :].split(". ")[0]
            graded.status, graded.reason = "forbidden", f"{refusal[:300]} (refused at run time)"
            for test in graded.tests:
                if test.passed:
                    test.message = "not counted: the submission calls a forbidden function (see the reason)"
                test.points, test.passed = 0.0, False
            self._forbidden(graded)
        return graded

    def _forbidden(self, graded: report.Graded) -> report.Graded:
        graded.instead = self.assignment.forbidden.instead
        return graded

    def _all_failed(self, submission, status: str, reason: str, digest: str) -> report.Graded:
        tests = [
            TestResult(t.name, 0.0, t.points, False, t.function, f"not run: {reason}")
            for t in select(self.assignment.graded_tests(0), self.args.tests)
        ]
        return report.Graded(submission.student, status, reason, tests, 0.0, digest)

    def _run(self, submission: intake.Submission, slot: int, digest: str) -> report.Graded:
        seed = student_seed(self.seed_key, self.name, submission.student)
        tests = select(self.assignment.graded_tests(seed), self.args.tests)
        uid = UID_BASE + slot if self.isolated else None
        token = secrets.token_hex(8)
        workdir = self.work_root / token
        group, mounted = None, False
        try:
            workdir.mkdir(parents=True)
            if self.isolated:  # its own disk (ENOSPC there only) and its own memory, CPU, pids
                cgroups.mount_tmpfs(workdir, str(self.args.sandbox_disk))
                mounted = True
                cgroups.remove_stale_once()
                group = cgroups.SandboxGroup.create(
                    f"{slot}-{token}", self.args.sandbox_memory, SANDBOX_CPU_SHARES, self.args.sandbox_pids
                )
            for name, data in submission.files.items():
                (workdir / name).write_bytes(data)
            for name in self.assignment.sandbox_files:
                shutil.copyfile(ROOT / "grader" / self.name / name, workdir / name)
            for name in SHARED_SANDBOX_FILES:
                shutil.copyfile(ROOT / "grader" / name, workdir / name)
            shutil.copyfile(HARNESS, workdir / "harness.py")
            jobs = [t.job.as_json(f"t{index:03d}", self.args.test_timeout) for index, t in enumerate(tests)]
            probe = [Path(name).stem for name in self.assignment.student_files]
            preload = list(self.assignment.sandbox_preload)
            (workdir / "spec.json").write_text(json.dumps({"jobs": jobs, "probe": probe, "preload": preload}))
            (workdir / "results").mkdir()
            inside = Path(sandbox.work_mount(workdir)) if self.isolated else workdir
            if uid is not None:  # the grader's files stay root's: only results/ is the sandbox's to write
                for path in [workdir, *workdir.rglob("*")]:
                    path.chmod(0o755 if path.is_dir() else 0o644)
                os.chown(workdir / "results", uid, GID)
            env = {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "PYTHONPATH": str(inside),
                "HOME": "/tmp" if self.isolated else str(inside),  # off sys.path, writable
                "TMPDIR": "/tmp" if self.isolated else str(workdir),
                "PYTHONDONTWRITEBYTECODE": "1",
                "OMP_NUM_THREADS": "1",
                "LANG": "C.UTF-8",
            }
            command = [sys.executable, "-s", str(inside / "harness.py"), "spec.json", "results"]
            limits = sandbox.Limits(wall_seconds=self.args.timeout, cpu_seconds=int(self.args.timeout) + 60)
            # the sandbox process joins its cgroups first thing, as root (sandbox._join_cgroups)
            joins = group.procs_files if group is not None else ()
            isolation = sandbox.Isolation(
                self.isolated, uid, GID if uid is not None else None, self.hide, joins, self.overlays
            )
            run = sandbox.run(command, workdir, env, limits, isolation)
            oom = group is not None and group.oom_killed()
            results_dir = workdir / "results"
            if results_dir.is_symlink() or not results_dir.is_dir():  # replaced by the student's code
                results_dir = workdir / "no-results-here"
            budget = Budget()  # the decoded bytes of all this submission's records
            checked = [
                self._check(test, results_dir, f"t{index:03d}", budget) for index, test in enumerate(tests)
            ]
            probe = read_probe(results_dir)
        finally:
            if group is not None:  # nothing it started outlives its grading
                group.close()
            if mounted:  # drops all the sandbox wrote, however deep, without walking it
                cgroups.unmount(workdir)
            remove_tree(workdir)  # iterative: any depth of directories the submission left
        results = [result for result, _ in checked]
        status, reason = run.status, ""
        import_errors = [error for _, error in checked if error is not None]
        refused_at_import = probe is not None and guard.MARKER in probe["stderr"]
        if status == "ok" and refused_at_import:  # the probe imports behind the guard, as the workers do
            line = next(line for line in probe["stderr"].splitlines() if guard.MARKER in line)
            status = "forbidden"
            reason = f"{line[line.index(guard.MARKER) :].split('. ')[0][:300]} (refused when importing)"
        elif status == "ok" and probe is not None:
            status = "import_error"
            code = probe["returncode"]
            how = "did not finish" if code is None else f"exited with code {code}"
            last = probe["stderr"].strip().splitlines()[-1:] or [""]
            hint = (
                " (sys.exit() or os._exit() at import time?)"
                if code is not None and code >= 0 and not last[0]
                else ""
            )
            reason = f"importing {probe['module']}.py {how}{hint}: {last[0][:300]}".rstrip(": ")
        elif status == "ok" and results and len(import_errors) == len(results):
            status = "import_error"
            reason = f"importing {', '.join(self.assignment.student_files)} failed: {import_errors[0][:300]}"
        elif run.status == "timeout":
            reason = f"stopped after {self.args.timeout:g} s"
        elif run.status == "crashed" and run.returncode is not None and run.returncode < 0:
            reason = f"the sandboxed run was killed by {signal_name(-run.returncode)}"
        elif run.status == "crashed":
            reason = f"the sandboxed run exited with status {run.returncode}"
        if oom:
            limit = f"the sandbox's memory limit ({size_text(self.args.sandbox_memory)}, tmpfs and shm too)"
            reason = f"{reason}; a process was killed for exceeding {limit}".lstrip("; ")
        return report.Graded(submission.student, status, reason, results, run.seconds, digest, _output(run))

    def _check(
        self, test: GradedTest, folder: Path, job_id: str, budget: Budget
    ) -> tuple[TestResult, str | None]:
        """The test's result, and the import error that failed it (None: not one).

        ``budget``: the submission's decoded-bytes budget, shared by all its records."""
        result = TestResult(test.name, 0.0, test.points, False, test.function)
        try:
            record = read_record(folder, job_id, budget)
        except WireError as error:
            result.message = str(error)
            return result, None
        result.seconds = record["seconds"]
        if "error" in record:  # the fields are the submission's: our formatting must survive any of them
            try:
                message = self.assignment.failure_message(test, record["error"], self.args.test_timeout)
                result.message = self.assignment.redact(message)
                import_error = self.assignment.import_failure(record["error"])
            except Exception as error:  # noqa: BLE001
                result.message = f"the test failed with a malformed error record ({type(error).__name__})"
                return result, None
            return result, (None if import_error is None else str(import_error))
        try:
            value = test.check(record["value"])
        except (Exception, pytest.fail.Exception) as error:  # pytest.fail's is a BaseException
            text = str(error) or type(error).__name__
            if not isinstance(error, (pytest.fail.Exception, AssertionError)):
                text = f"malformed result ({type(error).__name__}: {text[:200]})"
            result.message = self.assignment.redact(text)
            return result, None
        if test.tiers is not None:  # right: the measured value earns its tier's fraction
            outcome = test.tiers.outcome(value, test.points)
            result.quantity, result.order, result.message = (
                test.tiers.quantity,
                test.tiers.order,
                outcome.message,
            )
            result.measured = None if math.isnan(outcome.value) else outcome.value
            result.points, result.passed = outcome.fraction * test.points, outcome.tier == 1
            return result, None
        result.passed, result.points = True, test.points
        return result, None


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; the number for one this system does not name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _output(run: sandbox.RunResult, shown: int = 1500) -> str:
    """The end of what the run printed (the workers' output is forwarded to stdout)."""
    parts = []
    for name, text, total in (
        ("stdout", run.stdout, run.stdout_bytes),
        ("stderr", run.stderr, run.stderr_bytes),
    ):
        if total:
            cut = f", the last {shown} characters" if total > shown else ""
            parts.append(f"--- {name}: {total} bytes{cut} ---\n{text[-shown:]}")
    return "\n".join(parts)


def _finish(grader: Grader, submission: intake.Submission, future, out: Path) -> report.Graded:
    """The graded submission, written to ``OUT/<id>/``; a failure of ours becomes its status ``error``.

    Grading or writing one submission can fail on something it produced that we did not
    foresee; that must cost this submission (status ``error``, with the reason, in the
    gradebook), never the batch.
    """
    try:
        graded = future.result()
    except Exception as error:  # noqa: BLE001 -- any bug of ours, for this one submission
        reason = clean_text(f"grading failed: {type(error).__name__}: {error}", multiline=False, limit=300)
        graded = grader._all_failed(submission, "error", reason, "")
    if not intake.usable_id(graded.student):
        return graded  # no folder for a name that is not a safe file name (the gradebook has its row)
    try:
        report.write_student(out / graded.student, graded, grader.assignment.hints)
    except Exception as error:  # noqa: BLE001
        reason = f"writing the feedback failed: {type(error).__name__}: {error}"
        reason = clean_text(reason, multiline=False, limit=300)
        graded = grader._all_failed(submission, "error", reason, "")
        with contextlib.suppress(Exception):
            report.write_student(out / graded.student, graded, grader.assignment.hints)
    return graded


def _missing(student: str) -> dict:
    """The gradebook's record of a submission the batch did not get to (it stopped early)."""
    reason = "not graded: the batch stopped before this submission (run the grader again to resume)"
    return {"score": 0, "max_score": 0, "tests": [], "extra_data": {"status": "error", "reason": reason}}


def seed_key_for(out: Path, given: str | None) -> str:
    """The key the input seeds derive from: ``given`` (``--seed-key``, or the content of
    ``--seed-key-file``), else ``OUT/.seed-key`` (created once, readable by root only)."""
    if given:
        return given
    path = out / ".seed-key"
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(secrets.token_hex(16))
    return path.read_text().strip()


@contextlib.contextmanager
def sandbox_users(isolated: bool):
    """Hold the sandbox user ids for this run (``SANDBOX_USERS_LOCK``); another isolated run
    waits here until this one has finished, instead of having its sandboxes killed."""
    if not isolated:
        yield
        return
    with open(SANDBOX_USERS_LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(
                "another grading run is using the sandbox users; waiting for it to finish ...",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def unmount_stale(work_root: Path) -> list[str]:
    """Detach the working-directory tmpfs a killed grader left under ``work_root`` (this output
    folder's ``.sandbox``); the mount points unmounted. Its ``finally`` never ran, so the
    mount would stay (and make the final cleanup fail) until the machine restarts."""
    prefix = str(work_root) + "/"
    stale = sorted((p for p in sandbox.mount_points() if p.startswith(prefix)), key=len, reverse=True)
    for point in stale:  # deepest first
        with contextlib.suppress(OSError):
            cgroups.unmount(point)
    return stale


def main(args: argparse.Namespace) -> int:
    os.umask(0o077)  # everything the grader writes is for root (the instructor) only
    sandbox.become_subreaper()
    # the trusted checks run here on small tensors while the sandboxes use the cores: on busy
    # cores a second torch thread only waits (a1's transcript replay ran 30x slower with two)
    torch.set_num_threads(1)
    ast_lock.serialise()  # the grading threads parse (np.load's headers, the similarity check)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    seed_key = seed_key_for(out, args.seed_key)
    grader = Grader(args.assignment, args, out, seed_key)
    paths = intake.discover(Path(args.submissions))
    submissions = [intake.load(p, grader.assignment.student_files) for p in paths]
    for submission in submissions:
        if not submission.error:
            intake.check_forbidden(submission, grader.assignment.forbidden)
    seen: set[str] = set()
    for submission in submissions:
        if submission.student in seen:
            submission.error = "two submissions with this id (a folder and a zip?); hand in one"
        seen.add(submission.student)
    todo, rows = [], {}
    for submission in submissions:
        digest = hashlib.sha256((submission.digest() + grader.config).encode()).hexdigest()
        usable = intake.usable_id(submission.student)  # else: no folder of its own in OUT_DIR
        previous = report.read_student(out / submission.student) if usable and not args.force else None
        if previous and previous.get("extra_data", {}).get("input_sha256") == digest:
            rows[submission.student] = previous
        else:
            todo.append(submission)
    if rows:
        print(f"reusing {len(rows)} finished submission(s) (--force to grade them again)", file=sys.stderr)
    try:
        with sandbox_users(grader.isolated), ThreadPoolExecutor(max_workers=args.jobs) as pool:
            if grader.isolated and unmount_stale(grader.work_root):
                print("removed the working directories of an interrupted run", file=sys.stderr)
            futures = {pool.submit(grader.grade, s): s for s in todo}
            bar = tqdm(
                as_completed(futures), total=len(futures), desc=f"grading {args.assignment}", unit="sub"
            )
            for future in bar:
                graded = _finish(grader, futures[future], future, out)
                rows[graded.student] = report.results_json(graded)
                line = f"{graded.student}: {graded.score:g}/{graded.max_score:g} {graded.status}"
                bar.set_postfix_str(clean_text(line, multiline=False, limit=80))
    finally:  # whatever happened above, the gradebook holds every submission
        book = [
            report.gradebook_row(
                s.student,
                rows.get(s.student) or _missing(s.student),
                grader.test_names,
                report.read_instructor(out / s.student) if intake.usable_id(s.student) else {},
            )
            for s in submissions
        ]
        report.write_gradebook(out / "gradebook.csv", book, grader.test_names)
        measured = {t.name: t.tiers for t in grader.assignment.graded_tests(0) if t.tiers is not None}
        measured = {name: tiers for name, tiers in measured.items() if name in grader.test_names}
        if measured:
            ids = [s.student for s in submissions]
            report.write_leaderboards(out, {i: rows[i] for i in ids if i in rows}, measured)
        for problem in remove_tree(grader.work_root)[:5]:
            print(f"warning: cleanup left {problem}", file=sys.stderr)
    print(report.summary_table(book, similarity.FLAG_AT))
    print(f"gradebook: {out / 'gradebook.csv'}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("assignment", metavar="ASSIGNMENT", help="e.g. a1_collectives")
    parser.add_argument(
        "submissions", metavar="SUBMISSIONS_DIR", help="folders or .zip files named by student id"
    )
    parser.add_argument("--out", required=True, help="where gradebook.csv and OUT/<id>/ go")
    parser.add_argument("--jobs", type=int, default=1, help="submissions graded at once (default 1)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per submission (default 300)")
    parser.add_argument(
        "--test-timeout", type=float, default=30.0, help="seconds per test (one launch; default 30)"
    )
    parser.add_argument(
        "--tests", action="append", metavar="PATTERN", help="grade only tests matching (glob)"
    )
    parser.add_argument("--force", action="store_true", help="grade again what is already graded")

    class SeedKeyFile(argparse.Action):
        """``--seed-key-file FILE``: the key is FILE's content (stored as ``seed_key``)."""

        def __call__(self, parser, namespace, path, option_string=None):
            try:
                mode = os.stat(path).st_mode
                key = Path(path).read_text().strip()
            except OSError as error:
                parser.error(f"--seed-key-file {path}: {error.strerror}")
            if not key:
                parser.error(f"--seed-key-file {path} is empty: write the key into it")
            if mode & 0o077:
                print(
                    f"warning: {path} is readable by group or others: chmod 600 {path}",
                    file=sys.stderr,
                )
            namespace.seed_key = key

    keys = parser.add_mutually_exclusive_group()
    keys.add_argument(
        "--seed-key",
        default=None,
        help="secret the input seeds derive from (visible in the process list to other users of "
        "this machine, not to sandboxes: prefer --seed-key-file)",
    )
    keys.add_argument(
        "--seed-key-file",
        metavar="FILE",
        action=SeedKeyFile,
        dest="seed_key",
        help="read the seed key from FILE (make it readable by root only: chmod 600)",
    )
    parser.add_argument(
        "--no-isolation", action="store_true", help="as root: no private mounts or user (debugging only)"
    )
    limits = parser.add_argument_group(
        "sandbox limits", "per submission, when grading as root (isolated); a change regrades on resume"
    )
    limits.add_argument(
        "--sandbox-memory",
        type=parse_size,
        default=SANDBOX_MEMORY_BYTES,
        metavar="SIZE",
        help=f"memory of all its processes, tmpfs and shm included (cgroup; default "
        f"{size_text(SANDBOX_MEMORY_BYTES).replace(' ', '')}; suffix K, M, G)",
    )
    limits.add_argument(
        "--sandbox-disk",
        type=parse_size,
        default=SANDBOX_DISK_BYTES,
        metavar="SIZE",
        help=f"its working directory's tmpfs, which also counts as memory (default "
        f"{size_text(SANDBOX_DISK_BYTES).replace(' ', '')})",
    )
    limits.add_argument(
        "--sandbox-pids",
        type=parse_count,
        default=SANDBOX_MAX_PIDS,
        metavar="N",
        help=f"processes and threads at once (cgroup pids.max; default {SANDBOX_MAX_PIDS})",
    )

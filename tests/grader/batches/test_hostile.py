"""Every hostile example student of assignment 1, graded in ONE batch beside ``alice`` (issue 15).

The attackers are ``grader/examples/a1_collectives/isolation.py`` (other sandboxes: loopback
ports, setuid files in shared directories, System V shared memory, other processes' command
lines), ``resources.py`` (CPU, disk, memory) and ``robust.py`` (what the grader process reads
and writes: surrogates, Markdown, forged records, deep directories, a reserved id), plus a 10 GB
sparse ``collectives.py``. One grading run (a module-scoped fixture) grades them all; each test
function below reads that run's results, so a failure names the attack that got through.

Where the grader cannot isolate (not root, no namespaces or cgroups), only ``robust.py``'s
students are graded (running CPU and memory hogs without cgroups would hurt the machine), and
the isolation and resource tests are skipped.

The attacks on the *other* slot only mean something while alice is being graded: the grader
grades in sorted order of ids, ``--jobs`` slots at a time, so alice and those attackers get ids
starting with ``0-`` (sorted first) and ``--jobs`` is their number: they all start at once.
``cpu_hog`` holds its slot until ``--timeout`` (its own imports get a 150th of its group's CPU
share), which is the floor of the batch's time: 40 s, five times what alice needs beside it.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from grade_helpers import sandbox_processes
from grader import cgroups, sandbox
from grader.examples import common
from grader.examples.a1_collectives import isolation, make, resources, robust
from test_grade_robust import lines_outside_fences, strict_json

ROOT = Path(__file__).resolve().parents[3]
PROTECTED = (
    sys.platform == "linux"
    and os.geteuid() == 0
    and all(sandbox.probe_protections().values())
    and all(cgroups.probe().values())
)
needs_isolation = pytest.mark.skipif(
    not PROTECTED, reason="needs root with mount, network, IPC and PID namespaces, no_new_privs and cgroups"
)
KEY = f"hostile-secret-{os.getpid()}"  # on the grader's command line: cmdline_spy looks for it
#: two tests on the torch transport (net_snoop's target); ring_allgather is where surrogate and
#: markdown_forge raise, and two jobs give record_race one record it surely forges
TESTS = ["test_other_transports[[]tree_broadcast-torch]", "test_other_transports[[]ring_allgather-torch]"]
#: attacks on the other slot: graded at the same time as alice
BESIDE = ("cpu_hog", "disk_fill", "mem_hog", "net_snoop")
#: ``python -m grader ...`` that says at exit how much memory the grader process itself peaked at
#: (RUSAGE_SELF: not its children, whose peaks -- a memory hog's -- reach us through waitpid)
GRADER_WITH_PEAK = (
    "import resource, runpy, sys\n"
    "sys.argv[0] = 'grader'\n"
    "try:\n"
    "    runpy.run_module('grader', run_name='__main__', alter_sys=True)\n"
    "finally:\n"
    "    print(f'grader peak: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss} KiB', file=sys.stderr)\n"
)


def ident(name: str) -> str:
    """The submission id of example ``name``: alice and BESIDE sort first (see the docstring)."""
    return f"0-{name}" if PROTECTED and name in ("alice", *BESIDE) else name


def shared_files() -> set[str]:
    """Every entry of the host's world-writable directories (the scanned ones)."""
    found = set()
    for folder in sandbox.world_writable_dirs():
        try:
            found.update(os.path.join(folder, name) for name in os.listdir(folder))
        except OSError:
            continue
    return found


def sysv_segments() -> set[str]:
    with open("/proc/sysvipc/shm") as file:
        return {line.split()[1] for line in file.readlines()[1:]}


def our_groups() -> list[Path]:
    """The grader's sandbox groups under our own cgroups (a grader running beside us has its
    own under ITS groups; cpu and pids are at the root here, so only names from this batch)."""
    found = []
    for controller in cgroups.CONTROLLERS:
        parent = cgroups._own_path(controller)
        if parent is not None:
            found += [path for path in parent.glob(f"{cgroups.PREFIX}*") if path.is_dir()]
    return found


def mounts_under(folder: Path) -> list[str]:
    prefix = str(folder.resolve()) + "/"
    with open("/proc/self/mountinfo") as info:
        return [line.split()[4] for line in info if line.split()[4].startswith(prefix)]


class Batch:
    """What one grading run of every hostile student left: the gradebook, the files, the state."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.submissions, self.out = tmp, tmp / "subs", tmp / "out"
        students = dict(robust.build_dict())
        if PROTECTED:
            students.update(isolation.build_dict())
            students.update(resources.build_dict())
        students["alice"] = {make.FILE: make.SOLUTION.read_bytes()}
        self.ids = {name: ident(name) for name in students}
        common.write(self.submissions, {self.ids[name]: files for name, files in students.items()})
        (self.submissions / "sparse").mkdir()
        subprocess.run(
            ["truncate", "-s", "10G", str(self.submissions / "sparse" / make.FILE)], check=True, timeout=30
        )
        self.command = [
            sys.executable,
            "-c",
            GRADER_WITH_PEAK,
            "grade",
            "a1_collectives",
            str(self.submissions),
        ]
        self.command += ["--out", str(self.out), "--seed-key", KEY, "--test-timeout", "30", "--timeout", "40"]
        self.command += ["--jobs", str(1 + len(BESIDE) if PROTECTED else 2)]
        for pattern in TESTS:
            self.command += ["--tests", pattern]
        self.before_files, self.before_shm = shared_files(), sysv_segments()
        self.before_groups = set(our_groups()) if PROTECTED else set()
        self.result = subprocess.run(
            self.command, cwd=ROOT, capture_output=True, timeout=800, start_new_session=True
        )
        peak = re.search(rb"grader peak: (\d+) KiB", self.result.stderr)
        self.peak_kib = int(peak.group(1)) if peak else None
        self.book = {}
        if (self.out / "gradebook.csv").is_file():
            with open(self.out / "gradebook.csv", newline="", encoding="utf-8") as file:
                self.book = {row["id"]: row for row in csv.DictReader(file)}

    def row(self, name: str) -> dict:
        return self.book[self.ids.get(name, name)]

    def results(self, name: str) -> dict:
        return strict_json((self.out / self.ids.get(name, name) / "results.json").read_text())

    def output(self, name: str) -> str:
        """What the submission's run printed (the end the grader keeps in results.json)."""
        return self.results(name)["output"]


@pytest.fixture(scope="module")
def batch(tmp_path_factory) -> Batch:
    return Batch(tmp_path_factory.mktemp("hostile"))


def full(row: dict) -> bool:
    return row["status"] == "ok" and float(row["score"]) == float(row["max_score"]) > 0


# --- the batch as a whole ---------------------------------------------------------------------
@pytest.mark.timeout(900)  # it may wait for another grading run's sandbox users first
def test_the_grader_finishes_and_writes_every_row(batch):
    output = batch.result.stdout.decode("utf-8") + batch.result.stderr.decode("utf-8")  # strict UTF-8
    assert batch.result.returncode == 0, output[-3000:]
    assert set(batch.book) == {*batch.ids.values(), "sparse"}
    assert b"\x1b[2J" not in batch.result.stdout
    assert b"\x1b[31m" not in batch.result.stdout + batch.result.stderr
    assert batch.peak_kib is not None and batch.peak_kib < 2 * 2**20, (
        f"the grader peaked at {batch.peak_kib} KiB"
    )


def test_alice_keeps_full_marks(batch):
    assert full(batch.row("alice")), batch.row("alice")


@needs_isolation
def test_every_attack_runs_and_none_is_refused_at_intake(batch):
    for name in (*isolation.ATTACKERS, *resources.ATTACKS, "record_race", "npy_bomb", "nan_record"):
        assert batch.row(name)["status"] not in ("forbidden", "invalid_submission"), batch.row(name)
    for name in isolation.ATTACKERS:  # the solution plus an attack on others: its own score is full
        if name != "net_snoop":  # which writes into its own sockets too: its own tests may fail
            assert full(batch.row(name)), batch.row(name)
    assert batch.row("net_snoop")["status"] == "ok", batch.row("net_snoop")


# --- isolation: nothing of another sandbox or the grader is reachable ---------------------------
@needs_isolation
def test_cmdline_spy_sees_only_its_own_sandbox_and_never_the_key(batch):
    said = re.findall(r"cmdline_spy: (\d+) command lines, (\d+) of the grader", batch.output("cmdline_spy"))
    assert said and all(int(seen) >= 2 and grader == "0" for seen, grader in said), said  # init + itself
    for path in batch.out.rglob("*"):
        if path.is_file() and path.name != ".seed-key":
            assert KEY.encode() not in path.read_bytes(), path


@needs_isolation
def test_sysv_segments_are_held_in_the_sandbox_and_gone_after_it(batch):
    assert "sysv_shm: 8 segments, 512 MiB held" in batch.output("sysv_shm"), batch.output("sysv_shm")
    assert sysv_segments() - batch.before_shm == set()


@needs_isolation
def test_files_planted_in_shared_directories_stay_in_the_sandbox(batch):
    planted = re.findall(r"setuid_plant: planted in (\d+) directories", batch.output("setuid_plant"))
    assert planted and int(planted[-1]) > 0, batch.output("setuid_plant")
    assert shared_files() - batch.before_files == set()


@needs_isolation
def test_net_snoop_ran_beside_alice(batch):
    assert "net_snoop: writing into every listening loopback port" in batch.output("net_snoop")
    assert full(batch.row("alice"))  # her TCPStore was out of its reach


# --- resources: cgroups and tmpfs bound each sandbox; nothing is left ---------------------------
@needs_isolation
def test_nothing_of_a_sandbox_is_left(batch):
    assert sandbox_processes() == []
    assert mounts_under(batch.tmp) == []
    assert not [path for path in set(our_groups()) - batch.before_groups if path.exists()]
    assert not (batch.out / ".sandbox").exists() or not any((batch.out / ".sandbox").iterdir())


# --- robust: the grader process survives what a submission returns ----------------------------
def test_hostile_records_and_names_get_their_expected_status(batch):
    for student, (status, score) in robust.EXPECTED.items():
        row = batch.row(student)
        assert row["status"] == status, (student, row)
        if score == "full":
            assert full(row), (student, row)
        elif score is not None:
            assert float(row["score"]) == score, (student, row)
    assert "reserved" in batch.row("gradebook.csv")["reason"]
    assert batch.row("sparse")["status"] == "invalid_submission"
    assert "larger than" in batch.row("sparse")["reason"]
    for student in ("surrogate", "markdown_forge"):  # ring_allgather raised: that test failed alone
        row = batch.row(student)
        for test in TESTS:
            name = test.replace("[[]", "[")
            assert row[name] == ("0" if "ring_allgather" in name else "1"), (student, name, row)
    assert "add up to more than" in json.dumps(batch.results("npy_bomb"))
    assert any("digits" in t["output"] for t in batch.results("nan_record")["tests"])


def test_a_forger_racing_the_harness_fails_only_itself(batch):
    row, tests = batch.row("record_race"), batch.results("record_race")["tests"]
    assert row["status"] == "ok", row  # the harness ran to its end; the grader read the forgeries
    assert "add up to more than" in tests[0]["output"], tests[0]  # the first record: surely forged
    assert all(not t["score"] for t in tests[:-1]), tests  # the last: the sandbox's end may win
    assert full(batch.row("alice"))


def test_every_written_file_is_clean_utf8_strict_json_and_one_score_line(batch):
    for path in batch.out.rglob("*"):
        if not path.is_file():
            continue
        data = path.read_bytes()
        data.decode("utf-8")
        assert b"\x1b" not in data, path
        if path.name == "feedback.md":
            scores = [line for line in lines_outside_fences(data.decode()) if "Score:" in line]
            assert len(scores) == 1 and scores[0].startswith("**Score: "), (path, scores)
        if path.suffix == ".json":
            strict_json(data.decode())


@pytest.mark.timeout(400)
def test_a_second_run_resumes_with_the_same_gradebook(batch):
    """Last: every submission is reused from its results.json, nothing is graded again."""
    before = (batch.out / "gradebook.csv").read_bytes()
    again = subprocess.run(batch.command, cwd=ROOT, capture_output=True, timeout=300, start_new_session=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (batch.out / "gradebook.csv").read_bytes() == before

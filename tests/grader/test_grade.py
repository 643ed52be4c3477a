"""``python -m grader grade a1_collectives``, piece by piece: intake, forbidden code, the run-time guard,
similarity, the budget checks on made-up reports, the wire format.

Fast: no grading batch. The batches (examples, solution, stub, resume) are ``batches/test_a1.py``.
"""

from __future__ import annotations

import ast
import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from grader import forbidden, intake, similarity, wire
from grader.a1_collectives import STUDENT_FILES
from grader.a1_collectives import reference as hidden
from grader.a1_collectives.grading import ASSIGNMENT as assignment
from grader.examples.a1_collectives import make

ROOT = Path(__file__).resolve().parents[2]


# --- the table (its completeness, pytest form and seeds: tests/grader/test_assignment.py) ------
def test_the_case_table_holds_every_world_size():
    names = [t.name for t in assignment.graded_tests(seed=12345)]
    assert len(names) >= 50
    assert {f"test_allreduce[{p}-ring_allreduce]" for p in hidden.ALL_WORLD_SIZES} <= set(names)


def test_feedback_never_shows_expected_values():
    message = "f: rank 1: element (3,) is 1.5, expected 2.25 (4 of 10 elements are wrong)"
    assert "2.25" not in assignment.redact(message) and "1.5" in assignment.redact(message)


# --- intake ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("submissions")
    make.build(folder, bad=True)
    return folder


INVALID = {name for name, (status, _) in make.BAD.items() if status == "invalid_submission"}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_intake_refuses_broken_and_hostile_submissions(examples, name):
    path = next(p for p in intake.discover(examples) if intake.student_id(p) == name)
    submission = intake.load(path, STUDENT_FILES)
    assert submission.error and not submission.files, submission.error


def test_intake_keeps_only_the_student_files_from_a_zip_with_an_extra_folder(examples):
    submission = intake.load(examples / "frank.zip", STUDENT_FILES)
    assert not submission.error
    assert set(submission.files) == {"collectives.py"}  # no conftest.py, pytest.ini or tests


def test_intake_counts_bytes_instead_of_trusting_the_zip_header(tmp_path):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("collectives.py", "x = 1\n")
        archive.writestr("big.bin", bytes(intake.MAX_TOTAL_BYTES + 1))
    (tmp_path / "mallory.zip").write_bytes(buffer.getvalue())
    assert "MiB" in intake.load(tmp_path / "mallory.zip", STUDENT_FILES).error


# --- what a submission may not use ------------------------------------------------------------
REFUSED = {  # source -> what the refusal must name
    "import minidist as md\n\ndef f(comm, t):\n    md.allreduce(comm, t)\n": "md.allreduce",
    "from minidist import allreduce as a\n": "minidist.allreduce",
    "from minidist.collectives import ring\n": "minidist.collectives",
    "import minidist.collectives.ring\n": "minidist.collectives",
    "import minidist\nx = minidist.collectives.ring.ring_allgather_\n": "minidist.collectives",
    "import minidist as md\nf = getattr(md, 'broadcast')\n": "minidist.broadcast",
    "from minidist import *\n": "import *",
    "import torch.distributed as dist\n": "torch.distributed",
    "import torch\nf = torch.distributed.all_reduce\n": "torch.distributed.all_reduce",
    "name = 'minidist.collectives.api'\n": "minidist.collectives",
    "exec('x = 1')\n": "exec",
    "f = eval\n": "eval",
    "__import__('minidist')\n": "__import__",
    "import importlib\n": "importlib",
    "from importlib import import_module\n": "importlib",
    "import gc\n": "gc",
    "import sys\nm = sys.modules\n": "sys.modules",
    "def f(comm):\n    return comm._comm.workspace\n": "comm._comm",
    "def f(self, t):\n    return self._comm\n": "self._comm",  # a parameter named self is not yours
    "class W:\n    def m(self):\n        return self._traffic\n": "self._traffic",  # W.m(comm)
    "class W:\n    def m(self, c):\n        self = c\n        return self._x\n": "self._x",
    "import minidist as md\nf = getattr(md, 'all' + 'reduce')\n": "computed at run time",
    "def f(comm, name):\n    return getattr(comm, name)\n": "computed at run time",
    "def f(comm):\n    setattr(comm, '_x', 1)\n": "private attribute",
    "import operator\n": "operator",
    "def f(g):\n    return g.__globals__\n": "__globals__",
    "text = open('/etc/passwd').read()\n": "open",
    # __init__ of anything but the submission's own super(): it could re-initialise the grader's objects
    "def f(comm):\n    comm.__init__(None)\n": "comm.__init__",
    "def super():\n    return 0\nclass A:\n    def __init__(self):\n        super().__init__()\n": "__init__",
    "class A:\n    def m(self, super):\n        super().__init__()\n": "__init__",
    # changing what the file imported: the grader's code in the sandbox uses it too
    "import time\ntime.perf_counter_ns = lambda: 0\n": "time.perf_counter_ns",
    "import torch.nn.functional as F\nF.cross_entropy = None\n": "F.cross_entropy",
    "import minidist as md\nmd.cost_model.DEFAULTS['shm'] = 1\n": "DEFAULTS",
    "def f(comm):\n    type(comm).stats = property(lambda s: 0)\n": "type(comm).stats",
    "import torch\nsetattr(torch, 'add', None)\n": "setattr(torch",
    "import time\ndel time.sleep\n": "time.sleep",
    # code run from strings, and files read unseen (issue 25)
    "from torch.package import PackageImporter\n": "torch.package",
    "import torch\nP = torch.package.PackageImporter\n": "torch.package",
    "import torch\nb = torch.from_file('x.py', size=9, dtype=torch.uint8)\n": "from_file",
    "import torch\nb = torch.UntypedStorage.from_file('x.py', False, 9)\n": "from_file",
    "import typing\nt = typing.ForwardRef('print(1)')\n": "ForwardRef",
    "class A:\n    __annotations__ = {'x=print(1)': int}\n": "__annotations__",
    # the grader's seeded builders of the hidden inputs, and its instruments (a8's review)
    "from seeding import seeded_\n": "seeding",
    "import instruments\n": "instruments",
    # what would see the grader's tensors and calls while they run (a5's and a4's reviews): every
    # assignment refuses them
    "from torch.overrides import TorchFunctionMode\n": "TorchFunctionMode",
    "import torch\nh = torch.autograd.graph.saved_tensors_hooks(print, print)\n": "saved_tensors_hooks",
}
ALLOWED = [
    "import os\nos._exit(0)\n",
    "__all__ = ['ring_allreduce']\n",
    "import dataclasses\n@dataclasses.dataclass\nclass Bucket:\n    size: int = 0\n",
    "import torch\nx = torch.zeros(3)\n",
    "def f(comm, t):\n    comm.send(t, 1)\n    comm.recv(t, 1)\n    comm.barrier()\n    return comm.stats\n",
    "class Ring:\n    def __init__(self):\n        self._chunks = []\n",
    "class Ring:\n    def size(self):\n        return len(self._chunks)\n",
    "import torch\nclass Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n",
    "class Bucket:\n    def done(self, b):\n        self.count -= 1\n        b.views[0] = 3\n",
    "def f(comm):\n    return getattr(comm, 'rank')\n",
    '"""Docstrings may say minidist.collectives.ring; they are prose."""\n',
    # another module's import of a library function: the intake cannot resolve it, the guard's job
    "from minidist.glove.trainers import data_parallel\nf = data_parallel.allreduce\n",
]


@pytest.mark.parametrize("source", list(REFUSED))
def test_intake_refuses_the_library_torch_and_dynamic_code(source):
    refusal = forbidden.check(source, assignment.forbidden)
    assert refusal is not None and REFUSED[source] in str(refusal), (source, refusal)
    assert str(refusal).startswith("line ")


@pytest.mark.parametrize("source", ALLOWED)
def test_intake_allows_point_to_point_code(source):
    assert forbidden.check(source, assignment.forbidden) is None


def test_intake_accepts_the_solution_the_stub_and_the_honest_examples():
    for path in (make.SOLUTION, make.STUB):
        assert forbidden.check(path.read_bytes(), assignment.forbidden) is None, path
    for name, content in make.realistic(make.SOLUTION.read_text(), make.STUB.read_text()).items():
        if isinstance(content, dict):
            assert forbidden.check(content[make.FILE], assignment.forbidden) is None, name


GUARDED = """
import sys
sys.path.insert(0, sys.argv[1])
import ast
import io
import torch.package
import guard, rules
package = io.BytesIO()  # written before the guard: importing from it afterwards compiles a string
with torch.package.PackageExporter(package) as exporter:
    exporter.save_source_string("m", "X = 1")
guard.install_rules(rules)
import attempts  # a module of the working directory: the student's, as far as the guard knows
attempts.run(package.getvalue())
"""
# the attempts, run from a module file in the working directory (where a submission's code lives)
ATTEMPTS = """
import importlib, io, sys
import torch
import minidist as md
import guard, student_comm


def run(package):
    attempts = {
        "md.allreduce": lambda: md.allreduce(None, torch.ones(2)),
        "alias": lambda: md.collectives.api.broadcast(None, torch.ones(2)),
        "getattr": lambda: getattr(md, "all" + "gather")(None, torch.ones(2)),
        "internals": lambda: importlib.import_module("minidist.collectives.ring").ring_allgather_(1, 2, 3),
        "reimport": lambda: (sys.modules.pop("minidist.collectives.ring"),
                             importlib.import_module("minidist.collectives.ring")),
        "source": lambda: open(md.collectives.ring.__file__).read(),
        "torch": lambda: torch.distributed.all_reduce(torch.ones(2)),
        "compiled": lambda: exec(compile("x = 1", md.collectives.ring.__file__, "exec")),
        "process group": lambda: torch.distributed.ProcessGroup.allreduce(None, [torch.ones(2)]),
        # issue 25: code made from a string, and a file read the audit hook does not see
        "string": lambda: exec("x = 1"),
        "torch.package": lambda: torch.package.PackageImporter(io.BytesIO(package)).import_module("m"),
        "from_file": lambda: torch.from_file(md.collectives.ring.__file__, size=9, dtype=torch.uint8),
        "storage": lambda: torch.UntypedStorage.from_file(md.collectives.ring.__file__, False, 9),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
        except (PermissionError, ImportError) as error:
            assert guard.MARKER in str(error), (name, error)
            print("refused", name)
        else:
            print("ALLOWED", name)
    import dataclasses, collections  # what the standard library compiles for itself still works
    made = dataclasses.make_dataclass("B", ["size"])(1).size, collections.namedtuple("P", "a")(2).a
    print("generated", *made)
    # ... and so does a package that compiles strings while it is imported, inside the student's call
    print("imported", importlib.import_module("mpmath").mpf(1) + 1)
    # a module's own __getattr__ (cost_model has one) stays a lookup: a missing name is an AttributeError
    packages = [m for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("minidist.")]
    print("lookups", all(not hasattr(m, "no_such_name_here") for m in packages))
    print("point-to-point", sorted(n for n in dir(student_comm.StudentComm) if not n.startswith("_")))
"""


def test_the_run_time_guard_refuses_every_way_to_the_library(tmp_path):
    for name in ("guard.py", "student_comm.py"):
        (tmp_path / name).write_bytes((ROOT / "grader" / name).read_bytes())
    (tmp_path / "rules.py").write_bytes((ROOT / "grader" / "a1_collectives" / "rules.py").read_bytes())
    (tmp_path / "attempts.py").write_text(ATTEMPTS)
    result = subprocess.run(
        [sys.executable, "-c", GUARDED, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ALLOWED" not in result.stdout, result.stdout
    assert result.stdout.count("refused") == 13, result.stdout
    assert "generated 1 2" in result.stdout and "imported 2.0" in result.stdout, result.stdout
    assert "lookups True" in result.stdout, result.stdout
    # the communicator a submission gets: point-to-point and the rest of the Communicator interface
    # (no workspace, no shortcut, counters it cannot reset: test_student_comm.py), no collective
    methods = [
        "barrier",
        "close",
        "irecv",
        "isend",
        "recv",
        "reset_stats",
        "send",
        "shared_workspace",
        "stats",
        "without_shortcuts",
    ]
    assert f"point-to-point {methods}" in result.stdout, result.stdout


def test_similarity_flags_a_copy_of_ring_py_and_not_the_solution_or_the_examples():
    root = ROOT
    library = similarity.library_functions(sorted(root.glob(assignment.similar_to[0])), root)
    copy = similarity.best_match(
        make.ring_copy(make.SOLUTION.read_text()), library, assignment.given_functions
    )
    assert copy.flagged and copy.library.startswith("lib/minidist/collectives/ring.py:"), copy
    honest = make.realistic(make.SOLUTION.read_text(), make.STUB.read_text())
    for name, content in honest.items():
        if isinstance(content, dict):
            match = similarity.best_match(content[make.FILE].decode(), library, assignment.given_functions)
            assert not match.flagged, (name, match)
    # renaming every variable does not hide a copy
    renamed = make.ring_copy(make.SOLUTION.read_text()).replace("flat", "vector").replace("bounds", "cuts")
    assert similarity.best_match(renamed, library, assignment.given_functions).flagged


# --- the budget checks, on made-up reports --------------------------------------------------
def ring_traffic(p: int, numel: int, itemsize: int) -> list[dict]:
    """Per-rank reports of a textbook ring allreduce, simulated here: chunk c has numel/p elements."""
    sizes = [numel // p + (1 if c < numel % p else 0) for c in range(p)]
    traffic = [{key: [0] * p for key in hidden.TRAFFIC_KEYS} for _ in range(p)]
    for phase_first in (1, 0):  # reduce-scatter sends chunk r - s - 1, allgather chunk r - s
        for step in range(p - 1):
            for rank in range(p):
                right, chunk = (rank + 1) % p, (rank - step - phase_first) % p
                traffic[rank]["sent_messages"][right] += 1
                traffic[rank]["sent_bytes"][right] += sizes[chunk] * itemsize
                traffic[right]["received_messages"][rank] += 1
                traffic[right]["received_bytes"][rank] += sizes[chunk] * itemsize
    for t in traffic:
        t["library_bytes"] = [sum(t["sent_bytes"]), sum(t["received_bytes"])]
    return traffic


def budget_failure(p: int, case: dict, traffic: list[dict]) -> str:
    outs = [[{"result": None, "traffic": t}] for t in traffic]
    with pytest.raises(pytest.fail.Exception) as failure:
        hidden.check_ring_allreduce_budget(p, [case], outs)
    return str(failure.value)


def test_the_ring_budget_is_exact_and_its_counters_are_cross_checked():
    p, case = 4, {"shape": (1001,), "seed": 0}
    textbook = ring_traffic(p, 1001, 4)  # the counts pass; the schedule then needs the transcripts
    assert "without a message transcript" in budget_failure(p, case, textbook)

    fewer = ring_traffic(p, 1001, 4)  # e.g. data moved through shared memory instead of messages
    for t in fewer:
        t["sent_bytes"] = [b // 2 for b in t["sent_bytes"]]
        t["received_bytes"] = [b // 2 for b in t["received_bytes"]]
        t["library_bytes"] = [sum(t["sent_bytes"]), sum(t["received_bytes"])]
    assert "under the exact count" in budget_failure(p, case, fewer)

    extra = ring_traffic(p, 1001, 4)  # one more message from every rank, to its right neighbour
    for rank, t in enumerate(extra):
        t["sent_messages"][(rank + 1) % p] += 1
        extra[(rank + 1) % p]["received_messages"][rank] += 1
    assert "messages sent = 7, over the budget of 6" in budget_failure(p, case, extra)

    forged = ring_traffic(p, 1001, 4)  # one rank's counters rewritten, its peers' not
    forged[0]["sent_bytes"][1] -= 4
    assert "were changed by the submission" in budget_failure(p, case, forged)

    around = ring_traffic(p, 1001, 4)  # the transport moved bytes the wrapper never saw
    around[2]["library_bytes"][0] += 4004
    assert "went around it" in budget_failure(p, case, around)

    star = ring_traffic(p, 1001, 4)  # everything to rank 0 and back, counted honestly
    for t in star:
        for key in hidden.TRAFFIC_KEYS:
            t[key] = [0] * p
    for rank in range(1, p):
        for a, b in ((rank, 0), (0, rank)):
            star[a]["sent_messages"][b] += 1
            star[a]["sent_bytes"][b] += 4004
            star[b]["received_messages"][a] += 1
            star[b]["received_bytes"][a] += 4004
    for t in star:
        t["library_bytes"] = [sum(t["sent_bytes"]), sum(t["received_bytes"])]
    message = budget_failure(p, case, star)
    assert "rank 0" in message and "over the budget" in message


def test_the_tree_budget_follows_the_docstring_tree_per_rank():
    # p = 6, rounds 0 -> 1 | 0 -> 2, 1 -> 3 | 0 -> 4, 1 -> 5 (2 -> 6 does not exist)
    assert [hidden.binomial_tree_sends(6, v) for v in range(6)] == [3, 2, 0, 0, 0, 0]
    assert [hidden.binomial_tree_sends(8, v) for v in range(8)] == [3, 2, 1, 1, 0, 0, 0, 0]
    assert hidden.chunk_range(10, 4, 3, 4) == (24, 36)


# --- the wire format ---------------------------------------------------------------------------
def test_wire_round_trip_and_refusals(tmp_path):
    values = {
        "scalar": torch.tensor(2.5),
        "bf16": torch.randn(3, 2).to(torch.bfloat16),
        "empty": torch.zeros(4, 0, dtype=torch.int64),
    }
    np.save(tmp_path / "t0-0.npy", values["scalar"].numpy())
    np.save(tmp_path / "t0-1.npy", values["bf16"].view(torch.int16).numpy())
    np.save(tmp_path / "t0-2.npy", values["empty"].numpy())
    record = {
        "value": [
            {"$tensor": "t0-0.npy", "dtype": "float32"},
            {"$tensor": "t0-1.npy", "dtype": "bfloat16"},
            {"$tensor": "t0-2.npy", "dtype": "int64"},
        ]
    }
    (tmp_path / "t0.json").write_text(json.dumps(record))
    got = wire.read_record(tmp_path, "t0")["value"]
    for tensor, expected in zip(got, values.values()):
        assert (
            tensor.dtype == expected.dtype
            and tensor.shape == expected.shape
            and torch.equal(tensor, expected)
        )

    # a pickled object array is never unpickled
    np.save(tmp_path / "evil.npy", np.array([object()], dtype=object), allow_pickle=True)
    for entry in ({"$tensor": "evil.npy", "dtype": "float32"}, {"$tensor": "../t0.json", "dtype": "float32"}):
        (tmp_path / "t1.json").write_text(json.dumps({"value": entry}))
        with pytest.raises(wire.WireError):
            wire.read_record(tmp_path, "t1")
    with pytest.raises(wire.WireError):
        wire.read_record(tmp_path, "t9")  # missing


def test_isolated_grading_runs_take_turns_with_the_sandbox_users(tmp_path, monkeypatch):
    # every run uses the same sandbox user ids and its cleanup kills all their processes:
    # a second run must wait for the first instead of having its sandboxes killed
    import threading
    import time

    from grader import grade

    monkeypatch.setattr(grade, "SANDBOX_USERS_LOCK", tmp_path / "users.lock")
    order = []

    def run(name, seconds):
        with grade.sandbox_users(True):
            order.append(f"{name} starts")
            time.sleep(seconds)
            order.append(f"{name} ends")

    first = threading.Thread(target=run, args=("first", 0.5))
    first.start()
    time.sleep(0.1)
    second = threading.Thread(target=run, args=("second", 0.0))
    second.start()
    first.join(10)
    second.join(10)
    assert order == ["first starts", "first ends", "second starts", "second ends"]
    with grade.sandbox_users(False):  # not isolated: no sandbox users, nothing to hold
        pass


def test_the_gradescope_bundle_holds_every_grader_module_its_modules_import():
    """``gradescope.GRADER_MODULES`` is a list kept by hand: a module the grader starts importing
    must be added to it, or the bundle fails at Gradescope (found once: ``ast_lock.py``). Imports
    at module level: a function's own (``release`` importing ``release_lectures`` for the
    instructor's ``release`` command) never runs there."""
    from grader import gradescope

    bundled = set(gradescope.GRADER_MODULES)
    for name in sorted(bundled):
        tree = ast.parse((ROOT / "grader" / name).read_text())
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                needed = [f"{node.module}.py"] if node.module else [f"{a.name}.py" for a in node.names]
                for module in needed:
                    if (ROOT / "grader" / module).is_file():
                        assert module in bundled, f"grader/{name} imports {module}, not in GRADER_MODULES"

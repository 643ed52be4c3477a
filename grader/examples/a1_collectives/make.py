"""Write example submissions of assignment 1, as an instructor would download them.

``python -m grader.examples.a1_collectives.make OUT [--bad]`` writes, into OUT:

* realistic students (``make grade`` grades these): ``alice`` (correct: the solution),
  ``bob`` (partially correct: broadcast, allgather and reduce-scatter right; a ring allreduce
  that gathers and sums -- right values, over the byte budget -- and no butterfly), ``carol``
  (wrong answers everywhere), ``dave`` (a ring allreduce in which every rank first waits for
  its left neighbour: a deadlock), ``erin`` (imports a module that does not exist), and
  ``frank.zip`` (correct, inside an extra folder, with a conftest.py and pytest.ini that must
  change nothing), ``library_auto`` (correct; its ``fast_allreduce`` is a copy of the library's
  ``md.allreduce(algorithm="auto")``: ring or butterfly by the cost model, never recursive
  doubling, so 1.98x and 1.59x the best textbook time on the measured tests, their third tier:
  2 of their 8 points, 92 of 98 in all);
* with ``--bad``, the hostile and broken cases the grader's tests use (``BAD``: each with
  the status and the score it must get on ``tests/grader/batches/test_a1.py``'s subset of tests), and
  the ones that cheat (``CHEATING``): a call of ``md.allreduce`` (refused at intake), the same
  function reached through another module that imports it (``data_parallel.allreduce``: the
  intake check cannot resolve it, the run time guard refuses the call), ``torch.distributed``'s
  allreduce, a gather-and-broadcast allreduce that forges ``comm.stats``, a copy of
  ``lib/minidist/collectives/ring.py`` (graded normally, flagged for the instructor), and three
  that rebuild every rank's input from the job's ``spec.json`` instead of communicating:
  ``no_comm`` (no messages), ``dummy_sends`` (zeros of the ring's sizes) and ``acausal_sums``
  (real sums, sent before their data could have arrived) -- the message transcripts fail them.

``MEASURED`` holds what alice and library_auto score on the measured tests.

The submissions are generated from ``solutions/`` and ``assignments/`` (so they follow the
assignment when it changes) plus the short snippets below; zips are built here, none is
committed.
"""

from __future__ import annotations

import ast
import io
import stat
import textwrap
import zipfile
from pathlib import Path

from grader.examples import common
from grader.examples.common import write, zip_bytes

ROOT = Path(__file__).resolve().parents[3]
SOLUTION = ROOT / "solutions" / "a1_collectives" / "collectives.py"
STUB = ROOT / "assignments" / "a1_collectives" / "collectives.py"
FILE = "collectives.py"


def replace_function(source: str, name: str, new: str) -> str:
    """``source`` with the top-level function ``name`` replaced by ``new`` (its full ``def``)."""
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    lines = source.splitlines(keepends=True)
    start = node.lineno - 1 - len(node.decorator_list)
    return (
        "".join(lines[:start]) + textwrap.dedent(new).strip("\n") + "\n" + "".join(lines[node.end_lineno :])
    )


def function_source(source: str, name: str) -> str:
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return "".join(source.splitlines(keepends=True)[node.lineno - 1 : node.end_lineno])


def prepend(source: str, code: str) -> str:
    """Insert ``code`` after the module's imports (it runs when the module is imported)."""
    marker = "from minidist import Communicator\n"
    return source.replace(marker, marker + "\n" + textwrap.dedent(code).strip("\n") + "\n", 1)


def with_prologue(source: str, name: str, code: str) -> str:
    """Run ``code`` at the start of function ``name`` (after its docstring), then the original body."""
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    first = node.body[1] if ast.get_docstring(node) else node.body[0]
    lines = source.splitlines(keepends=True)
    indent = " " * first.col_offset
    inserted = "".join(indent + line + "\n" for line in textwrap.dedent(code).strip("\n").splitlines())
    return "".join(lines[: first.lineno - 1]) + inserted + "".join(lines[first.lineno - 1 :])


# --- realistic students ----------------------------------------------------------------------
GATHER_ALLREDUCE = '''
def ring_allreduce(comm, tensor):
    """Allgather everything, then add it up: right values, far more bytes than a ring."""
    everything = ring_allgather(comm, tensor.contiguous())
    tensor.copy_(everything.sum(0))
'''

WRONG = {
    "tree_broadcast": """
def tree_broadcast(comm, tensor, src):
    if comm.rank != src:
        tensor.zero_()  # forgot to receive
""",
    "ring_allgather": """
def ring_allgather(comm, tensor):
    return torch.stack([tensor] * comm.world_size)  # my own tensor, p times
""",
    "ring_reduce_scatter": """
def ring_reduce_scatter(comm, tensor):
    m = tensor.shape[0] // comm.world_size
    return tensor[comm.rank * m : (comm.rank + 1) * m].clone()  # no sum
""",
    "ring_allreduce": """
def ring_allreduce(comm, tensor):
    tensor.mul_(comm.world_size)  # "everyone has about the same values"
""",
    "butterfly_allreduce": """
def butterfly_allreduce(comm, tensor):
    tensor.mul_(comm.world_size)
""",
}

RECV_FIRST_RING = '''
def ring_allreduce(comm, tensor):
    """Every rank first waits for its left neighbour... who waits for its own: a deadlock."""
    p, rank = comm.world_size, comm.rank
    if p == 1:
        return
    incoming = torch.empty_like(tensor)
    for _ in range(p - 1):
        comm.recv(incoming, (rank - 1) % p)
        comm.send(tensor, (rank + 1) % p)
        tensor += incoming
'''


LIBRARY_AUTO = """
def fast_allreduce(comm, tensor):
    \"\"\"md.allreduce(algorithm="auto") off shared memory, copied: the cheapest of star, tree, ring
    and butterfly by lecture 2's cost model with the library's constants for the pipe transport
    (cost_model.DEFAULTS); butterfly <= tree <= star always, so ring or butterfly runs.\"\"\"
    p, n = comm.world_size, tensor.numel() * tensor.element_size()
    if p == 1:
        return
    alpha, beta, gamma = 45e-6, 1 / 4e9, 5e-11
    q = 1 << (p.bit_length() - 1)
    ring = 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma
    butterfly = 2 * (q.bit_length() - 1) * alpha + 2 * (q - 1) / q * n * beta + (q - 1) / q * n * gamma
    if q != p:
        butterfly += 2 * (alpha + n * beta) + n * gamma
    if ring < butterfly:
        ring_allreduce(comm, tensor)
    else:
        butterfly_allreduce(comm, tensor)
"""


#: the measured tests of task 6 and what the solution and the library's copy score on them
MEASURED_TESTS = ("test_fast_allreduce_at_every_size[4]", "test_fast_allreduce_at_every_size[5]")
MEASURED = {"alice": 8, "library_auto": 2}


def realistic(solution: str, stub: str) -> dict[str, dict[str, bytes] | bytes]:
    """student -> {file: content} (a folder) or bytes (a .zip)."""
    bob = replace_function(solution, "ring_allreduce", GATHER_ALLREDUCE)
    bob = replace_function(bob, "butterfly_allreduce", function_source(stub, "butterfly_allreduce"))
    carol = solution
    for name, code in WRONG.items():
        carol = replace_function(carol, name, code)
    frank = {
        f"frank/{FILE}": solution.encode(),
        "frank/conftest.py": b"import pytest\n\n\ndef pytest_runtest_call(item):\n    pass\n",
        "frank/pytest.ini": b"[pytest]\naddopts = -p no:terminal\n",
        "frank/test_a1_collectives.py": b"def test_nothing():\n    assert True\n",
    }
    return {
        "alice": {FILE: solution.encode()},
        "bob": {FILE: bob.encode()},
        "carol": {FILE: carol.encode()},
        "dave": {FILE: replace_function(solution, "ring_allreduce", RECV_FIRST_RING).encode()},
        "erin": {FILE: prepend(solution, "import minidist_extras  # not installed anywhere").encode()},
        "frank.zip": zip_bytes(frank),
        "library_auto": {FILE: replace_function(solution, "fast_allreduce", LIBRARY_AUTO).encode()},
    }


# --- hostile and broken cases (tests) --------------------------------------------------------
FORK_BOMB = """
import os
while True:  # bounded by RLIMIT_NPROC and the test's timeout
    try:
        os.fork()
    except OSError:
        pass
"""
MEMORY_HOG = """
if comm.rank == 0:
    hog = []
    while True:  # 1 GiB a time, touched: stopped by RLIMIT_AS
        hog.append(torch.ones(2**28))
"""
FLOOD = """
import os
line = b"x" * 1023 + b"\\n"
block = line * 1024
while True:  # 1 MiB a time on stdout, until the test's timeout
    os.write(1, block)
"""
SLEEPER = """
import os
import subprocess
if os.fork() == 0:  # a daemon: new session, parent gone -- only its user id gives it away
    os.setsid()
    subprocess.Popen(["sleep", "1000"], start_new_session=True)
    os._exit(0)
"""
CHEAT = """
import json, os, sys
os.makedirs("results", exist_ok=True)
for index in range(100):  # fake records for every job the harness could run
    with open(os.path.join("results", f"t{index:03d}.json"), "w") as file:
        json.dump({"value": "PASSED", "seconds": 0}, file)
with open("results.json", "w") as file:
    json.dump({"score": 87, "max_score": 87, "tests": []}, file)
print("score: 87 / 87 points")
print("====== 71 passed ======")
try:
    import minidist, pytest  # monkeypatching in this process changes nothing elsewhere
    minidist.launch = lambda *args, **kwargs: "PASSED"
    pytest.fail = lambda *args, **kwargs: None
except Exception:
    pass
if os.fork() == 0:  # keep overwriting the real records while the grading goes on
    os.setsid()
    for _ in range(600):
        for name in os.listdir("results"):
            if name.endswith(".json"):
                try:
                    with open(os.path.join("results", name), "w") as file:
                        json.dump({"value": "PASSED", "seconds": 0}, file)
                except OSError:
                    pass
        import time
        time.sleep(0.05)
    os._exit(0)
"""
SNOOP = """
import glob, os
secrets = [
    "../../solutions/a1_collectives/collectives.py",
    "{root}/solutions/a1_collectives/collectives.py",
    "{root}/grader/a1_collectives/reference.py",
    "{root}/.git/HEAD",
    "/root/.bash_history",
]
found = [path for path in secrets if os.path.exists(path)]
found += glob.glob("/tmp/*/gradebook.csv") + glob.glob("/tmp/**/results.json", recursive=True)
if found:
    raise RuntimeError(f"could read: {{found}}")
"""


def bad_cases(solution: str, stub: str) -> dict[str, dict[str, bytes] | bytes]:
    def zip_with(*members: tuple[zipfile.ZipInfo | str, bytes]) -> bytes:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for info, data in members:
                archive.writestr(info, data)
        return buffer.getvalue()

    link = zipfile.ZipInfo(FILE)
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    return {
        "traversal.zip": zip_with((FILE, solution.encode()), ("../../escaped.py", b"x = 1\n")),
        "symlink.zip": zip_with((link, b"/etc/passwd")),
        "empty.zip": zip_with(),
        "corrupt.zip": b"PK\x03\x04 this is not really a zip file" * 10,
        "bomb.zip": zip_with((FILE, solution.encode()), ("data.bin", bytes(60 * 2**20))),
        "missing": {"notes.txt": b"I forgot to attach my code\n"},
        "syntax": {FILE: solution.replace("def tree_broadcast(", "def tree_broadcast((", 1).encode()},
        "exit_at_import": {FILE: prepend(stub, "import sys\nsys.exit(3)").encode()},
        "os_exit_at_import": {FILE: prepend(stub, "import os\nos._exit(0)").encode()},
        "os_exit_in_worker": {
            FILE: with_prologue(
                solution, "tree_broadcast", "import os\nif comm.rank == 1:\n    os._exit(7)"
            ).encode()
        },
        "infinite_loop": {FILE: with_prologue(solution, "ring_allgather", "while True:\n    pass").encode()},
        "fork_bomb": {FILE: with_prologue(solution, "ring_allgather", FORK_BOMB).encode()},
        "memory_hog": {FILE: with_prologue(solution, "ring_allgather", MEMORY_HOG).encode()},
        "flood": {FILE: with_prologue(solution, "ring_allgather", FLOOD).encode()},
        "sleeper": {FILE: with_prologue(solution, "tree_broadcast", SLEEPER).encode()},
        "cheat": {FILE: prepend(stub, CHEAT).encode()},
        "snoop": {FILE: with_prologue(solution, "tree_broadcast", SNOOP.format(root=ROOT)).encode()},
        "conftest": {
            FILE: stub.encode(),
            "conftest.py": b"import pytest\n\n\n@pytest.hookimpl(tryfirst=True)\n"
            b"def pytest_runtest_call(item):\n    return True\n",
            "pytest.ini": b"[pytest]\naddopts = -p no:python\n",
        },
    }


# --- submissions that use what the assignment forbids, or copy the library -----------------------
LIBRARY_CALL = """
def ring_allreduce(comm, tensor):
    md.allreduce(comm, tensor, algorithm="ring")  # the library's ring: refused at intake
"""
OBFUSCATED_CALL = """
def ring_allreduce(comm, tensor):
    # the library's allreduce, imported by another module: the intake check cannot resolve
    # the name, the run time guard refuses the call
    data_parallel.allreduce(comm, tensor)
"""
TORCH_CALL = """
def ring_allreduce(comm, tensor):
    dist.all_reduce(tensor)  # torch's collectives: refused at intake
"""
FORGED_STATS = """
def ring_allreduce(comm, tensor):
    \"\"\"Gather on rank 0 and broadcast back, then make comm.stats report what a ring would send.\"\"\"
    p, before = comm.world_size, comm.stats
    if comm.rank != 0:
        comm.send(tensor, 0)
        comm.recv(tensor, 0)
    else:
        incoming = torch.empty_like(tensor)
        for src in range(1, p):
            comm.recv(incoming, src)
            tensor += incoming
        for dst in range(1, p):
            comm.send(tensor, dst)
    ring_bytes = 2 * (p - 1) * -(-tensor.numel() // p) * tensor.element_size()
    forged = type(before)(before.bytes_sent + ring_bytes, before.messages_sent + 2 * (p - 1),
                          before.bytes_received + ring_bytes, before.messages_received + 2 * (p - 1))
    # type(comm).stats = ... is refused at intake; through a local name it passes, and changes
    # what the old grader read: now nobody does
    its_class = type(comm)
    its_class.stats = property(lambda self: forged)
"""
# lib/minidist/collectives/ring.py's two functions, pasted unchanged, and a ring_allreduce that
# calls them: correct, graded normally, and flagged for the instructor as a copy
RING_COPY_DRIVER = """
def combine_(acc, other, op):
    acc += other
    return acc


{ring_functions}


def ring_allreduce(comm, tensor):
    p = comm.world_size
    if p == 1:
        return
    flat = tensor.reshape(-1).clone(memory_format=torch.contiguous_format)
    offsets = chunk_offsets(flat.numel(), p)
    bounds = [(offsets[i], offsets[i + 1]) for i in range(p)]
    ring_reduce_scatter_(comm, flat, bounds, "sum")
    ring_allgather_(comm, flat, bounds)
    tensor.copy_(flat.view(tensor.shape))
"""
RING = ROOT / "lib" / "minidist" / "collectives" / "ring.py"

# issue 25: the library's ring.py and ops.py copied into the working directory while the module is
# imported (by a child process: a1 allows them), then imported; it says what it got
COPY_AT_IMPORT = """
import subprocess
import sys

_PACKAGE = "minidist.coll" + "ectives"  # one string would be refused at intake
_FIND = f"import {_PACKAGE}.ring as r, {_PACKAGE}.ops as o; print(r.__file__, o.__file__)"
_ONCE = f"test -s /tmp/where || {sys.executable} -c '{_FIND}' > /tmp/where; cat /tmp/where"  # one python
_paths = subprocess.run(["sh", "-c", _ONCE], capture_output=True, text=True).stdout.split()
_script = (
    "sed -e 's/from [.][.]comm/from minidist.comm/' -e 's/from [.]ops/from lib_ops/' $0 > lib_ring.py"
    " && cp $1 lib_ops.py"
)
_read = subprocess.run(["cat", *_paths], capture_output=True, text=True).stdout
_copied = subprocess.run(["sh", "-c", _script, *_paths], capture_output=True).returncode == 0
_what = "the stand-in" if "Covered by the grader" in _read else "the library's code"
print(f"copy_at_import: read {_what}, copied into the working directory: {_copied}", flush=True)
try:
    import lib_ring
except ImportError:
    lib_ring = None
"""
COPY_AT_IMPORT_ALLREDUCE = """
def ring_allreduce(comm, tensor):
    if lib_ring is None:
        raise NotImplementedError("the copy is not there")
    p = comm.world_size
    if p == 1:
        return
    flat = tensor.reshape(-1).clone(memory_format=torch.contiguous_format)
    offsets = chunk_offsets(flat.numel(), p)
    bounds = [(offsets[i], offsets[i + 1]) for i in range(p)]
    lib_ring.ring_reduce_scatter_(comm, flat, bounds, "sum")
    lib_ring.ring_allgather_(comm, flat, bounds)
    tensor.copy_(flat.view(tensor.shape))
"""

# answers computed without communicating (issue 15): every rank's input rebuilt from the job's
# spec.json (read by a child process: open() is refused at intake) with a copy of the grader's
# make_input (workers.py lies beside it, readable the same way; importing it is refused)
REBUILT_INPUTS = """
DTYPES = {"float32": torch.float32, "float64": torch.float64}
DTYPES.update(bfloat16=torch.bfloat16, int64=torch.int64)


def make_input(case, rank):
    \"\"\"workers.make_input, copied.\"\"\"
    shape, layout = tuple(case["shape"]), case.get("layout", "contiguous")
    dtype = DTYPES[case.get("dtype", "float32")]
    storage = {"transposed": shape[::-1], "strided": (*shape[:-1], 2 * shape[-1]) if shape else shape}
    generator = torch.Generator().manual_seed(100_003 * case["seed"] + rank)
    size = storage.get(layout, shape)
    if dtype.is_floating_point:
        values = (torch.randn(size, generator=generator, dtype=torch.float64) * 10).to(dtype)
    else:
        values = torch.randint(-1000, 1000, size, generator=generator, dtype=dtype)
    return values.t() if layout == "transposed" else values[..., ::2] if layout == "strided" else values


def rebuilt_inputs(comm, tensor):
    \"\"\"Every rank's input, without a single message.\"\"\"
    import json
    import subprocess

    listing = subprocess.run(["cat", "spec.json"], capture_output=True, text=True, timeout=30)
    for job in json.loads(listing.stdout)["jobs"]:
        for case in job["args"][1] if job["worker"] == "run_cases" else []:
            mine = make_input(case, comm.rank)
            if mine.shape == tensor.shape and mine.dtype == tensor.dtype and torch.equal(mine, tensor):
                return [make_input(case, rank) for rank in range(comm.world_size)]
    raise RuntimeError("no case in spec.json has this input")


def rebuilt_sum(comm, tensor):
    return torch.stack([x.double() for x in rebuilt_inputs(comm, tensor)]).sum(0).to(tensor.dtype)
"""
NO_COMM = {
    "tree_broadcast": """
def tree_broadcast(comm, tensor, src):
    tensor.copy_(rebuilt_inputs(comm, tensor)[src])
""",
    "ring_allgather": """
def ring_allgather(comm, tensor):
    return torch.stack(rebuilt_inputs(comm, tensor))
""",
    "ring_reduce_scatter": """
def ring_reduce_scatter(comm, tensor):
    if tensor.shape[0] % comm.world_size:
        raise ValueError("dim 0 must be a multiple of the world size")
    block = tensor.shape[0] // comm.world_size
    return rebuilt_sum(comm, tensor)[comm.rank * block : (comm.rank + 1) * block].clone()
""",
    "ring_allreduce": """
def ring_allreduce(comm, tensor):
    tensor.copy_(rebuilt_sum(comm, tensor))
""",
    "butterfly_allreduce": """
def butterfly_allreduce(comm, tensor):
    tensor.copy_(rebuilt_sum(comm, tensor))
""",
}
# the same sum, with the ring's messages: exactly the budgeted sizes, peers and count
DUMMY_SENDS = """
def ring_allreduce(comm, tensor):
    \"\"\"The sum rebuilt locally; zeros of the ring's sizes sent around the ring.\"\"\"
    p, rank = comm.world_size, comm.rank
    result = rebuilt_sum(comm, tensor)
    offsets = chunk_offsets(tensor.numel(), p)
    sizes = [offsets[i + 1] - offsets[i] for i in range(p)]
    for step in range(2 * (p - 1)):
        give, take = sizes[(rank - step - 1) % p], sizes[(rank - step - 2) % p]
        zeros, incoming = torch.zeros(give, dtype=tensor.dtype), torch.empty(take, dtype=tensor.dtype)
        exchange(comm, zeros, (rank + 1) % p, incoming, (rank - 1) % p)
    tensor.copy_(result)
"""
# real data of the right sizes: the complete sums of the chunks, from the first step on
ACAUSAL_SUMS = """
def ring_allreduce(comm, tensor):
    \"\"\"The sum rebuilt locally; its chunks sent around the ring as if they had been reduced.\"\"\"
    p, rank = comm.world_size, comm.rank
    flat = rebuilt_sum(comm, tensor).reshape(-1)
    offsets = chunk_offsets(flat.numel(), p)
    for step in range(2 * (p - 1)):
        give, take = (rank - step - 1) % p, (rank - step - 2) % p
        incoming = torch.empty(offsets[take + 1] - offsets[take], dtype=tensor.dtype)
        exchange(comm, flat[offsets[give] : offsets[give + 1]], (rank + 1) % p, incoming, (rank - 1) % p)
    tensor.copy_(flat.view(tensor.shape))
"""


def ring_copy(solution: str) -> str:
    """The solution with ring_allreduce replaced by the library's ring (``RING_COPY_DRIVER``)."""
    ring = RING.read_text()
    copied = [
        function_source(ring, name).rstrip("\n") for name in ("ring_reduce_scatter_", "ring_allgather_")
    ]
    code = RING_COPY_DRIVER.format(ring_functions="\n\n\n".join(copied))
    return replace_function(solution, "ring_allreduce", code)


def cheating(solution: str) -> dict[str, dict[str, bytes]]:
    with_md = prepend(solution, "import minidist as md")
    with_dist = prepend(solution, "import torch.distributed as dist")
    with_reexport = prepend(solution, "from minidist.glove.trainers import data_parallel")
    return {
        "library_call": {FILE: replace_function(with_md, "ring_allreduce", LIBRARY_CALL).encode()},
        "obfuscated_call": {
            FILE: replace_function(with_reexport, "ring_allreduce", OBFUSCATED_CALL).encode()
        },
        "torch_call": {FILE: replace_function(with_dist, "ring_allreduce", TORCH_CALL).encode()},
        "forged_stats": {FILE: replace_function(solution, "ring_allreduce", FORGED_STATS).encode()},
        "ring_copy": {FILE: ring_copy(solution).encode()},
        "no_comm": {FILE: without_messages(solution, NO_COMM).encode()},
        "dummy_sends": {FILE: without_messages(solution, {"ring_allreduce": DUMMY_SENDS}).encode()},
        "acausal_sums": {FILE: without_messages(solution, {"ring_allreduce": ACAUSAL_SUMS}).encode()},
        "copy_at_import": {FILE: copy_at_import(solution).encode()},
    }


def copy_at_import(solution: str) -> str:
    """The solution with ring_allreduce run by the library's ring, copied at import (``COPY_AT_IMPORT``)."""
    source = prepend(solution, COPY_AT_IMPORT.strip("\n"))
    return replace_function(source, "ring_allreduce", COPY_AT_IMPORT_ALLREDUCE)


def without_messages(solution: str, functions: dict[str, str]) -> str:
    """The solution with ``functions`` replaced by versions that rebuild the inputs locally."""
    source = solution.rstrip("\n") + "\n\n" + REBUILT_INPUTS
    for name, code in functions.items():
        source = replace_function(source, name, code)
    return source


#: student -> (status, score) on tests/grader/batches/test_a1.py's SUBSET (5 tests, 6 points);
#: forbidden: 0 in all
CHEATING = {
    "library_call": ("forbidden", 0),
    "obfuscated_call": ("forbidden", 0),
    "torch_call": ("forbidden", 0),
    "forged_stats": ("ok", 4),  # right values; the budget is read from the counters it cannot reach
    "ring_copy": ("ok", 6),  # graded normally, flagged in the gradebook (similarity to ring.py)
    # answers rebuilt from spec.json: no message reached the ranks (every test of the subset fails)
    "no_comm": ("ok", 0),
    # the same with messages of the budgeted sizes: zeros, then real sums sent before they could
    # have been computed; tree, allgather and butterfly are the solution's (3 of 6)
    "dummy_sends": ("ok", 3),
    "acausal_sums": ("ok", 3),
    # the library's ring copied at import (issue 25): it reads the stand-in and cannot write the
    # working directory, so its ring_allreduce has nothing to run (3 of 6: allreduce[3-*] and the
    # budget test run it)
    "copy_at_import": ("ok", 3),
}

#: student -> (status, score) on tests/grader/batches/test_a1.py's SUBSET (5 tests, 6 points)
BAD = {
    "traversal": ("invalid_submission", 0),
    "symlink": ("invalid_submission", 0),
    "empty": ("invalid_submission", 0),
    "corrupt": ("invalid_submission", 0),
    "bomb": ("invalid_submission", 0),
    "missing": ("invalid_submission", 0),
    "syntax": ("invalid_submission", 0),
    "exit_at_import": ("import_error", 0),
    "os_exit_at_import": ("import_error", 0),  # the harness imports it in a child first
    "os_exit_in_worker": ("ok", 5),
    "infinite_loop": ("ok", 5),
    "fork_bomb": ("ok", 5),
    "memory_hog": ("ok", 5),
    "flood": ("ok", 5),
    "sleeper": ("ok", 6),
    "cheat": ("forbidden", 0),  # writes files with open(): refused at intake,
    "snoop": ("ok", 6),
    "conftest": ("ok", 0),
}


def build_dict(bad: bool = False) -> dict[str, dict[str, bytes] | bytes]:
    solution, stub = SOLUTION.read_text(), STUB.read_text()
    submissions = realistic(solution, stub)
    if bad:
        submissions.update(bad_cases(solution, stub))
        submissions.update(cheating(solution))
    return submissions


def build(out: Path, bad: bool = False) -> list[Path]:
    return write(out, build_dict(bad))


def main() -> None:
    common.main(__doc__, build, bad=True)


if __name__ == "__main__":
    main()

"""Write example submissions of assignment 3, as an instructor would download them.

``python -m grader.examples.a3_ddp.make OUT`` writes, into OUT:

* ``alice``: correct (the solution);
* ``bob``: no overlap: the hooks only copy gradients, and every bucket is launched when
  backward ends -- right gradients, the right number of allreduces, nothing overlapped;
* ``carol``: sums instead of averaging (never divides by the number of ranks);
* ``dave``: ignores ``find_unused_parameters``: at the end of backward it waits for every
  bucket to be launched by a hook, which never happens for a bucket with an unused parameter
  (a hang: a timeout in those tests, full points in the others);
* ``erin``: crashes: looks its parameter up by the tensor instead of its ``id()`` (a
  RuntimeError in the first hook: a tensor cannot be compared with the dict's keys); only
  task 1 earns points;
* ``frank``: hands the work to the library's ``md.DistributedDataParallel``: refused at
  intake, status ``forbidden``;
* ``lazy``: launches bucket 0 from its hook and every other bucket when backward ends: right
  gradients and counts, but only the first bucket overlaps backward -- loses the overlap test;
* ``trent``: bob, who also replaces ``time.perf_counter_ns`` with a clock that reads 0 right
  after each launch, to make the allreduces look early: refused at intake (it changes a module
  it imported), or, where the intake check lets it through, the grader's clock (bound before the
  submission is imported) and its order of events ignore it and trent loses what bob loses;
* ``mallory``: a ``no_sync`` that does not stop the allreduces (the gradients still come out
  right: averaging is linear) but appends to the recorder's ``phase`` so the grader's log would
  file them under another micro-step: the recorder it gets has ``begin`` and ``end`` only, so
  ``no_sync`` raises and mallory loses the no_sync tests;
* ``tess``: a slip in the bucket rule (the buckets in registration order, not reversed): its
  DDP is right for the buckets it made, so it loses task 1's test only (tasks 2-4 are held to
  its own buckets);
* ``lena``: the library's DDP as it is -- its bucket rule, its launch order and its default
  cap, 1 MiB (``tuned_bucket_mb`` returns 1.0): right everywhere, and on the measured test
  1.23x the lower bound, the second tier (3 of its 6 points; ``PARTIAL``). The solution's cap,
  chosen by predicting each cap's step, reaches 1.03x.

Forgeries of the communication (issue 25: what is counted must be what is carried). Each gets
the averaged gradients right by a channel past the per-bucket allreduce, so it keeps task 1 and
the equivalence tests -- its honest part, 19 points -- and loses the count, overlap, span and
no_sync tests, which require each bucket's allreduce to carry its gradient and nothing else to
communicate:

* ``decoy``: allreduces of zeros of each bucket's size, launched at the right moment; the real
  sum by ``md.reduce`` + ``md.broadcast`` after backward;
* ``overwrite``: the right allreduces, but the gradients then overwritten with a
  ``md.reduce`` + ``md.broadcast`` of a copy of the local ones;
* ``whisper``: decoy allreduces, the real sum by point-to-point messages on the communicator;
* ``mimic``: allreduces of another tensor of each bucket's size (its parameters), the real sum
  by ``md.allgather``;
* ``echo``: decoy allreduces at the right moment, the real (blocking) allreduces after backward:
  honest but not overlapped, with two allreduces per bucket -- loses count, overlap and no_sync,
  keeps the spans (21);
* ``oscar``: decoy allreduces, the real sum by messages on the transport's own communicator
  behind the one it was given (``comm._comm``): refused at intake; past the intake, its decoys
  carry no bucket's gradient (``tests/grader/batches/test_a3.py``), and the transport's byte count
  would give its messages away next.

``LOST`` lists the hidden tests each one fails; ``EXPECTED`` holds the status and score each
must get on all the hidden tests (``expected_score`` for a subset). The submissions are generated
from ``solutions/`` (so they follow the assignment when it changes); nothing here is committed
but this script.
"""

from __future__ import annotations

from pathlib import Path

from grader import forbidden
from grader.a3_ddp.grading import ASSIGNMENT
from grader.examples import common
from grader.examples.common import edit, write

ROOT = Path(__file__).resolve().parents[3]
SOLUTION = ROOT / "solutions" / "a3_ddp" / "ddp.py"
STUB = ROOT / "assignments" / "a3_ddp" / "ddp.py"
FILE = "ddp.py"

_UNUSED = (
    "test_matches_one_process[unused-3-pipe]",
    "test_matches_one_process[mixed-2-shm]",
    "test_one_allreduce_per_bucket[mixed-2-pipe]",
)
_VALUES = tuple(
    t.name for t in ASSIGNMENT.graded_tests(0) if t.name.startswith(("test_matches", "test_no_sync"))
)
_ALL = tuple(t.name for t in ASSIGNMENT.graded_tests(0))
_NO_SYNC = tuple(name for name in _ALL if name.startswith("test_no_sync"))
_OVERLAP = ("test_overlap[tied-2-shm]",)
_MEASURED = "test_step_time[timed-2-1gbit]"
_COUNT = tuple(name for name in _ALL if name.startswith("test_one_allreduce_per_bucket"))
#: what a forged communication loses: every test of tasks 2-4 but the equivalence ones
_COMMUNICATION = tuple(
    name
    for name in _ALL
    if name.startswith(("test_one_allreduce", "test_overlap", "test_trace", "test_no_sync", "test_step_time"))
)


def _lost() -> dict[str, tuple[str, tuple[str, ...]]]:
    """student -> (status, the hidden tests it loses). trent's status is what the intake check
    says of trent's file: ``forbidden`` (every test lost) where it refuses replacing a function
    of an imported module, else ``ok`` and bob's loss (the run time defence)."""
    refused = forbidden.check(build_dict()["trent"][FILE].decode(), ASSIGNMENT.forbidden)
    trent = "forbidden" if refused else "ok"
    return {
        "alice": ("ok", ()),
        "bob": ("ok", (*_OVERLAP, _MEASURED)),
        "carol": ("ok", (*_VALUES, _MEASURED)),
        "dave": ("ok", _UNUSED),
        "erin": ("ok", tuple(name for name in _ALL if name != "test_assign_buckets")),
        "frank": ("forbidden", _ALL),
        "lazy": ("ok", (*_OVERLAP, _MEASURED)),
        "trent": (trent, _ALL if trent == "forbidden" else (*_OVERLAP, _MEASURED)),
        "mallory": ("ok", _NO_SYNC),
        "tess": ("ok", ("test_assign_buckets", _MEASURED)),
        "lena": ("ok", ()),
        **{name: ("ok", _COMMUNICATION) for name in ("decoy", "overwrite", "whisper", "mimic")},
        "echo": ("ok", (*_COUNT, *_OVERLAP, *_NO_SYNC, _MEASURED)),
        "oscar": ("forbidden", _ALL),
    }


#: student -> {measured test: the fraction of its points earned} (the others: all or nothing)
PARTIAL = {"lena": {_MEASURED: 0.5}}


def expected_score(student: str, tests: list[str] | None = None) -> float:
    """The points ``student`` must get on ``tests`` (default: every hidden test)."""
    points = {t.name: t.points for t in ASSIGNMENT.graded_tests(0)}
    tests = list(points) if tests is None else tests
    partial = PARTIAL.get(student, {})
    return sum(points[name] * partial.get(name, 1.0) for name in tests if name not in LOST[student][1])


FINISH_START = (
    "        self._finish_queued = False\n        missing = [b for b in self._buckets if b.work is None]\n"
)
NO_OVERLAP_HOOK = """        if not self._synchronizing:
            return
        if not self._finish_queued:
            self._finish_queued = True
            call_when_backward_ends(self._finish_backward)
        bucket, position = self._where[id(param)]
        bucket.slot(position).copy_(param.grad)
        bucket.waiting.discard(position)
"""
NO_OVERLAP_FINISH = """        self._finish_queued = False
        for bucket in self._buckets:  # everything after backward: nothing overlaps
            for position in bucket.waiting:
                bucket.slot(position).zero_()
            self._launch(bucket)
        missing = []
"""


FAKE_CLOCK = """_real_clock = time.perf_counter_ns
_early = [False]


def _clock():
    if _early[0]:
        _early[0] = False
        return 0
    return _real_clock()


time.perf_counter_ns = _clock

"""


def build_dict() -> dict[str, dict[str, bytes]]:
    solution = SOLUTION.read_text()
    hook_start = "        if not self._synchronizing:\n            return\n"
    hook_end = solution[solution.index("        while self._next_launch < len(self._buckets)") :]
    hook_end = hook_end[: hook_end.index("        ### END SOLUTION\n")]
    hook = solution[solution.index(hook_start) : solution.index(hook_end) + len(hook_end)]
    bob = edit(solution, hook, NO_OVERLAP_HOOK)
    bob = edit(
        bob,
        FINISH_START,
        NO_OVERLAP_FINISH,
    )
    carol = edit(solution, "            bucket.flat.div_(self.comm.world_size)\n", "")
    dave = edit(
        solution,
        FINISH_START,
        "        self._finish_queued = False\n"
        "        while any(b.work is None for b in self._buckets):  # wait for the hooks to launch all\n"
        "            time.sleep(0.01)\n"
        "        missing = []\n",
    )
    dave = edit(dave, "import contextlib\n", "import contextlib\nimport time\n")
    erin = edit(
        solution,
        "        bucket, position = self._where[id(param)]\n",
        "        bucket, position = self._where[param]\n",
    )
    frank = edit(
        solution,
        "    def __call__(self, *args, **kwargs):\n",
        "    def delegate(self):\n"
        "        return md.DistributedDataParallel(self.module, self.comm, find_unused_parameters=True)\n\n"
        "    def __call__(self, *args, **kwargs):\n",
    )
    lazy = edit(
        solution,
        hook_end,
        "        if not bucket.waiting and bucket.index == 0:\n            self._launch(bucket)\n",
    )
    lazy = edit(
        lazy,
        FINISH_START,
        "        self._finish_queued = False\n"
        "        for bucket in self._buckets:  # the other complete buckets only now\n"
        "            if bucket.work is None and not bucket.waiting:\n"
        "                self._launch(bucket)\n"
        "        missing = [b for b in self._buckets if b.work is None]\n",
    )
    trent = edit(bob, "import contextlib\n", "import contextlib\nimport time\n")
    trent = edit(trent, "MIB = 1 << 20", FAKE_CLOCK + "MIB = 1 << 20")
    trent = edit(
        trent,
        "        bucket.work = md.allreduce(",
        "        _early[0] = True  # the allreduce log's clock reads 0\n        bucket.work = md.allreduce(",
    )
    mallory = edit(
        solution,
        "        previous = self._synchronizing\n        self._synchronizing = False\n        try:\n",
        "        previous = self._synchronizing\n"
        "        if self.recorder is not None:  # file this backward's allreduces under another phase\n"
        "            self.recorder.phase.append(-1)\n"
        "        try:\n",
    )
    tess = edit(solution, "    for name, param in reversed(order):\n", "    for name, param in order:\n")
    tuned_start = "    ### BEGIN SOLUTION TODO(task 4): write tuned_bucket_mb\n"
    begin = solution.index(tuned_start) + len(tuned_start)
    end = solution.index("    ### END SOLUTION\n", begin)
    lena = (
        solution[:begin]
        + "    return 1.0  # the library's default cap (DistributedDataParallel(bucket_mb=1.0))\n"
        + solution[end:]
    )
    texts = (solution, bob, carol, dave, erin, frank, lazy, trent, mallory, tess, lena)
    names = ("alice", "bob", "carol", "dave", "erin", "frank", "lazy", "trent", "mallory", "tess", "lena")
    forged = {name: forgery(solution, *edits) for name, edits in FORGERIES.items()}
    return {name: {FILE: text.encode()} for name, text in [*zip(names, texts), *forged.items()]}


LAUNCH = '        bucket.work = md.allreduce(self.comm, bucket.flat, op="sum", async_op=True)\n'
DECOY = (
    '        bucket.work = md.allreduce(self.comm, torch.zeros_like(bucket.flat), op="sum", async_op=True)\n'
)
FINISH = "            bucket.work.wait()\n            bucket.flat.div_(self.comm.world_size)\n"
#: student -> (new _launch line, new start of each bucket's finish): edits of the solution
FORGERIES = {
    "decoy": (
        DECOY,
        "            bucket.work.wait()\n"
        "            md.reduce(self.comm, bucket.flat, dst=0)  # the real sum, past the count\n"
        "            md.broadcast(self.comm, bucket.flat, src=0)\n"
        "            bucket.flat.div_(self.comm.world_size)\n",
    ),
    "overwrite": (
        "        bucket.local = bucket.flat.clone()\n" + LAUNCH,
        "            bucket.work.wait()\n"
        "            md.reduce(self.comm, bucket.local, dst=0)  # the answer taken from elsewhere\n"
        "            md.broadcast(self.comm, bucket.local, src=0)\n"
        "            bucket.flat.copy_(bucket.local).div_(self.comm.world_size)\n",
    ),
    "whisper": (
        DECOY,
        "            bucket.work.wait()\n"
        "            total, incoming = bucket.flat.clone(), torch.empty_like(bucket.flat)\n"
        "            for peer in range(self.comm.world_size):  # the real sum, by messages\n"
        "                if peer != self.comm.rank:\n"
        "                    sending = self.comm.isend(bucket.flat, peer)\n"
        "                    self.comm.recv(incoming, peer)\n"
        "                    sending.wait()\n"
        "                    total += incoming\n"
        "            bucket.flat.copy_(total).div_(self.comm.world_size)\n",
    ),
    "mimic": (
        "        same_size = torch.cat([p.detach().reshape(-1) for p in bucket.params])\n"
        '        bucket.work = md.allreduce(self.comm, same_size, op="sum", async_op=True)\n',
        "            bucket.work.wait()\n"
        "            gathered = md.allgather(self.comm, bucket.flat)  # the real sum\n"
        "            bucket.flat.copy_(gathered.sum(0)).div_(self.comm.world_size)\n",
    ),
    "echo": (
        DECOY,
        "            bucket.work.wait()\n"
        '            md.allreduce(self.comm, bucket.flat, op="sum")  # the real one, after backward\n'
        "            bucket.flat.div_(self.comm.world_size)\n",
    ),
    "oscar": (
        DECOY,
        "            bucket.work.wait()\n"
        "            transport = self.comm._comm  # behind the communicator it was given\n"
        "            total, incoming = bucket.flat.clone(), torch.empty_like(bucket.flat)\n"
        "            for peer in range(transport.world_size):\n"
        "                if peer != transport.rank:\n"
        "                    sending = transport.isend(bucket.flat, peer)\n"
        "                    transport.recv(incoming, peer)\n"
        "                    sending.wait()\n"
        "                    total += incoming\n"
        "            bucket.flat.copy_(total).div_(self.comm.world_size)\n",
    ),
}


def forgery(solution: str, launch: str, finish: str) -> str:
    """The solution with its allreduce launch and the start of each bucket's finish replaced."""
    return edit(edit(solution, LAUNCH, launch), FINISH, finish)


#: student -> (status, the hidden tests it loses)
LOST = _lost()
#: student -> (status, score on every hidden test, out of 43)
EXPECTED = {student: (status, expected_score(student)) for student, (status, _) in LOST.items()}


def build(out: Path) -> list[Path]:
    return write(out, build_dict())


def main() -> None:
    common.main(__doc__, build)


if __name__ == "__main__":
    main()

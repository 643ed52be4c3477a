"""Write example submissions of assignment 4, as an instructor would download them.

``python -m grader.examples.a4_compression.make OUT`` writes, into OUT:

* ``alice``: correct (the solution);
* ``bob``: no error feedback: after sending, the whole accumulation is dropped (``v = 0``), not
  only the entries sent -- loses the sequences, the error-feedback test, the hook's values and
  convergence; keeps the schedule, clipping, the selection and the bytes;
* ``carol``: an exact top-k (a stable sort of all n magnitudes) instead of the sampled
  threshold. Honest and often better, but not the algorithm asked for, and the grader compares
  indices exactly: she loses the two tests where the sample is smaller than the bucket (the
  sampled selection and the sampled sequence) and keeps everything else -- where the sample is
  every entry the recipe *is* the exact top-k (ties to the smaller index), her bytes are the
  same k slots, and her run converges;
* ``dave``: no momentum correction: accumulates the raw gradient (``v += g``) instead of the
  velocity -- loses both sequences, the hook's values and convergence (plain SGD underneath);
  keeps the error-feedback test (it runs with momentum 0, where the two are the same);
* ``erin``: crashes: the hook looks its bucket's state up before making it (a KeyError in the
  first hook call): every test that runs the hook fails (convergence and task 4 too), the others
  keep their points;
* ``frank``: hands the selection to the library's ``select_indices``
  (``minidist.parallel.compression``): refused at intake, status ``forbidden``;
* ``gina``: dave's run (no momentum correction) that hides its loss: she replaces
  ``torch.nn.functional.cross_entropy`` by one returning 0 whenever autograd is off (the final
  evaluation). The grader binds the loss before importing her module and recomputes it from the
  reported parameters: she loses what dave loses (or, should the intake check refuse her patch,
  everything: ``GINA_STATUS``);
* ``hank``: no compression at all: the hook keeps a momentum velocity and averages it densely
  with an allreduce (momentum SGD, which converges): loses the hook's values, the bytes and
  convergence (the bytes rule applies there too) and the measured test; keeps the tests without a
  hook;
* ``ivan``: a ``compress_step`` that never sends: it accumulates and returns nothing (with
  momentum 0 that conserves mass): loses the sequences, the error-feedback test (1 to k indices a
  step, something nonzero), the hook's values and convergence; keeps the schedule, clipping,
  the selection and the bytes (his hook still allgathers k padded slots).

* ``olga``: a copy of the library's DGC: the functions are the library's algorithm (as the
  solution's are: ``tests/grader/test_grade_a4.py`` checks the grader's DGC against the
  library's), and ``measured_hook`` returns the library's hook with its defaults, ``DGCConfig()``
  (99.9%, no warm-up): about 370x fewer bytes than dense to the target loss, the second tier of
  the measured test (3 of its 6 points; ``PARTIAL``). The solution's 99.95% reaches about 605x.

bob, dave and ivan never reach the measured test's target loss (0 of its points); carol's exact
top-k does, at about 610x (full points).

Cheats that train without averaging what was sent (issue 25): each allgathers k slots of the
right size, so they passed every count and, before the grader tied the update to the payloads,
scored 32/36 (only the simulation test lost). The grader now logs a copy of every allgather's
payload (the copy is what the transport carries) and checks that every rank applied the mean of
those payloads, unpacked by its own code, and that the ranks end bit for bit equal
(``reference.applied_check``; in the measured test, the replay from the payloads): each keeps only
the tests without a hook (22 of 42), whatever route its data took:

* ``kate``: no averaging at all: k empty slots allgathered, each rank steps on its own momentum
  velocity (its own data only); the ranks drift apart;
* ``liam``: a dense average exchanged through files in the sandbox's temporary folder, the
  allgather (k empty slots) used as a barrier; momentum SGD on that average;
* ``mona``: the right payload allgathered, but only the rank's own row applied;
* ``nick``: the right payload allgathered, but a dense average exchanged through ``/dev/shm``
  applied (momentum SGD): the ranks agree, the update is not what was sent.

``LOST`` lists the hidden tests each one fails, ``PARTIAL`` the fraction of a measured test's
points one earns; ``EXPECTED`` holds the status and score each must get on all the hidden tests
(``expected_score`` for a subset). The submissions are generated
from ``solutions/`` (so they follow the assignment when it changes); nothing here is committed
but this script.
"""

from __future__ import annotations

from pathlib import Path

from grader import forbidden
from grader.a4_compression.grading import ASSIGNMENT
from grader.examples import common
from grader.examples.common import edit, write

ROOT = Path(__file__).resolve().parents[3]
SOLUTION = ROOT / "solutions" / "a4_compression" / "dgc.py"
STUB = ROOT / "assignments" / "a4_compression" / "dgc.py"
FILE = "dgc.py"

_ALL = tuple(t.name for t in ASSIGNMENT.graded_tests(0))
_HOOK = tuple(name for name in _ALL if name.startswith(("test_hook", "test_bytes", "test_converges")))
_SEQUENCES = tuple(name for name in _ALL if name.startswith("test_compress_sequence["))
_MEASURED = "test_bytes_to_target_loss[2-pipe]"
_VALUES = (*_SEQUENCES, "test_hook_matches_simulation[2-pipe]", "test_converges[2-shm]", _MEASURED)
#: gina: the loss is 0 whenever autograd is off (the final evaluation); training is untouched
HIDE_THE_LOSS = """

def _hide_the_loss(functional):
    real = functional.cross_entropy

    def cross_entropy(input, target, *args, **kwargs):
        if torch.is_grad_enabled():
            return real(input, target, *args, **kwargs)
        return torch.zeros(())

    functional.cross_entropy = cross_entropy


_hide_the_loss(torch.nn.functional)
"""

#: hank: momentum SGD through the hook, no compression (a dense allreduce of the velocity)
DENSE_HOOK = """        if bucket_index not in self.states:
            self.states[bucket_index] = DGCState.zeros_like(flat_grad)
        velocity = self.states[bucket_index].velocity
        velocity.mul_(self.config.momentum).add_(flat_grad)
        work = md.allreduce(comm, velocity.clone(), async_op=True)
        world_size = comm.world_size

        class Mean:
            def wait(self):
                return work.wait().div(world_size)

        return Mean()
"""

#: ivan: accumulates and never sends (empty indices and values)
NEVER_SENDS = """    if config.clip_norm is not None:
        grad = clip_local(grad, config.clip_norm, world_size)
    u, v = state.velocity, state.accumulated
    u.mul_(config.momentum).add_(grad)
    v.add_(u)
    state.step += 1
    return torch.zeros(0, dtype=torch.long), v.new_zeros(0)
"""

#: kate: k empty slots on the wire (a barrier); each rank steps on its own velocity
OWN_DATA_HOOK = """        if bucket_index not in self.states:
            self.states[bucket_index] = DGCState.zeros_like(flat_grad)
        state = self.states[bucket_index]
        slots = slots_for(flat_grad.numel(), sparsity_at(state.step, self.config))
        state.step += 1
        velocity = state.velocity.mul_(self.config.momentum).add_(flat_grad).clone()
        empty = pack(torch.zeros(0, dtype=torch.long), torch.zeros(0), slots)
        barrier = md.allgather(comm, empty, async_op=True)

        class OwnData:
            def wait(self):
                barrier.wait()
                return velocity

        return OwnData()
"""

#: liam, nick: every rank's dense gradient through files in FOLDER; the allgather (k empty slots,
#: or the right payload) only makes sure every file is written; momentum SGD on the dense average
SIDE_CHANNEL_HOOK = """        if self.generator is None:
            self.generator = torch.Generator()
            self.generator.manual_seed(self.config.seed * 1000 + comm.rank)
        if bucket_index not in self.states:
            self.states[bucket_index] = DGCState.zeros_like(flat_grad)
            _DENSE_VELOCITY[bucket_index] = torch.zeros_like(flat_grad)
        state = self.states[bucket_index]
        slots = slots_for(flat_grad.numel(), sparsity_at(state.step, self.config))
        tag = f"dgc-{os.getppid()}-{bucket_index}-{state.step}"
        names = [os.path.join(FOLDER, f"{tag}-{r}") for r in range(comm.world_size)]
{write}
{payload}
        barrier = md.allgather(comm, payload, async_op=True)
        velocity, momentum = _DENSE_VELOCITY[bucket_index], self.config.momentum

        class Dense:
            def wait(self):
                barrier.wait()
                total = torch.zeros_like(velocity)
                for name in names:
{read}
                return velocity.mul_(momentum).add_(total / len(names)).clone()

        return Dense()
"""
EMPTY_SLOTS = """        state.step += 1
        payload = pack(torch.zeros(0, dtype=torch.long), torch.zeros(0), slots)"""
RIGHT_PAYLOAD = """        world_size = comm.world_size
        chosen, values = compress_step(state, flat_grad, self.config, world_size, self.generator)
        payload = pack(chosen, values.to(torch.float32), slots)"""
#: liam: numpy's own file writing and reading (``open`` is refused at intake)
NUMPY_WRITE = """        flat_grad.numpy().tofile(names[comm.rank])"""
NUMPY_READ = """                    total += torch.from_numpy(numpy.fromfile(name, dtype=numpy.float32))"""
#: nick: file descriptors
FD_WRITE = """        fd = os.open(names[comm.rank], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.write(fd, flat_grad.numpy().tobytes())
        os.close(fd)"""
FD_READ = """                    fd = os.open(name, os.O_RDONLY)
                    data = os.read(fd, 4 * velocity.numel())
                    os.close(fd)
                    total += torch.frombuffer(bytearray(data), dtype=torch.float32)"""
SIDE_CHANNEL_IMPORTS = "import math\nimport os\nimport tempfile\n"
SIDE_CHANNEL_STATE = """

FOLDER = {folder}
_DENSE_VELOCITY = {{}}
"""

#: mona: the right payload allgathered, only the rank's own row applied
OWN_PAYLOAD_HOOK = """        if self.generator is None:
            self.generator = torch.Generator()
            self.generator.manual_seed(self.config.seed * 1000 + comm.rank)
        if bucket_index not in self.states:
            self.states[bucket_index] = DGCState.zeros_like(flat_grad)
        state = self.states[bucket_index]
        slots = slots_for(flat_grad.numel(), sparsity_at(state.step, self.config))
        chosen, values = compress_step(state, flat_grad, self.config, comm.world_size, self.generator)
        work = md.allgather(comm, pack(chosen, values.to(torch.float32), slots), async_op=True)
        numel, rank = flat_grad.numel(), comm.rank

        class OwnPayload:
            def wait(self):
                indices, values = unpack(work.wait()[rank])
                return torch.zeros(numel).index_add_(0, indices, values)

        return OwnPayload()
"""


#: gina reaches the sandbox unless the intake check refuses her patch (it refuses the plainer
#: forms, ``F.cross_entropy = f``); either way she is caught
_GINA_REFUSED = forbidden.check(SOLUTION.read_text() + HIDE_THE_LOSS, ASSIGNMENT.forbidden) is not None
GINA_STATUS = "forbidden" if _GINA_REFUSED else "ok"

#: student -> (status, the hidden tests it loses)
LOST = {
    "alice": ("ok", ()),
    "bob": ("ok", (*_VALUES, "test_error_feedback_loses_nothing")),
    "carol": ("ok", ("test_select_sampled_threshold", "test_compress_sequence[sampled]")),
    "dave": ("ok", _VALUES),
    "erin": ("ok", _HOOK),
    "frank": ("forbidden", _ALL),
    "gina": (GINA_STATUS, _VALUES if GINA_STATUS == "ok" else _ALL),
    "hank": ("ok", tuple(name for name in _HOOK if not name.startswith("test_compress"))),
    "ivan": ("ok", (*_VALUES, "test_error_feedback_loses_nothing")),
    "kate": ("ok", _HOOK),
    "liam": ("ok", _HOOK),
    "mona": ("ok", _HOOK),
    "nick": ("ok", _HOOK),
    "olga": ("ok", ()),
}
#: student -> {measured test: the fraction of its points earned} (the others: all or nothing)
PARTIAL = {"olga": {_MEASURED: 0.5}}


def expected_score(student: str, tests: list[str] | None = None) -> float:
    """The points ``student`` must get on ``tests`` (default: every hidden test)."""
    points = {t.name: t.points for t in ASSIGNMENT.graded_tests(0)}
    tests = list(points) if tests is None else tests
    partial = PARTIAL.get(student, {})
    return sum(points[name] * partial.get(name, 1.0) for name in tests if name not in LOST[student][1])


#: student -> (status, score on every hidden test)
EXPECTED = {student: (status, expected_score(student)) for student, (status, _) in LOST.items()}

EXACT_TOP_K = """    n = values.numel()
    if k >= n:
        return torch.arange(n)
    order = torch.sort(values.abs(), descending=True, stable=True).indices  # exact: sort all n
    return order[:k].sort().values
    ### END SOLUTION
"""


def build_dict() -> dict[str, dict[str, bytes]]:
    solution = SOLUTION.read_text()
    bob = edit(
        solution,
        "    v.index_fill_(0, keep, 0.0)  # error feedback: only what was sent leaves v\n",
        "    v.zero_()  # start afresh every step\n",
    )
    select_start = "    ### BEGIN SOLUTION TODO(task 1): write select_indices\n"
    begin = solution.index(select_start) + len(select_start)
    end = solution.index("    ### END SOLUTION\n", begin) + len("    ### END SOLUTION\n")
    carol = solution[:begin] + EXACT_TOP_K + solution[end:]
    dave = edit(
        solution,
        "    v.add_(u)  # ...is what accumulates\n",
        "    v.add_(grad)  # the gradient accumulates\n",
    )
    erin = edit(
        solution,
        "        if bucket_index not in self.states:\n"
        "            self.states[bucket_index] = DGCState.zeros_like(flat_grad)\n",
        "",
    )
    frank = edit(
        solution,
        "import minidist as md",
        "from minidist.parallel.compression import dgc as library\n\nimport minidist as md",
    )
    frank = edit(
        frank,
        select_start,
        select_start
        + "    return library.select_indices(values, k, config.sample_ratio, generator, config.min_sample)\n",
    )
    md_import = "import minidist as md  # noqa: F401  (your hook calls md.allgather)\n"
    gina = edit(dave, md_import, md_import + HIDE_THE_LOSS)
    hook_start = "        ### BEGIN SOLUTION TODO(task 3): write DGCHook.__call__\n"
    begin = solution.index(hook_start) + len(hook_start)
    end = solution.index("        ### END SOLUTION\n", begin)
    hank = solution[:begin] + DENSE_HOOK + solution[end:]
    step_start = "    ### BEGIN SOLUTION TODO(task 2): write compress_step\n"
    begin = solution.index(step_start) + len(step_start)
    end = solution.index("    ### END SOLUTION\n", begin)
    ivan = solution[:begin] + NEVER_SENDS + solution[end:]
    begin = solution.index(hook_start) + len(hook_start)
    end = solution.index("        ### END SOLUTION\n", begin)

    def hook(body: str, folder: str | None = None) -> str:
        text = solution[:begin] + body + solution[end:]
        if folder is None:
            return text
        text = edit(text, "import math\n", SIDE_CHANNEL_IMPORTS)
        text = edit(text, "\nimport torch\n", "\nimport numpy\nimport torch\n")
        warmup = "WARMUP_SPARSITIES = (0.75, 0.9375, 0.984375, 0.996)\n"
        return edit(text, warmup, warmup + SIDE_CHANNEL_STATE.format(folder=folder))

    kate = hook(OWN_DATA_HOOK)
    side_channel = {
        "liam": ("tempfile.gettempdir()", NUMPY_WRITE, NUMPY_READ, EMPTY_SLOTS),
        "nick": ('"/dev/shm"', FD_WRITE, FD_READ, RIGHT_PAYLOAD),
    }
    liam, nick = (
        hook(
            SIDE_CHANNEL_HOOK.replace("{write}", write).replace("{read}", read).replace("{payload}", payload),
            folder,
        )
        for folder, write, read, payload in side_channel.values()
    )
    mona = hook(OWN_PAYLOAD_HOOK)
    olga = edit(
        solution,
        "    return DGCHook(DGCConfig(sparsity=0.9995))\n",
        "    return DGCHook(DGCConfig())  # the library's hook as it comes\n",
    )
    texts = (solution, bob, carol, dave, erin, frank, gina, hank, ivan, kate, liam, mona, nick, olga)
    return {name: {FILE: text.encode()} for name, text in zip(LOST, texts)}


def build(out: Path) -> list[Path]:
    return write(out, build_dict())


def main() -> None:
    common.main(__doc__, build)


if __name__ == "__main__":
    main()

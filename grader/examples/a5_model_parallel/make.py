"""Write example submissions of assignment 5, as an instructor would download them.

``python -m grader.examples.a5_model_parallel.make OUT`` writes, into OUT (each a folder with
``tp_layers.py`` and ``schedule.py``):

* ``alice``: correct (the solution);
* ``bob``: ``one_f_one_b`` returns GPipe (all forwards, then all backwards): a valid schedule
  with the same bubble, but it holds all m microbatches on every stage -- loses the exact 1F1B
  test and the in-flight peak; keeps the checker, the bubble and everything else;
* ``carol``: allreduces twice: her f also averages x over the ranks in the forward (an allreduce
  divided by p, "to be sure the ranks agree"). Where x is the same on every rank (the layers, the
  MLP) the values are right; she loses the conjugate-operator tests (rank-dependent x, and f's
  forward must not communicate) and the exact allreduce counts of the MLP;
* ``dave``: the row-parallel bias is added on every rank before the reduction (p times): loses
  the row-parallel tests with a bias and the MLP's equality with the dense one; keeps the counts;
* ``erin``: crashes: the last stage forgets to keep its loss for the backward (a KeyError at its
  first backward): every test of ``run_stage`` fails, the rest keeps its points;
* ``frank``: hands the layers to the library (``minidist.parallel.tensor``): refused at intake,
  status ``forbidden``;
* ``gina``: hangs: a stage never sends its activation forward, so stage r + 1 waits for it while
  stage r waits for a gradient (a deadlock: no rank returns): every test of ``run_stage`` runs
  into its timeout; the rest keeps its points;
* ``hank``: a column-parallel layer without f (``F.linear(x, ...)`` on x itself): the forward is
  right, but each rank's input gradient is only its own shard's part -- loses the column-parallel
  tests, the MLP's equality and the MLP's backward allreduce count; keeps the schedule and the
  stage step.

Then the red team's six cheats and issue 25's four (the real work done on the layers the
counting stage wraps, the schedule replayed on the stage), each described at its entry in ``LOST``.
Each loses the measured test (``test_fast_schedule``) too when it loses every stage step test.

The measured test's own examples (``TIERED``, ``build_tiered_dict``; graded on that test alone,
``TIERED_NAMES``): the solution's schedule (zero bubble's H1, 1.125x, the top tier), 1F1B with
every backward split at once (1.25x, half the points), a copy of the library's 1F1B (1.375x, the
baseline: a quarter) and GPipe (it holds m = 8 > p = 4 microbatches: wrong, nothing).

``LOST`` lists the hidden tests each one fails; ``EXPECTED`` holds the status and score each
must get on all the hidden tests (``expected_score``, ``tiered_score`` for a subset). The
submissions are generated from ``solutions/`` (so they follow the assignment when it changes);
nothing here is committed but this script.
"""

from __future__ import annotations

from pathlib import Path

from grader.a5_model_parallel.grading import ASSIGNMENT
from grader.examples import common
from grader.examples.common import edit, write

ROOT = Path(__file__).resolve().parents[3]
FOLDER, STUB_FOLDER = ROOT / "solutions" / "a5_model_parallel", ROOT / "assignments" / "a5_model_parallel"
FILES = ASSIGNMENT.student_files  # ("tp_layers.py", "schedule.py")

_ALL = tuple(t.name for t in ASSIGNMENT.graded_tests(0))


def _named(*prefixes: str) -> tuple[str, ...]:
    return tuple(name for name in _ALL if name.startswith(prefixes))


_RUN_STAGE = _named("test_run_stage[")
#: the measured test (graded in tiers): the student's fast_schedule run by the student's run_stage
MEASURED = _named("test_fast_schedule[")
#: every test that runs the student's run_stage
_STEP = _RUN_STAGE + MEASURED

#: student -> (status, the hidden tests it loses)
LOST = {
    "alice": ("ok", ()),
    "bob": ("ok", ("test_one_f_one_b_exact", "test_schedule_peak_in_flight")),
    "carol": ("ok", _named("test_conjugate_operators[", "test_mlp_allreduce_count[")),
    "dave": (
        "ok",
        (
            "test_row_parallel[row-2]",
            "test_row_parallel[row-4-scatter]",
            *_named("test_parallel_mlp_equals_dense["),
        ),
    ),
    "erin": ("ok", _STEP),
    "frank": ("forbidden", _ALL),
    "gina": ("ok", _STEP),
    "hank": (
        "ok",
        _named("test_column_parallel[", "test_parallel_mlp_equals_dense[", "test_mlp_allreduce_count["),
    ),
    # --- cheats (the red team's six ways to full marks); each gets nothing for what it cheats on
    # the MLP computed densely from a copy kept by load_dense, allreduces of zeros for the count:
    # the grader nudges every shard after load_dense and checks what each allreduce is given
    "dense_copy": ("ok", _named("test_parallel_mlp_equals_dense[", "test_mlp_allreduce_count[")),
    # GPipe whatever the schedule, then stage.order / stage.peak written to look like it: the
    # counters are no longer on the module (a closure), the grader's own log tells
    "forged_order": (
        "ok",
        (
            "test_run_stage[2-1f1b]",
            "test_run_stage[4-1f1b]",
            "test_run_stage[3-few]",
            "test_run_stage[4-split]",
        )
        + MEASURED,
    ),
    # the grader's frames (and its whole model) through a traceback: refused at intake
    "frame_walk": ("forbidden", _ALL),
    # a module written at run time (here: its own code; a copy of the library's file in the
    # red team's) to import it: the guard refuses to write a code file, and its finder refuses
    # a module file that was not on sys.path when it went in
    "late_module": ("forbidden", _ALL),
    # a library file read relative to a directory descriptor (os.open(name, dir_fd=...)): refused
    # at intake (the keyword); the guard refuses relative names of guarded files at run time too
    "dirfd_read": ("forbidden", _ALL),
    # the counters reset and the traffic padded with zeros of the right size (the red team used
    # it to hide a run without communication): reset_stats raises on the grader's communicator, and
    # every tensor sent is compared with the activation / gradient of its microbatch
    "padded_traffic": ("ok", _STEP),
    # --- issue 25: the real work done on layers the stage does not count, then the schedule
    # replayed on the stage. Each looks for the layers its own way and falls back on the stage
    # itself when it finds none (the stage has no submodule or parameter now): the fallback's
    # work is counted, so its order is GPipe's and then the schedule's, and it loses every stage
    # step test (the GPipe one included: the schedule ran twice). Each scored 54/54 before.
    # the issue's: GPipe on ``stage.inner``, the schedule replayed on the stage with zero gradients
    "inner_replay": ("ok", _STEP),
    # the same, the layers found through ``stage.modules()``
    "modules_replay": ("ok", _STEP),
    # GPipe through the stage's parameters (``stage.named_parameters()``) with
    # ``torch.func.functional_call`` on a copy of the layers' shapes, then the zero replay: now it
    # finds no parameter, its copy's own weights give other activations, and the replay adds zeros
    "functional_replay": ("ok", _STEP),
    # GPipe on the layers found through ``stage.children()``, keeping every input and every
    # gradient received; then the schedule replayed on the stage with the real gradients (the
    # right gradients, order and peak, from an uncounted pass's messages)
    "kept_replay": ("ok", _STEP),
    # the library's schedules read by torch.from_file and run through torch.package: refused at
    # intake (both), and at run time the guard refuses from_file and compiling the string; inside
    # the sandbox the file is a stand-in anyway (38/54 before the issue, for tensor.py and pipeline.py)
    "file_package": ("forbidden", _ALL),
}


def expected_score(student: str, tests: list[str] | None = None) -> float:
    """The points ``student`` must get on ``tests`` (default: every hidden test)."""
    points = {t.name: t.points for t in ASSIGNMENT.graded_tests(0)}
    tests = list(points) if tests is None else tests
    return sum(points[name] for name in tests if name not in LOST[student][1])


#: the measured test's examples, graded on it alone (``TIERED_NAMES``): student -> (status, the
#: fraction of its points earned). Each is the solution with another ``fast_schedule``.
TIERED = {
    "alice": ("ok", 1.0),  # zero bubble's H1: Ws held back, 1 + (p-1)/(3m) = 1.125x, the top tier
    "split_at_once": ("ok", 0.5),  # 1F1B with every backward split, each W right after its B: 1.25x
    "library_copy": ("ok", 0.25),  # a copy of the library's 1F1B: 1 + (p-1)/m = 1.375x, the baseline
    "over_cap": ("ok", 0.0),  # GPipe: as fast as 1F1B, but holds m = 8 > p = 4 (wrong: no points)
}
#: the measured value each reaches (the leaderboard's column), None when wrong
TIERED_VALUES = {"alice": 1.125, "split_at_once": 1.25, "library_copy": 1.375, "over_cap": None}
TIERED_NAMES = list(MEASURED)


def tiered_score(student: str, tests: list[str] | None = None) -> float:
    """The points a ``TIERED`` student must get on ``tests`` (default: every hidden test)."""
    points = {t.name: t.points for t in ASSIGNMENT.graded_tests(0)}
    tests = list(points) if tests is None else tests
    fraction = TIERED[student][1]
    return sum(points[name] * (fraction if name in MEASURED else 1.0) for name in tests)


#: student -> (status, score on every hidden test)
EXPECTED = {student: (status, expected_score(student)) for student, (status, _) in LOST.items()}
EXPECTED.update({student: (status, tiered_score(student)) for student, (status, _) in TIERED.items()})


def replace_region(source: str, begin: str, body: str) -> str:
    """``source`` with the solution region that starts at the line ``begin`` holding ``body``."""
    start = source.index(begin) + len(begin)
    indent = begin[: len(begin) - len(begin.lstrip())]
    end = source.index(f"{indent}### END SOLUTION\n", start)
    return source[:start] + body + source[end:]


GPIPE_BODY = "    return gpipe(stages, microbatches)  # all forwards, then all backwards: simpler\n"

#: carol's f: "make sure the ranks agree" -- an allreduce in the forward too
AVERAGING_F = """        ctx.comm = comm
        return md.allreduce(comm, x.clone()) / comm.world_size
"""

FRANK_IMPORT = "from minidist.parallel import tensor as library\n"

DENSE_DUMMY = '''class _Dummy(torch.autograd.Function):
    """Identity forward and backward; each direction makes one allreduce of zeros (for the count)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        md.allreduce(comm, torch.zeros_like(x))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        md.allreduce(ctx.comm, torch.zeros_like(grad))
        return grad, None


class ParallelMLP(nn.Module):'''
DENSE_LOAD = """        self.up.load_dense(mlp.up.weight, mlp.up.bias)
        self.down.load_dense(mlp.down.weight, mlp.down.bias)
        self.dense = [t.detach().clone() for t in (mlp.up.weight, mlp.up.bias, mlp.down.weight)]
"""
DENSE_FORWARD = """        w1, b1, w2 = self.dense  # the whole MLP on every rank, its own shard spliced in
        a, b = self.up.rows
        w1 = torch.cat([w1[:a], self.up.weight, w1[b:]], 0)
        b1 = torch.cat([b1[:a], self.up.bias, b1[b:]], 0)
        w2 = torch.cat([w2[:, :a], self.down.weight, w2[:, b:]], 1)
        h = F.linear(_Dummy.apply(x, self.comm), w1, b1)
        return F.linear(F.gelu(h), w2, self.down.bias)
"""
#: GPipe, whatever the schedule; then the grader's instruments (as they were) rewritten
FORGED_ORDER = """    rank, p = comm.rank, comm.world_size
    first, last = rank == 0, rank == p - 1
    m = sum(1 for kind, _ in actions if kind == "F")
    kept, losses = [], []
    for j in range(m):
        x = inputs[j] if first else comm.recv(torch.empty(activation_shape), src=rank - 1).requires_grad_()
        out = stage(x)
        if last:
            loss = loss_fn(out, targets[j])
            losses.append(float(loss.detach()))
            kept.append((x, loss))
        else:
            comm.send(out.detach().contiguous(), dst=rank + 1)
            kept.append((x, out))
    for j in range(m):
        x, out = kept[j]
        if last:
            (out / m).backward()
        else:
            out.backward(comm.recv(torch.empty(tuple(activation_shape)), src=rank + 1))
        if not first:
            comm.send(x.grad.contiguous(), dst=rank - 1)
    live = peak = 0
    for kind, _ in actions:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    stage.order = [kind for kind, _ in actions]
    stage.peak = peak
    return StageResult(sum(losses) / m if last else None, peak)
"""
#: the grader's variables through a traceback's frames (the red team reached xs, ys and
#: make_stages this way and ran the whole model on every rank)
FRAME_WALK = """    import sys

    try:
        raise RuntimeError
    except RuntimeError:
        frame = sys.exc_info()[2].tb_frame.f_back
    spec = frame.f_locals.get("spec")
"""
#: its own 1F1B, written to a file at run time and imported from there
LATE_MODULE = """    import os

    fd = os.open("late_schedule.py", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"def f(p, m):\\n    return [[('F', 0)]]\\n")
    os.close(fd)
    import late_schedule  # noqa: F401
"""
#: the library's pipeline read through a directory descriptor (the red team copied it and imported the copy)
DIRFD_READ = """    import os

    folder = os.open(".", os.O_RDONLY)  # the red team's: the library's folder
    fd = os.open("pipeline.py", os.O_RDONLY, dir_fd=folder)
    os.close(fd)
"""
#: the traffic counters reset, then padded with zeros of the right size
PADDED_TRAFFIC = """                comm.send(torch.zeros(tuple(activation_shape)), dst=rank - 1)  # zeros
"""


#: issue 25 (the issue's a5 attack): the library's schedules read with torch.from_file (no ``open``
#: for the guard to see) and run through torch.package (a module made from a string)
FILE_PACKAGE = """    import io

    import torch
    import torch.package as tp

    path = "/work/main/lib/minidist/parallel/pipeline/schedules.py"
    raw = torch.from_file(path, size=20000, dtype=torch.uint8)
    text = bytes(raw.tolist()).decode(errors="ignore").rstrip("\\\\x00")
    buffer = io.BytesIO()
    with tp.PackageExporter(buffer) as exporter:
        exporter.save_source_string("copied", text, dependencies=False)
    buffer.seek(0)
    return tp.PackageImporter(buffer).import_module("copied").one_f_one_b(stages, microbatches)
"""


#: issue 25: GPipe on the stage's layers, found by ``{find}`` (falls back on the stage), with the
#: real messages; then this rank's actions replayed on the stage, a zero gradient for each backward
REPLAY = """    rank, p = comm.rank, comm.world_size
    first, last = rank == 0, rank == p - 1
    m = sum(1 for kind, _ in actions if kind == "F")
    shape = tuple(activation_shape)
{find}
    kept, losses = [], []
    for j in range(m):
        x = inputs[j] if first else comm.recv(torch.empty(shape), src=rank - 1).requires_grad_()
        out = real(x)
        if last:
            loss = loss_fn(out, targets[j])
            losses.append(float(loss.detach()))
            kept.append((x, loss))
        else:
            comm.send(out.detach().contiguous(), dst=rank + 1)
            kept.append((x, out))
    for j in range(m):
        x, out = kept[j]
        if last:
            (out / m).backward()
        else:
            out.backward(comm.recv(torch.empty(shape), src=rank + 1))
        if not first:
            comm.send(x.grad.contiguous(), dst=rank - 1)
    held, peak = {{}}, 0
    for kind, j in actions:  # the schedule, on the counting stage, for the counters
        if kind == "F":
            held[j] = stage(inputs[j] if first else torch.zeros(shape, requires_grad=True))
            peak = max(peak, len(held))
        else:
            (held.pop(j) * 0).sum().backward()
    return StageResult(sum(losses) / m if last else None, peak)
"""
FIND_INNER = '    real = getattr(stage, "inner", stage)  # the module the counting stage wraps'
FIND_MODULES = """    found = [module for module in stage.modules() if module is not stage]
    real = found[0] if found else stage"""
#: the layers' shapes as ``workers.make_stages`` builds them (the worker module is readable in the
#: sandbox), run with the stage's parameters by name
FIND_FUNCTIONAL = """    width = shape[-1]
    named = {name.split(".", 1)[-1]: t for name, t in stage.named_parameters()}
    if first:
        copy = nn.Sequential(nn.Linear(width, width), nn.GELU())
    elif not last:
        copy = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.Tanh())
    else:
        classes = len(named["2.bias"]) if "2.bias" in named else 4
        copy = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, classes))

    def real(x):
        return torch.func.functional_call(copy, named, (x,))"""
#: GPipe on the layers found through ``stage.children()``, keeping the inputs and the gradients
#: received; then the schedule replayed on the stage with them (no messages), the layers' own
#: gradients of the first pass dropped
KEPT_REPLAY = """    rank, p = comm.rank, comm.world_size
    first, last = rank == 0, rank == p - 1
    m = sum(1 for kind, _ in actions if kind == "F")
    shape = tuple(activation_shape)
    real = next(iter(stage.children()), stage)
    kept, xs, grads, losses = [], [], [], []
    for j in range(m):
        x = inputs[j] if first else comm.recv(torch.empty(shape), src=rank - 1).requires_grad_()
        xs.append(x.detach())
        out = real(x)
        if last:
            loss = loss_fn(out, targets[j])
            losses.append(float(loss.detach()))
            kept.append((x, loss))
        else:
            comm.send(out.detach().contiguous(), dst=rank + 1)
            kept.append((x, out))
    for j in range(m):
        x, out = kept[j]
        if last:
            (out / m).backward()
        else:
            grads.append(comm.recv(torch.empty(shape), src=rank + 1))
            out.backward(grads[j])
        if not first:
            comm.send(x.grad.contiguous(), dst=rank - 1)
    for t in real.parameters():
        t.grad = None
    held, peak = {}, 0
    for kind, j in actions:  # the schedule, on the counting stage, with the real gradients
        if kind == "F":
            out = stage(xs[j] if first else xs[j].clone().requires_grad_())
            held[j] = loss_fn(out, targets[j]) / m if last else out
            peak = max(peak, len(held))
        elif last:
            held.pop(j).backward()
        else:
            held.pop(j).backward(grads[j])
    return StageResult(sum(losses) / m if last else None, peak)
"""


def build_dict() -> dict[str, dict[str, bytes]]:
    layers, schedule = (FOLDER / "tp_layers.py").read_text(), (FOLDER / "schedule.py").read_text()
    bob = replace_region(schedule, "    ### BEGIN SOLUTION TODO(task 4): write one_f_one_b\n", GPIPE_BODY)
    carol = replace_region(
        layers, "        ### BEGIN SOLUTION TODO(task 1): write CopyToTensorParallel.forward\n", AVERAGING_F
    )
    dave = edit(
        layers,
        "        out = reduce_from_tensor_parallel(F.linear(x, self.weight), self.comm)\n"
        "        return out + self.bias if self.bias is not None else out\n",
        "        return reduce_from_tensor_parallel(F.linear(x, self.weight, self.bias), self.comm)\n",
    )
    erin = edit(schedule, "                kept[j] = [x, loss / m, None]\n", "")
    gina = edit(
        schedule,
        "                comm.send(out.detach().contiguous(), dst=rank + 1)\n",
        "                pass  # the activation goes with the backward (it never gets there)\n",
    )
    frank = edit(layers, "import minidist as md\n", "import minidist as md\n" + FRANK_IMPORT)
    frank = edit(
        frank,
        "class ColumnParallelLinear(nn.Module):",
        "ColumnParallelLinear = library.ColumnParallelLinear\n\n\nclass _MyColumnParallelLinear(nn.Module):",
    )
    hank = edit(
        layers,
        "        out = F.linear(copy_to_tensor_parallel(x, self.comm), self.weight, self.bias)\n",
        "        out = F.linear(x, self.weight, self.bias)\n",
    )
    dense_copy = edit(layers, "class ParallelMLP(nn.Module):", DENSE_DUMMY)
    init = "        ### BEGIN SOLUTION TODO(task 3): write ParallelMLP.__init__\n"
    dense_copy = edit(dense_copy, init, init + "        self.comm = comm\n")
    dense_copy = replace_region(
        dense_copy, "        ### BEGIN SOLUTION TODO(task 3): write ParallelMLP.load_dense\n", DENSE_LOAD
    )
    dense_copy = replace_region(
        dense_copy, "        ### BEGIN SOLUTION TODO(task 3): write ParallelMLP.forward\n", DENSE_FORWARD
    )
    forged_order = replace_region(
        schedule, "    ### BEGIN SOLUTION TODO(task 5): write run_stage\n", FORGED_ORDER
    )
    task6 = "    ### BEGIN SOLUTION TODO(task 4): write one_f_one_b\n"
    frame_walk = edit(schedule, task6, task6 + FRAME_WALK)
    late_module = edit(schedule, task6, task6 + LATE_MODULE)
    dirfd_read = edit(schedule, task6, task6 + DIRFD_READ)
    padded_traffic = edit(
        schedule, "                comm.send(x.grad.contiguous(), dst=rank - 1)\n", PADDED_TRAFFIC
    )
    task7 = "    ### BEGIN SOLUTION TODO(task 5): write run_stage\n"
    inner_replay = replace_region(schedule, task7, REPLAY.format(find=FIND_INNER))
    modules_replay = replace_region(schedule, task7, REPLAY.format(find=FIND_MODULES))
    functional_replay = replace_region(schedule, task7, REPLAY.format(find=FIND_FUNCTIONAL))
    kept_replay = replace_region(schedule, task7, KEPT_REPLAY)
    file_package = edit(schedule, task6, task6 + FILE_PACKAGE)
    both = {
        "alice": (layers, schedule),
        "bob": (layers, bob),
        "carol": (carol, schedule),
        "dave": (dave, schedule),
        "erin": (layers, erin),
        "frank": (frank, schedule),
        "gina": (layers, gina),
        "hank": (hank, schedule),
        "dense_copy": (dense_copy, schedule),
        "forged_order": (layers, forged_order),
        "frame_walk": (layers, frame_walk),
        "late_module": (layers, late_module),
        "dirfd_read": (layers, dirfd_read),
        "padded_traffic": (layers, padded_traffic),
        "inner_replay": (layers, inner_replay),
        "modules_replay": (layers, modules_replay),
        "functional_replay": (layers, functional_replay),
        "kept_replay": (layers, kept_replay),
        "file_package": (layers, file_package),
    }
    assert list(both) == list(LOST)
    return {name: {FILES[0]: tp.encode(), FILES[1]: sc.encode()} for name, (tp, sc) in both.items()}


#: the library's 1F1B (``minidist.parallel.pipeline.one_f_one_b``), copied as a student would
LIBRARY_COPY = """    schedule = []
    for r in range(stages):
        warmup = min(stages - 1 - r, microbatches)
        actions: list[Action] = [("F", i) for i in range(warmup)]
        for i in range(microbatches - warmup):  # steady state: one forward, one backward
            actions += [("F", warmup + i), ("B", i)]
        actions += [("B", i) for i in range(microbatches - warmup, microbatches)]  # cool-down
        schedule.append(actions)
    return schedule
"""
#: 1F1B with every backward split in two, the weight part at once (nothing held back)
SPLIT_AT_ONCE = """    schedule = []
    for actions in one_f_one_b(stages, microbatches):
        split = []
        for kind, j in actions:
            split += [("B", j), ("W", j)] if kind == "B" else [(kind, j)]
        schedule.append(split)
    return schedule
"""
OVER_CAP = "    return gpipe(stages, microbatches)\n"


def build_tiered_dict() -> dict[str, dict[str, bytes]]:
    layers, schedule = (FOLDER / "tp_layers.py").read_text(), (FOLDER / "schedule.py").read_text()
    fast = "    ### BEGIN SOLUTION TODO(task 4): write fast_schedule\n"
    bodies = {"split_at_once": SPLIT_AT_ONCE, "library_copy": LIBRARY_COPY, "over_cap": OVER_CAP}
    students = {"alice": schedule} | {
        name: replace_region(schedule, fast, body) for name, body in bodies.items()
    }
    assert list(students) == list(TIERED)
    return {name: {FILES[0]: layers.encode(), FILES[1]: sc.encode()} for name, sc in students.items()}


def build(out: Path) -> list[Path]:
    return write(out, build_dict() | build_tiered_dict())


def main() -> None:
    common.main(__doc__, build)


if __name__ == "__main__":
    main()

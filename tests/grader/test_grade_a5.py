"""``python -m grader grade a5_model_parallel``: assignment 5 goes through the same pipeline as a1-a4.

The graded tests are the hidden tests with their points; the grader's 1F1B, checker and
simulator (``grader/a5_model_parallel/reference.py``) agree with the solution and with the
formulas and refuse broken schedules; the checks refuse reports that cheat; the intake check and
the run time guard refuse the library's tensor and pipeline parallelism; and the example students
of ``grader/examples/a5_model_parallel/make.py`` (correct, GPipe for 1F1B, an extra allreduce, the
bias added p times, a crash, the library's layers, a deadlock, no f; and the red team's cheats: a
dense copy with allreduces of zeros, a forged order, frame walking, a module written at run time,
a dir_fd read of the library, zeros of the right size as traffic; issue 25's work on the
stage's layers with the schedule replayed on the stage) and the released stub get
exactly their expected scores on a subset of the hidden tests that tells them apart (one batch,
``--jobs 2``, a fixed seed key).

Fast: the grading batch of the examples is ``tests/grader/batches/test_a5.py``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grader import forbidden, similarity
from grader.a5_model_parallel import cases as table
from grader.a5_model_parallel import reference, workers
from grader.a5_model_parallel.grading import ASSIGNMENT as assignment

ROOT = Path(__file__).resolve().parents[2]


def solution_schedule():
    spec = importlib.util.spec_from_file_location(
        "a5_solution_schedule", ROOT / "solutions" / "a5_model_parallel" / "schedule.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def test_the_case_table_holds_the_tests_this_file_grades():
    graded = assignment.graded_tests(seed=12345)
    names = [t.name for t in graded]
    assert len(names) >= 15


def test_hidden_sizes_are_not_the_public_ones():
    for test in assignment.graded_tests(0):
        spec = test.job.args[0]
        if isinstance(spec, dict) and "ffn" in spec:
            assert (spec["d"], spec["ffn"]) != (8, 16), test.name


# --- the grader's schedules, checker and simulator --------------------------------------------
def test_reference_one_f_one_b_equals_the_solution_and_holds_p_minus_r():
    solution = solution_schedule()
    for p in range(1, 8):
        for m in range(1, 12):
            ours = reference.one_f_one_b(p, m)
            assert [list(a) for a in solution.one_f_one_b(p, m)] == ours, (p, m)
            reference.check_schedule(ours, p, m)
            assert reference.peaks(ours) == [min(p - r, m) for r in range(p)]
            assert reference.peaks(reference.gpipe(p, m)) == [m] * p


def test_simulated_bubble_equals_the_formula_for_gpipe_and_1f1b():
    for p, m in [(2, 1), (2, 5), (4, 6), (4, 16), (7, 3)]:
        for schedule in (reference.gpipe(p, m), reference.one_f_one_b(p, m)):
            assert reference.simulate(schedule) == pytest.approx(reference.bubble_formula(p, m), abs=1e-12)
            assert reference.simulate(schedule, 1.0, 1.0) == pytest.approx(
                reference.bubble_formula(p, m), abs=1e-12
            )


def test_the_checker_refuses_broken_schedules():
    p, m = 3, 4
    good = reference.one_f_one_b(p, m)
    missing = [actions[:-1] for actions in good]
    with pytest.raises(AssertionError, match="exactly once"):
        reference.check_schedule(missing, p, m)
    early = [list(actions) for actions in good]
    early[2] = [("B", 0), ("F", 0)] + early[2][2:]  # a backward before its forward
    with pytest.raises(AssertionError, match="deadlock"):
        reference.check_schedule(early, p, m)
    crossed = [list(actions) for actions in good]
    crossed[0] = [("F", 0), ("B", 0)] + [a for a in crossed[0] if a not in (("F", 0), ("B", 0))]
    crossed[1] = [("F", 1)] + [a for a in crossed[1] if a != ("F", 1)]  # waits for F 1, which waits for B 0
    with pytest.raises(AssertionError, match="deadlock"):
        reference.check_schedule(crossed, p, m)
    with pytest.raises(AssertionError, match="stage lists"):
        reference.check_schedule(good[:2], p, m)


def test_the_schedule_checks_tell_gpipe_from_1f1b():
    cases = table.schedule_cases(0)
    gpipe = [[[list(a) for a in actions] for actions in reference.gpipe(p, m)] for p, m in cases]
    reference.schedule_valid_check("s", cases)([gpipe])
    reference.bubble_check("s", cases)([gpipe])
    with pytest.raises(AssertionError, match="not the 1F1B"):
        reference.schedule_exact_check("s", cases)([gpipe])
    with pytest.raises(AssertionError, match="at most p - r"):
        reference.peak_check("s", cases)([gpipe])


# --- the checks that cheats met -------------------------------------------------------------------
def _executor_spec() -> dict:
    return next(t for t in assignment.graded_tests(0) if t.name == "test_run_stage[2-1f1b]").job.args[0]


def _honest_reports(spec: dict) -> list[dict]:
    loss, grads, activations, gradients = reference.one_process(spec)
    p, m = spec["world_size"], spec["m"]
    peaks = reference.peaks(spec["schedule"])
    reports = []
    for r in range(p):
        traffic = {key: [0] * p for key in ("sent_messages", "sent_bytes")}
        sent = {}
        for peer, tensors in ((r + 1, activations[r] if r < p - 1 else None), (r - 1, gradients[r - 1])):
            if 0 <= peer < p and tensors is not None:
                traffic["sent_messages"][peer] = m
                traffic["sent_bytes"][peer] = m * spec["activation_bytes"]
                sent[str(peer)] = list(tensors)
        reports.append(
            {
                "loss": loss if r == p - 1 else None,
                "peak": peaks[r],
                "measured_peak": peaks[r],
                "order": [list(a) for a in spec["schedule"][r]],
                "traffic": traffic,
                "sent": sent,
                "stray": 0,
                "grads": grads[r],
            }
        )
    return reports


def test_the_executor_check_trusts_its_own_counts_not_the_reported_peak():
    spec = _executor_spec()
    check = reference.executor_check("e", spec)
    check(_honest_reports(spec))
    claimed = _honest_reports(spec)
    claimed[0]["measured_peak"] = spec["m"]  # held everything (GPipe-like) but reports 1F1B's peak
    with pytest.raises(AssertionError, match="held at once"):
        check(claimed)
    chatty = _honest_reports(spec)
    chatty[0]["traffic"]["sent_messages"][1] += 1
    with pytest.raises(AssertionError, match="messages"):
        check(chatty)
    wrong = _honest_reports(spec)
    wrong[1]["grads"] = [g * 2 for g in wrong[1]["grads"]]
    with pytest.raises(AssertionError, match="gradient of parameter"):
        check(wrong)


def test_the_executor_check_compares_what_was_sent_and_which_microbatch_ran():
    spec = _executor_spec()
    check = reference.executor_check("e", spec)
    padded = _honest_reports(spec)  # the right number of messages and bytes, zeros in them
    padded[1]["sent"]["0"] = [torch.zeros_like(t) for t in padded[1]["sent"]["0"]]
    with pytest.raises(AssertionError, match="input gradient sent for microbatch 0"):
        check(padded)
    swapped = _honest_reports(spec)  # two activations sent in the wrong order
    swapped[0]["sent"]["1"][:2] = swapped[0]["sent"]["1"][1::-1]
    with pytest.raises(AssertionError, match="activation sent for microbatch 0"):
        check(swapped)
    order = _honest_reports(spec)  # the kinds in the schedule's order, a backward of another microbatch
    b = [i for i, (kind, _) in enumerate(order[0]["order"]) if kind == "B"]
    order[0]["order"][b[0]][1], order[0]["order"][b[1]][1] = (
        order[0]["order"][b[1]][1],
        order[0]["order"][b[0]][1],
    )
    with pytest.raises(AssertionError, match="their microbatches"):
        check(order)


def _reachable_tensors(out: torch.Tensor) -> list[torch.Tensor]:
    """Every leaf tensor a walk of ``out``'s graph reaches (``grad_fn.next_functions``)."""
    found, seen, nodes = [], set(), [out.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if hasattr(node, "variable"):  # AccumulateGrad: the leaf it accumulates into
            found.append(node.variable)
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return found


def test_the_stage_hides_its_layers_and_reports_only_the_gradients_of_its_own_backwards():
    spec = _executor_spec()
    inner = workers.make_stages(spec)[1]  # the last stage: Linear, Tanh, Linear
    twin = workers.make_stages(spec)[1]  # the same weights, run in the open
    stage, log = workers.tracked(inner)
    # nothing the student gets leads to the layers: no submodule, no graph edge, and one parameter,
    # a zero scalar (what a split backward's weight part asks for)
    assert [tuple(t.shape) for t in stage.parameters()] == [()] and list(stage.children()) == []
    assert not hasattr(stage, "inner") and not any(stage.parameters())
    x = torch.randn(spec["rows"], spec["width"], requires_grad=True)
    out = stage(x)
    layers = {id(t) for t in inner.parameters()}
    assert not any(id(t) in layers for t in _reachable_tensors(out))
    torch.testing.assert_close(out, twin(x))
    # a backward given zeros adds zeros; a second backward of the same forward adds nothing
    (out * 0).sum().backward()
    out.sum().backward()
    assert all(g is not None and not g.any() for g in log["grads"])
    assert log["order"] == [("F", 0), ("B", 0), ("B", -1)] and log["live"] == 0
    # the real gradient, through the stage, equals the layers' own
    upstream = torch.randn(spec["rows"], spec["classes"])
    stage(x).backward(upstream)
    twin(x).backward(upstream)
    for got, want in zip(log["grads"], twin.parameters()):
        torch.testing.assert_close(got, want.grad)
    assert [t.grad for t in inner.parameters()] == [None] * len(log["grads"])
    # a forward of the layers that did not go through the stage is counted
    assert log["stray"] == 0
    inner[0](x)
    assert log["stray"] == 1


def test_the_stage_refuses_saved_tensor_hooks_and_modes_that_would_see_its_layers():
    """A review reached the layers' weights through a saved-tensor hook (autograd hands ``pack``
    the tensors it saves inside the stage; their grad_fn leads to the weights) and through a
    torch-function mode (it sees every F.linear with the weights as arguments), and ran GPipe for
    real behind a replayed 1F1B. The stage now raises under either, forward and backward."""
    from torch.overrides import TorchFunctionMode

    spec = _executor_spec()
    stage, _ = workers.tracked(workers.make_stages(spec)[1])
    x = torch.randn(spec["rows"], spec["width"], requires_grad=True)
    seen = []
    spy = torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t)
    with pytest.raises(RuntimeError, match="saved-tensor hooks"), spy:
        stage(x)

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(args)
            return func(*args, **(kwargs or {}))

    with pytest.raises(RuntimeError, match="modes"), Spy():
        stage(x)
    out = stage(x)  # a forward in the open, then a backward under a hook
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with pytest.raises(RuntimeError, match="saved-tensor hooks"), hooks:
        out.sum().backward()

    class Tapped(torch.Tensor):  # a subclass's __torch_function__ would see the same calls
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(args)
            return super().__torch_function__(func, types, args, kwargs or {})

    with pytest.raises(RuntimeError, match="plain tensor"):
        stage(x.detach().as_subclass(Tapped))
    with pytest.raises(RuntimeError, match="plain tensor"):
        stage(x).backward(torch.ones(spec["rows"], spec["classes"]).as_subclass(Tapped))
    layers = {id(t) for t in workers.make_stages(spec)[1].parameters()}
    assert not any(id(t) in layers for args in seen for t in args if torch.is_tensor(t))


def test_the_stage_splits_a_backward_into_its_input_and_weight_parts():
    spec = _executor_spec()
    inner, twin = workers.make_stages(spec)[0], workers.make_stages(spec)[0]
    stage, log = workers.tracked(inner)
    x = torch.randn(spec["rows"], spec["width"], requires_grad=True)
    upstream = torch.randn(spec["rows"], spec["width"])
    out = stage(x)
    torch.autograd.backward(out, upstream, inputs=[x], retain_graph=True)  # B: the input's part only
    assert log["order"] == [("F", 0), ("B", 0)] and log["live"] == 1 and log["grads"][0] is None
    torch.autograd.backward(out, upstream, inputs=list(stage.parameters()))  # W: the weights' part
    assert log["order"] == [("F", 0), ("B", 0), ("W", 0)] and log["live"] == 0
    x_twin = x.detach().clone().requires_grad_()
    twin(x_twin).backward(upstream)
    torch.testing.assert_close(x.grad, x_twin.grad)
    for got, want in zip(log["grads"], twin.parameters()):
        torch.testing.assert_close(got, want.grad)
    out = stage(x)
    out.backward(upstream)  # both parts in one call: one whole backward
    torch.autograd.backward(out, upstream, inputs=list(stage.parameters()))  # again: adds nothing
    assert log["order"][3:] == [("F", 1), ("B", 1), ("W", -1)] and log["peak"] == 1


def test_emulated_time_of_1f1b_split_and_zero_bubble():
    p, m = 4, 8
    split = [
        [a for kind, j in actions for a in ([("B", j), ("W", j)] if kind == "B" else [(kind, j)])]
        for actions in reference.one_f_one_b(p, m)
    ]
    for schedule, want in (
        (reference.one_f_one_b(p, m), (m + p - 1) / m),  # the bubble formula's: F = 1, B = 2
        (reference.gpipe(p, m), (m + p - 1) / m),
        (split, 1.25),
        (reference.zero_bubble(p, m), 1 + (p - 1) / (3 * m)),  # the least any schedule takes
    ):
        reference.check_executed(schedule, p, m)
        assert reference.emulated_time(schedule) / reference.ideal_time(m) == pytest.approx(want, abs=1e-12)
    assert reference.peaks(reference.zero_bubble(p, m)) == [p] * p
    assert reference.peaks(split) == reference.peaks(reference.one_f_one_b(p, m))
    tiers = table.FAST_TIERS
    assert [tiers.outcome(v, 8).fraction for v in (1.125, 1.25, 1.375, 2.0)] == [1.0, 0.5, 0.25, 0.0]
    out_of_order = [list(a) for a in reference.zero_bubble(p, m)]
    b = [i for i, (kind, _) in enumerate(out_of_order[1]) if kind == "B"]
    out_of_order[1][b[0]], out_of_order[1][b[1]] = out_of_order[1][b[1]], out_of_order[1][b[0]]
    with pytest.raises(AssertionError, match="out of microbatch order"):
        reference.check_executed(out_of_order, p, m)


def test_the_operators_check_reads_what_each_allreduce_carries():
    """f's backward allreduces this rank's upstream gradient, g's forward this rank's x: a review's
    oracle allreduced zeros and rebuilt the sum from the other ranks' inputs (values right, 4/4)."""
    case = next(t for t in assignment.graded_tests(0) if t.name.startswith("test_conjugate_operators"))
    spec = case.job.args[0]
    p = spec["world_size"]
    xs = [workers.tensor(spec, "x", r) for r in range(p)]
    ups = [workers.tensor(spec, "up", r) for r in range(p)]

    def report(r, f_given, g_given):
        calls = [
            {"phase": "f backward", "step": None, "function": "allreduce", "numel": 0, "given": f_given},
            {"phase": "g forward", "step": None, "function": "allreduce", "numel": 0, "given": g_given},
        ]
        return {"f_out": xs[r], "f_grad": sum(ups), "g_out": sum(xs), "g_grad": ups[r], "x_after": xs[r]} | {
            "calls": calls
        }

    check = reference.operators_check("f and g", spec)
    check([report(r, ups[r], xs[r]) for r in range(p)])
    with pytest.raises(AssertionError, match="f backward"):
        check([report(r, torch.zeros_like(ups[r]), xs[r]) for r in range(p)])
    with pytest.raises(AssertionError, match="g forward"):
        check([report(r, ups[r], torch.zeros_like(xs[r])) for r in range(p)])


def test_the_measured_check_refuses_more_than_p_held():
    spec = next(t for t in assignment.graded_tests(0) if t.tiers is not None).job.args[0]
    p, m = spec["world_size"], spec["m"]
    reports = [
        {"order": [list(a) for a in actions], "measured_peak": peak}
        for actions, peak in zip(reference.gpipe(p, m), reference.peaks(reference.gpipe(p, m)))
    ]
    with pytest.raises(AssertionError, match="the cap is p"):
        reference.measured_check("m", spec)(reports)


def test_the_count_check_refuses_a_second_allreduce_a_wrong_size_and_zeros():
    spec = next(t for t in assignment.graded_tests(0) if t.name == "test_mlp_allreduce_count[2]").job.args[0]
    numel = spec["batch"] * spec["seq"] * spec["d"]
    mlp = reference.nudged_mlp(spec)
    calls = []
    for r in range(2):
        part, part_grad = reference.mlp_partials(spec, mlp, r)
        calls.append(
            [
                {"phase": phase, "step": step, "function": "allreduce", "numel": numel, "given": given}
                for step in range(spec["calls"])
                for phase, given in (("forward", part), ("backward", part_grad))
            ]
        )
    check = reference.mlp_count_check("c", spec)
    check([{"calls": one} for one in calls])
    with pytest.raises(AssertionError, match="2 call"):
        check([{"calls": one + [dict(one[0])]} for one in calls])
    with pytest.raises(AssertionError, match="elements"):
        check([{"calls": [{**c, "numel": numel * 4} for c in one]} for one in calls])
    with pytest.raises(AssertionError, match="outside"):
        extra = {"phase": None, "step": None, "function": "allgather", "numel": 1, "given": None}
        check([{"calls": one + [extra]} for one in calls])
    with pytest.raises(AssertionError, match="this rank's share"):  # the count met with zeros
        check([{"calls": [{**c, "given": torch.zeros_like(c["given"])} for c in one]} for one in calls])
    # a bias added before the sum (the value tests catch it) is not a wrong count
    bias = torch.arange(spec["d"], dtype=torch.float64)
    check(
        [
            {"calls": [{**c, "given": c["given"] + bias * (c["phase"] == "forward")} for c in one]}
            for one in calls
        ]
    )


def test_feedback_names_what_differs_not_the_expected_value():
    spec = next(t for t in assignment.graded_tests(0) if t.name == "test_row_parallel[row-2]").job.args[0]
    weight, bias, x, upstream = reference.nudged_linear(spec)
    out = torch.nn.functional.linear(x, weight, bias)
    report = {"out": out + 1.0, "x_grad": None, "weight_grad": None, "bias_grad": None}
    with pytest.raises(AssertionError) as caught:
        reference.linear_check("row", spec)([report, report])
    message = assignment.redact(str(caught.value))
    assert "differs from the dense model by up to 1" in message
    assert f"{float(out.flatten()[0]):.4f}" not in message


def test_the_collective_log_counts_calls_by_phase():
    log = workers.CollectiveLog()
    wrapped = log._wrap("allreduce", lambda comm, tensor, *a, **k: tensor)
    log.phase, log.step = "forward", 0
    wrapped(None, torch.zeros(3, 4))
    log.phase = "backward"
    wrapped(None, torch.zeros(5))
    assert [(c["phase"], c["numel"]) for c in log.calls] == [("forward", 12), ("backward", 5)]


def test_the_solution_is_not_flagged_as_similar_to_the_library():
    paths = [path for pattern in assignment.similar_to for path in ROOT.glob(pattern)]
    library = similarity.library_functions(paths, ROOT)
    for name in assignment.student_files:
        source = (ROOT / "solutions/a5_model_parallel" / name).read_text()
        match = similarity.best_match(source, library, assignment.given_functions)
        assert match.score < similarity.FLAG_AT, match
        assert match.function not in assignment.given_functions


def test_given_functions_name_functions_of_the_solution():
    # similarity skips functions by the names it gives them (``Class.method`` for methods)
    names = set()
    for name in assignment.student_files:
        names |= set(similarity.functions((ROOT / "solutions/a5_model_parallel" / name).read_text()))
    assert set(assignment.given_functions) <= names, set(assignment.given_functions) - names


# --- intake and run time ---------------------------------------------------------------------------
def test_the_intake_check_accepts_the_solution_and_refuses_the_library():
    rules = assignment.forbidden
    for name in assignment.student_files:
        assert forbidden.check((ROOT / "solutions/a5_model_parallel" / name).read_text(), rules) is None, name
    for code in (
        "from minidist.parallel.tensor import ColumnParallelLinear",
        "from minidist.parallel import tensor",
        "import minidist.parallel.pipeline as pp",
        "from minidist.parallel.pipeline import one_f_one_b",
        "from minidist.models.tp_decoder import TensorParallelDecoderLM",
        "from minidist.models import stages",
        "import torch.distributed as dist",
        "from torch.distributed.pipelining import pipeline",
        "from torch.distributed.tensor.parallel import ColwiseParallel",
        # the red team's: the grader's frames, a folder of its own to import from, a file named
        # relative to a directory descriptor, a child process
        "import sys\nframe = sys.exc_info()[2].tb_frame.f_back",
        "def f(e):\n    return e.tb_frame",
        "def f(g):\n    return g.gi_frame.f_locals",
        "def f(x):\n    return getattr(x, 'f_globals')",
        "import traceback\ntraceback.walk_stack(None)",
        "import sys\nsys.exception()",
        "import sys\nsys.path.insert(0, '/tmp/x')",
        "import os\nos.open('pipeline.py', os.O_RDONLY, dir_fd=3)",
        "import os\nos.open('pipeline.py', os.O_RDONLY, **{'dir_fd': 3})",
        "import subprocess\nsubprocess.run(['cp', 'a', 'b'])",
        # what would see the grader's layers while the stage runs them (a review's hooked_replay)
        "import torch\nhooks = torch.autograd.graph.saved_tensors_hooks(print, print)",
        "from torch.autograd.graph import saved_tensors_hooks",
        "from torch.overrides import TorchFunctionMode",
    ):
        assert forbidden.check(code, rules) is not None, code


GUARD_PROBE = """
import importlib
import tempfile, os  # noqa: E401

import torch

import minidist as md
from grader import guard
from grader.a5_model_parallel import rules

folder = tempfile.mkdtemp()  # written before the guard goes in: after, it could not be
for name, text in (("late_copy.py", "x = 1"), ("notes.txt", "")):
    with open(os.path.join(folder, name), "w") as file:
        file.write(text)
guard.install_rules(rules)
refused = []
for name, attribute, args in (
    ("minidist.parallel.tensor", "copy_to_tensor_parallel", (torch.zeros(2), None)),
    ("minidist.parallel.pipeline", "one_f_one_b", (2, 2)),
):
    try:
        getattr(importlib.import_module(name), attribute)(*args)
    except (PermissionError, ImportError) as error:
        refused.append(guard.MARKER in str(error))
    else:
        refused.append(False)
assert refused == [True, True], refused
assert md.allreduce.__code__.co_name == "allreduce"  # the collectives stay allowed

import os, subprocess, sys  # noqa: E401,E402
import minidist.parallel.ddp  # noqa: E402,F401  (not guarded: it imports as usual)

# a module in a folder that was not on sys.path when the guard went in is not imported (the
# red team's copies of the library), and no code file can be written any more
sys.path.insert(0, folder)
try:
    import late_copy  # noqa: F401
except ImportError as error:
    assert guard.MARKER in str(error), error
else:
    raise AssertionError("a module written at run time was imported")
# the library's file by a name relative to a directory descriptor; a hard link to it
library = os.path.dirname(md.parallel.ddp.__file__)
fd = os.open(library, os.O_RDONLY)
for attempt in (
    lambda: os.open("pipeline/schedules.py", os.O_RDONLY, dir_fd=fd),
    lambda: os.link(os.path.join(library, "pipeline", "schedules.py"), os.path.join(folder, "p.py")),
    lambda: subprocess.run(["true"]),  # a child would read what the hook does not see
    lambda: open(os.path.join(folder, "another.py"), "w"),
    lambda: os.open("workers_copy.pyc", os.O_WRONLY | os.O_CREAT),
    lambda: os.rename(os.path.join(folder, "notes.txt"), os.path.join(folder, "notes.py")),
    lambda: open(guard.__file__, "a"),  # the grader's files beside the submission
):
    try:
        attempt()
    except PermissionError as error:
        assert guard.MARKER in str(error), error
    else:
        raise AssertionError("not refused")
print("ok")
"""


def test_the_run_time_guard_refuses_the_library_and_leaves_the_collectives_alone(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(GUARD_PROBE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(probe)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]

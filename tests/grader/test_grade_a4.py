"""``python -m grader grade a4_compression``: assignment 4 goes through the same pipeline as a1-a3.

The graded tests are the hidden tests with their points; the grader's second DGC
(``grader/a4_compression/reference.py``) agrees with the library's on random data; the example
students of ``grader/examples/a4_compression/make.py`` (correct, no error feedback, an exact
top-k instead of the sampled threshold, no momentum correction, a crash, the library's
compressor, a hidden loss, a dense hook, a compress_step that never sends, and updates that are
not the mean of what was allgathered) and the released stub get exactly their expected scores on
a subset of the hidden tests that tells them apart (one batch, ``--jobs 2``). The checks that
cheats met are tried here on forged reports: the convergence check's loss and counts, and
``applied_check`` (the update is the mean of the allgathered payloads, the ranks agree bit for
bit, the payloads are in the wire format, SGD replayed from the update ends at the parameters),
and the measured test's check (bytes to a target loss) on honest reports built in this process
and on forged ones.

Fast: the grading batch of the examples is ``tests/grader/batches/test_a4.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grader import forbidden
from grader.a4_compression import cases as table
from grader.a4_compression import reference, workers
from grader.a4_compression.grading import ASSIGNMENT as assignment
from minidist.parallel.compression import dgc as library

ROOT = Path(__file__).resolve().parents[2]


def test_the_case_table_holds_the_tests_this_file_grades():
    graded = assignment.graded_tests(seed=12345)
    names = [t.name for t in graded]
    assert len(names) >= 10


def test_the_bytes_test_cuts_the_model_into_several_buckets():
    from minidist.parallel.buckets import MB, assign_buckets

    spec = next(t for t in assignment.graded_tests(0) if t.name == "test_bytes_on_the_wire[2-pipe]").job.args[
        0
    ]
    named = list(workers.make_model(spec).named_parameters())
    assert len(assign_buckets(named, spec["bucket_mb"] * MB)) >= 3


def test_feedback_never_shows_expected_values():
    message = "m: step 3, the values sent: element (3,) is 0.125, expected 0.25 (4 of 10 elements differ)"
    assert "0.25" not in assignment.redact(message) and "0.125" in assignment.redact(message)
    assert "(4 of 10 elements differ)" in assignment.redact(message)


# --- the grader's DGC is written independently; it must agree with the library's ----------------
def test_reference_selection_equals_the_library_on_random_data():
    for seed, (n, k, ratio, minimum) in enumerate(
        [(5000, 20, 0.02, 64), (3000, 7, 0.05, 32), (400, 40, 1.0, 1)]
    ):
        values = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        config = {"sample_ratio": ratio, "min_sample": minimum}
        ours = reference.chosen_indices(values, k, config, torch.Generator().manual_seed(100 + seed))
        theirs = library.select_indices(values, k, ratio, torch.Generator().manual_seed(100 + seed), minimum)
        assert ours == theirs.tolist(), (n, k)


def test_reference_compress_sequence_equals_the_library():
    spec = table.sequence_spec(0, 50, sampled=True)
    ours = reference.sequence(spec)
    config = library.DGCConfig(
        **{key: value for key, value in spec["config"].items() if key in ("sparsity", "warmup_stage_steps")},
        momentum=spec["config"]["momentum"],
        clip_norm=spec["config"]["clip_norm"],
        sample_ratio=spec["config"]["sample_ratio"],
        min_sample=spec["config"]["min_sample"],
    )
    grads = workers.gradient_sequence(spec)
    state = library.DGCState.zeros_like(grads[0])
    generator = torch.Generator().manual_seed(spec["sample_seed"])
    for step, (grad, (chosen, values)) in enumerate(zip(grads, ours["steps"])):
        indices, sent = library.compress_step(state, grad, config, spec["world_size"], generator)
        assert indices.tolist() == chosen, step
        assert torch.allclose(sent, values, rtol=1e-12, atol=1e-15), step
    assert torch.allclose(state.accumulated, ours["accumulated"], rtol=1e-12, atol=1e-15)
    assert torch.allclose(state.velocity, ours["velocity"], rtol=1e-12, atol=1e-15)


def test_reference_sparsity_equals_the_library():
    for config in (
        {"sparsity": 0.999, "warmup_stage_steps": 3},
        {"sparsity": 0.99, "warmup_stage_steps": 0},
        {"sparsity": 0.9, "warmup_stage_steps": 2, "warmup_sparsities": (0.5,)},
    ):
        theirs = library.DGCConfig(**config)
        assert [reference.sparsity(s, config) for s in range(20)] == [
            library.sparsity_at(s, theirs) for s in range(20)
        ]
        assert [reference.slots(n, 0.999) for n in (1, 999, 1000, 12345)] == [
            library.slots_for(n, 0.999) for n in (1, 999, 1000, 12345)
        ]


# --- the checks that cheats met --------------------------------------------------------------------
def _converges_spec() -> dict:
    return next(t for t in assignment.graded_tests(0) if t.name == "test_converges[2-shm]").job.args[0]


def _compressed_report(spec: dict, params: dict, function: str = "allgather") -> dict:
    """A rank's report that sends what DGC sends (one bucket, k padding slots a step: nothing
    applied), holding ``params``."""
    numel = sum(p.numel() for p in params.values())
    calls, hooks, payloads, places, offset = [], [], [], [], 0
    for p in params.values():
        places.append([0, offset])
        offset += p.numel()
    for step in range(spec["steps"]):
        k = reference.slots(numel, reference.sparsity(step, spec["config"]))
        at = sum(t.numel() for t in payloads)
        calls.append({"phase": step, "function": function, "bytes": 8 * k, "async_op": True})
        calls[-1]["payload"] = [at, 2 * k]
        payloads.append(torch.zeros(2 * k, dtype=torch.int32))
        hooks.append([step, 0, numel])
    return {
        "params": params,
        "loss": 0.0,
        "calls": calls,
        "payloads": torch.cat(payloads),
        "hooks": hooks,
        "applied": torch.zeros(spec["steps"] * numel),
        "places": [places] * spec["steps"],
        "sent": [],
    }


def test_the_convergence_check_recomputes_the_loss_and_requires_compression():
    spec = _converges_spec()
    start = {name: p.detach().clone() for name, p in workers.make_model(spec).named_parameters()}
    check = reference.convergence_check("c", spec, table.CONVERGENCE_FACTOR)
    with pytest.raises(AssertionError, match="the loss is"):  # reported loss 0.0, untrained parameters
        check([_compressed_report(spec, start)] * 2)
    with pytest.raises(AssertionError, match="allreduce"):  # a dense hook
        check([_compressed_report(spec, start, "allreduce")] * 2)
    broken = {**start, "out.bias": torch.full_like(start["out.bias"], float("nan"))}
    with pytest.raises(AssertionError, match="NaN"):
        check([_compressed_report(spec, broken)] * 2)
    with pytest.raises(AssertionError, match="names differ"):
        check([_compressed_report(spec, {"w": torch.zeros(3)})] * 2)
    # the recomputed loss is the loss of those parameters
    assert reference.loss_of_params(spec, start) == pytest.approx(reference.initial_loss(spec))


def _averaging_reports(spec: dict, ranks: int = 2) -> list[dict]:
    """Reports of ``ranks`` ranks that each send k random (index, value) pairs a step (one
    bucket) and apply the mean of them, with the parameters SGD reaches from it: what
    ``applied_check`` accepts."""
    model = workers.make_model(spec)
    named = list(model.named_parameters())
    numel = sum(p.numel() for _, p in named)
    places, offset = [], 0
    for _, p in named:
        places.append([0, offset])
        offset += p.numel()
    g = torch.Generator().manual_seed(7)
    outs = [{"calls": [], "payloads": [], "hooks": [], "applied": [], "places": []} for _ in range(ranks)]
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"])
    for step in range(spec["steps"]):
        k = reference.slots(numel, reference.sparsity(step, spec["config"]))
        mean = torch.zeros(numel)
        for out in outs:
            indices = torch.randperm(numel, generator=g)[:k].sort().values
            values = torch.randn(k, generator=g) * 0.01
            at = sum(t.numel() for t in out["payloads"])
            out["payloads"].append(torch.cat([values.view(torch.int32), indices.to(torch.int32)]))
            out["calls"].append({"phase": step, "function": "allgather", "bytes": 8 * k, "async_op": True})
            out["calls"][-1]["payload"] = [at, 2 * k]
            out["hooks"].append([step, 0, numel])
            out["places"].append(places)
            mean.index_add_(0, indices, values)
        mean.div_(ranks)
        for out in outs:
            out["applied"].append(mean.clone())
        for (_, p), (_, start) in zip(named, places):
            p.grad = mean[start : start + p.numel()].view_as(p).clone()
        optimizer.step()
    final = {name: p.detach().clone() for name, p in named}
    for out in outs:
        out.update(payloads=torch.cat(out["payloads"]), applied=torch.cat(out["applied"]), sent=[], loss=0.0)
        out["params"] = {name: value.clone() for name, value in final.items()}
    return outs


def test_the_applied_check_ties_the_update_to_what_was_allgathered():
    name = "test_hook_matches_simulation[2-pipe]"
    spec = next(t for t in assignment.graded_tests(0) if t.name == name).job.args[0]
    reference.applied_check("a", spec, _averaging_reports(spec))  # the mean of the payloads: accepted

    def refused(change, match: str) -> None:
        outs = _averaging_reports(spec)
        change(outs)
        with pytest.raises(AssertionError, match=match):
            reference.applied_check("a", spec, outs)

    numel = sum(p.numel() for p in workers.make_model(spec).parameters())

    def own_row(outs):  # rank 1 applies its own payload only
        first = outs[1]["payloads"][: outs[1]["calls"][0]["payload"][1]]
        indices, values = reference.unpacked("", first, numel)
        outs[1]["applied"][:numel] = torch.zeros(numel).index_add_(0, indices, values)

    def longer_than_logged(outs):  # a review's torch-function mode: numel() said 2 k, more was sent
        outs[0]["payloads"] = torch.cat([outs[0]["payloads"], torch.zeros(6, dtype=torch.int32)])

    refused(longer_than_logged, "do not add up")

    def other_update(outs):  # both ranks apply something else (a dense average from elsewhere)
        for out in outs:
            out["applied"][:numel] += 1e-3

    def one_ulp(outs):  # rank 1 ends one float apart
        value = next(iter(outs[1]["params"].values())).view(-1)
        value[0] = torch.nextafter(value[0], torch.tensor(9.0))

    def outside(outs):  # an index past the bucket
        k = outs[0]["calls"][0]["payload"][1] // 2
        outs[0]["payloads"][k] = numel

    def twice(outs):
        k = outs[0]["calls"][0]["payload"][1] // 2
        outs[0]["payloads"][k + 1] = outs[0]["payloads"][k]

    def overwritten(outs):  # the parameters moved by something else than the recorded gradients
        for out in outs:
            for value in out["params"].values():
                value.add_(1e-2)

    def no_allgather(outs):
        kept, pieces, at = [c for c in outs[0]["calls"] if c["phase"] != 1], [], 0
        for call in kept:  # its payload goes with it: the log stays consistent
            start, length = call["payload"]
            pieces.append(outs[0]["payloads"][start : start + length])
            call["payload"], at = [at, length], at + length
        outs[0]["calls"], outs[0]["payloads"] = kept, torch.cat(pieces)

    refused(own_row, "not the mean of the payloads")
    refused(other_update, "not the mean of the payloads")
    refused(one_ulp, "differs from rank 0's")
    refused(outside, "outside the bucket")
    refused(twice, "index twice")
    refused(overwritten, "against SGD with the gradients DDP applied")
    refused(no_allgather, "0 allgathers for 1 buckets")


def test_the_error_feedback_check_refuses_a_step_that_sends_nothing():
    name = "test_error_feedback_loses_nothing"
    spec = next(t for t in assignment.graded_tests(0) if t.name == name).job.args[0]
    grads = workers.gradient_sequence(spec)
    empty = {"indices": torch.zeros(0, dtype=torch.long), "values": torch.zeros(0, dtype=torch.float64)}
    mass_kept = {"steps": [empty] * spec["steps"], "accumulated": torch.stack(grads).sum(0)}
    with pytest.raises(AssertionError, match="between 1 and"):
        reference.feedback_check("f", spec)([mass_kept])
    twice = {"indices": torch.tensor([3, 3]), "values": torch.zeros(2, dtype=torch.float64)}
    with pytest.raises(AssertionError, match="distinct"):
        reference.feedback_check("f", spec)([{**mass_kept, "steps": [twice] * spec["steps"]}])
    zeros = {"indices": torch.tensor([3]), "values": torch.zeros(1, dtype=torch.float64)}
    with pytest.raises(AssertionError, match="every value sent was 0"):
        reference.feedback_check("f", spec)([{**mass_kept, "steps": [zeros] * spec["steps"]}])


def test_the_collective_log_reads_async_op_by_position_and_by_keyword():
    def allgather(comm, tensor, algorithm="auto", async_op=False):
        return tensor

    log = workers.CollectiveLog()
    wrapped = log._wrap("allgather", allgather)
    wrapped(None, torch.zeros(4), "auto", True)
    wrapped(None, torch.zeros(4), async_op=True)
    wrapped(None, torch.zeros(2, dtype=torch.float64))
    assert [(c["bytes"], c["async_op"]) for c in log.calls] == [(16, True), (16, True), (16, False)]


# --- intake and run time ---------------------------------------------------------------------------
def test_the_intake_check_accepts_the_solution_and_refuses_the_library_compressor():
    rules = assignment.forbidden
    assert forbidden.check((ROOT / "solutions/a4_compression/dgc.py").read_text(), rules) is None
    for code in (
        "from minidist.parallel.compression import DeepGradientCompression",
        "from minidist.parallel import compression",
        "import minidist.parallel.compression.dgc as dgc",
        "from minidist.parallel.compression.dgc import select_indices",
        "import torch.distributed as dist",
    ):
        assert forbidden.check(code, rules) is not None, code


GUARD_PROBE = """
import torch

import minidist as md
from grader import guard
from grader.a4_compression import rules
from minidist.parallel.compression import dgc

guard.install_rules(rules)
refused = []
for call in (
    lambda: dgc.select_indices(torch.randn(10), 2, 1.0, None),
    lambda: dgc.DeepGradientCompression()(None, torch.zeros(4), 0),
    lambda: __import__("minidist.parallel.compression.traffic", fromlist=["x"]).dense_ring_bytes(4, 2),
):
    try:
        call()
    except PermissionError as error:
        refused.append(guard.MARKER in str(error))
assert refused == [True, True, True], refused
model = torch.nn.Linear(2, 2)  # the library's DDP and collectives stay allowed
assert md.DistributedDataParallel.__init__.__code__.co_name == "__init__"
print("ok")
"""


def test_the_run_time_guard_refuses_the_library_compressor_and_leaves_ddp_alone(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(GUARD_PROBE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(probe)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


# --- the measured test: bytes to a target loss, measured on the trusted side ------------------
SMALL = {
    **table.MEASURED,
    "features": 8,
    "hidden": 16,
    "classes": 3,
    "rows": 256,
    "local_batch": 16,
    "steps": 40,
    "lr": 0.3,
}


def _measured_reports(spec: dict, sparsity: float) -> tuple[list[dict], list[float], int]:
    """What two honest ranks of DGC at ``sparsity`` report to ``measured_check``, built in one
    process with the reference's compressor (no hook, no DDP); with the loss after every step and
    the bucket's size."""
    model = workers.make_model(spec)
    x, y = workers.make_data(spec)
    params = [p for _, p in reversed(list(model.named_parameters()))]
    numel = sum(p.numel() for p in params)
    config = {"sparsity": sparsity, "momentum": 0.9, "sample_ratio": 1.0, "min_sample": 1}
    gen = torch.Generator()
    comps = [reference.Compressor(numel, config, 2, gen, torch.float32) for _ in range(2)]
    outs = [{"calls": [], "payloads": [], "hooks": [], "sent": []} for _ in range(2)]
    losses = []
    for step in range(spec["steps"]):
        mean = torch.zeros(numel)
        k = reference.slots(numel, sparsity)
        for rank, out in enumerate(outs):
            rows = workers.batch_rows(spec, step, rank)
            grads = torch.autograd.grad(workers.loss_of(model, x[rows], y[rows]), params)
            chosen, values = comps[rank].step(torch.cat([g.reshape(-1) for g in grads]))
            payload = torch.zeros(2 * k, dtype=torch.int32)
            payload[: len(chosen)] = values.view(torch.int32)
            payload[k : k + len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
            at = sum(p.numel() for p in out["payloads"])
            out["payloads"].append(payload)
            out["calls"].append(
                {
                    "phase": step,
                    "function": "allgather",
                    "bytes": 8 * k,
                    "async_op": True,
                    "payload": [at, 2 * k],
                }
            )
            out["hooks"].append([step, 0, numel])
            out["sent"].append(8 * k)  # 2 ranks: the ring allgather sends the one other block
            mean.index_add_(0, torch.tensor(chosen, dtype=torch.long), values)
        with torch.no_grad():
            offset = 0
            for p in params:
                p.sub_(spec["lr"] * (mean / 2)[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            losses.append(float(workers.loss_of(model, x, y)))
    for out in outs:
        out["payloads"] = torch.cat(out["payloads"])
        out["sent_in_training"] = sum(out["sent"])
        out["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return outs, losses, numel


def test_the_measured_check_counts_the_bytes_to_the_target_and_refuses_what_was_not_sent():
    outs, losses, numel = _measured_reports(SMALL, 0.9)
    target = sorted(losses)[len(losses) // 2]  # reached about half way
    spec = {**SMALL, "target": target}
    mine = next(step for step, loss in enumerate(losses) if loss <= target)
    dense = reference.dense_steps_to(spec, target)
    want = (dense + 1) * 2 * (2 - 1) / 2 * 4 * numel / sum(outs[0]["sent"][: mine + 1])
    assert reference.measured_check("m", spec)(outs) == pytest.approx(want, rel=1e-9)

    def fails(change, match):
        forged = [
            {**out, "calls": [dict(c) for c in out["calls"]], "sent": list(out["sent"])} for out in outs
        ]
        forged = [{**out, "params": dict(out["params"])} for out in forged]
        change(forged)
        with pytest.raises(AssertionError, match=match):
            reference.measured_check("m", spec)(forged)

    def more_bytes(forged):  # something travelled beside the allgather
        forged[1]["sent"][3] += 8

    def outside_backward(forged):
        forged[0]["sent_in_training"] += 8

    def another_update(forged):  # the ranks applied something else than the payloads' mean
        for out in forged:
            out["params"]["out.bias"] = out["params"]["out.bias"] + 1e-3

    def an_allreduce(forged):
        forged[0]["calls"][5]["function"] = "allreduce"

    fails(more_bytes, "the transport sent")
    fails(outside_backward, "outside backward")
    fails(another_update, "replayed from the mean of the payloads")
    fails(an_allreduce, "ONE asynchronous md.allgather")
    with pytest.raises(AssertionError, match="never reached"):
        reference.measured_check("m", {**spec, "target": min(losses) / 2})(outs)

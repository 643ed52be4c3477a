"""DistributedDataParallel: N ranks x b samples == one process x N*b samples.

Every multi-rank result is compared with a single-process reference on the same fixed
data (``ddp_workers.train_single``), or with torch's own DDP. Ranks start from different
random weights, so a missing initial broadcast shows up as a difference.
"""

from __future__ import annotations

import math

import pytest
import torch

import ddp_workers as w
import minidist as md
from minidist import trace
from minidist.transport.base import BaseComm

pytestmark = pytest.mark.timeout(180)


def assert_states_close(got: dict, want: dict, atol: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")


def SoloComm() -> BaseComm:
    """A one-rank communicator for in-process tests: the transports' base class, which has
    no way to move bytes (collectives return at once for p = 1; a send would raise)."""
    return BaseComm(rank=0, world_size=1)


# --- equal to one process --------------------------------------------------------------------
CASES = {
    # id: (world_size, transport, bucket_mb, options, expected buckets: "one", "several", "each")
    "p2-shm-one-bucket": (2, "shm", math.inf, {}, "one"),
    "p3-shm-each-param-tied-frozen-unused": (
        3,
        "shm",
        0.0,
        dict(tie=True, frozen=True, unused=True, sometimes_used=True, find_unused=True),
        "each",
    ),
    "p2-pipe-several-tied-frozen": (2, "pipe", w.SEVERAL_BUCKETS_MB, dict(tie=True, frozen=True), "several"),
    "p3-pipe-one-bucket-unused": (
        3,
        "pipe",
        1.0,
        dict(unused=True, sometimes_used=True, find_unused=True),
        "one",
    ),
    "p2-pipe-each-no-overlap": (2, "pipe", 0.0, dict(overlap=False), "each"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ddp_equals_one_process_with_the_whole_batch(case):
    world_size, transport, bucket_mb, options, layout = CASES[case]
    cfg = w.config(world_size=world_size, bucket_mb=bucket_mb, **options)
    outs = md.launch(w.train_ddp, world_size, args=(cfg,), transport=transport, timeout=90)
    reference = w.train_single(cfg)
    for out in outs:
        assert_states_close(out["state"], reference)
    buckets = outs[0]["buckets"]
    trainable = {n for n, p in w.make_model(cfg, 0).named_parameters() if p.requires_grad}
    assert sorted(n for b in buckets for n in b) == sorted(trainable)  # each once, frozen left out
    expected = {"one": 1, "each": len(trainable)}.get(layout)
    if expected is None:
        assert 1 < len(buckets) < len(trainable)
    else:
        assert len(buckets) == expected


@pytest.mark.parametrize(
    "transport, options", [("shm", {}), ("pipe", dict(sometimes_used=True, find_unused=True))]
)
def test_no_sync_accumulation_equals_one_process_with_k_batches(transport, options):
    cfg = w.config(micro=3, bucket_mb=w.SEVERAL_BUCKETS_MB, **options)
    outs = md.launch(w.train_ddp, 2, args=(cfg,), transport=transport, timeout=90)
    reference = w.train_single(cfg)
    for out in outs:
        assert_states_close(out["state"], reference)


def test_same_parameters_as_torch_ddp_on_gloo():
    cfg = w.config(
        tie=True,
        frozen=True,
        unused=True,
        sometimes_used=True,
        find_unused=True,
        bucket_mb=w.SEVERAL_BUCKETS_MB,
    )
    outs = md.launch(w.train_torch_ddp_and_ours, 2, args=(cfg,), transport="torch", timeout=120)
    for out in outs:
        assert_states_close(out["ours"], out["torch"])
    assert_states_close(outs[0]["ours"], w.train_single(cfg))


# --- what goes over the wire -------------------------------------------------------------
@pytest.mark.parametrize("world_size, bucket_mb", [(2, math.inf), (2, w.SEVERAL_BUCKETS_MB), (3, 0.0)])
def test_one_collective_per_bucket_and_ring_bytes(world_size, bucket_mb):
    cfg = w.config(world_size=world_size, bucket_mb=bucket_mb, steps=2)
    outs = md.launch(w.count_collectives, world_size, args=(cfg,), transport="pipe", timeout=90)
    buckets, grad_bytes = outs[0]["buckets"], outs[0]["grad_bytes"]
    for step in range(cfg["steps"]):
        for out in outs:
            assert out["steps"][step]["calls"] == buckets
            # a ring allreduce: each rank sends 2(p-1) messages (p-1 reduce-scatter, p-1 allgather)
            assert out["steps"][step]["messages"] == buckets * 2 * (world_size - 1)
        # all ranks together send 2(p-1) x every gradient byte: 2(p-1)/p of it per rank
        assert sum(out["steps"][step]["bytes"] for out in outs) == 2 * (world_size - 1) * grad_bytes


def test_a_parameter_without_gradient_is_a_clear_error_not_a_hang():
    cfg = w.config(unused=True, bucket_mb=w.SEVERAL_BUCKETS_MB)
    with pytest.raises(md.WorkerError, match=r"unused\.weight.*find_unused_parameters=True"):
        md.launch(w.unused_without_flag, 2, args=(cfg,), transport="pipe", timeout=60)


def test_error_names_every_unused_parameter_in_process():
    cfg = w.config(unused=True)
    ddp = md.DistributedDataParallel(w.make_model(cfg, 0), SoloComm())
    ids, targets = w.make_data(cfg)
    with pytest.raises(
        RuntimeError, match=r"\['unused\.weight', 'unused\.bias'\]|\['unused\.bias', 'unused\.weight'\]"
    ):
        ddp(ids[0, 0], targets[0, 0]).backward()
    ddp = md.DistributedDataParallel(w.make_model(cfg, 0), SoloComm(), find_unused_parameters=True)
    ddp(ids[0, 0], targets[0, 0]).backward()  # with the flag: fine, and the unused grads stay None
    assert ddp.module.unused.weight.grad is None and ddp.module.hidden.weight.grad is not None


# --- buckets and gradients, in one process -----------------------------------------------------
def test_buckets_fill_in_reverse_registration_order_tied_once_frozen_out():
    cfg = w.config(tie=True, frozen=True)
    ddp = md.DistributedDataParallel(w.make_model(cfg, 0), SoloComm(), bucket_mb=0.0)
    assert ddp.buckets == [["head.bias"], ["hidden.bias"], ["hidden.weight"], ["embed.weight"]]
    ddp = md.DistributedDataParallel(w.make_model(cfg, 0), SoloComm(), bucket_mb=math.inf)
    assert ddp.buckets == [["head.bias", "hidden.bias", "hidden.weight", "embed.weight"]]
    with pytest.raises(ValueError, match="bucket_mb"):
        md.DistributedDataParallel(w.make_model(cfg, 0), SoloComm(), bucket_mb=-1)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_equal_plain_autograd_over_steps(set_to_none):
    """One rank: DDP's grads (views into the buckets after step 1) equal plain autograd's,
    whether zero_grad frees them or zeroes them in place (then autograd accumulates into the bucket)."""
    cfg = w.config(tie=True, steps=3)
    plain, wrapped = w.make_model(cfg, 7), w.make_model(cfg, 7)
    ddp = md.DistributedDataParallel(wrapped, SoloComm(), bucket_mb=w.SEVERAL_BUCKETS_MB)
    ids, targets = w.make_data(cfg)
    for step in range(cfg["steps"]):
        plain(ids[step, 0], targets[step, 0]).backward()
        ddp(ids[step, 0], targets[step, 0]).backward()
        for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
            torch.testing.assert_close(b.grad, a.grad, msg=lambda m: f"step {step} {name}: {m}")
        storages = {p.grad.untyped_storage().data_ptr() for p in wrapped.parameters()}
        assert len(storages) == len(ddp.buckets) > 1  # every grad is a view into its bucket
        plain.zero_grad(set_to_none=set_to_none)
        ddp.zero_grad(set_to_none=set_to_none)


def test_overlap_first_bucket_starts_before_backward_ends():
    events = md.launch(
        w.overlap_trace, 2, args=(w.config(bucket_mb=0.015), 6, 64), transport="shm", timeout=90
    )
    for out in events:
        assert out["buckets"] > 2
        backward = [e for e in out["events"] if e["name"] == "backward"]
        first = [e for e in out["events"] if e["name"] == "allreduce bucket 0"]
        last = [e for e in out["events"] if e["name"] == f"allreduce bucket {out['buckets'] - 1}"]
        assert len(backward) == len(first) == len(last) == 2  # two steps
        for bwd, b0, bn in zip(backward, first, last):
            assert bwd["ts_us"] < b0["ts_us"] < bwd["ts_us"] + bwd["dur_us"]  # launched during backward
            assert bn["ts_us"] + bn["dur_us"] >= b0["ts_us"] + b0["dur_us"]  # completes in order
        assert trace.overlap(out["events"]) > 0


def test_without_overlap_every_bucket_starts_after_backward():
    cfg = w.config(bucket_mb=0.015, overlap=False)
    events = md.launch(w.overlap_trace, 2, args=(cfg, 6, 64), transport="shm", timeout=90)
    for out in events:
        backward = [e for e in out["events"] if e["name"] == "backward"]
        buckets = [e for e in out["events"] if e["name"].startswith("allreduce bucket")]
        assert len(buckets) == 2 * out["buckets"]
        for span in buckets:
            assert any(span["ts_us"] >= b["ts_us"] + b["dur_us"] for b in backward)
        assert trace.overlap(out["events"]) == 0.0


def test_bert_tiny_through_ddp_equals_one_process():
    batch, seq, steps = 2, 16, 2
    outs = md.launch(w.bert_ddp, 2, args=(batch, seq, steps, 1.0), transport="shm", timeout=150)
    reference = w.bert_single(2, batch, seq, steps)
    for out in outs:
        assert_states_close(out["grads"], reference["grads"], atol=1e-7)  # the averaged gradient
        # AdamW divides each element's step by its own gradient scale, so a last-bit difference
        # in a near-zero gradient can move that element by a visible part of lr (1e-3):
        # after two steps we allow 1% of one step.
        assert_states_close(out["state"], reference["state"], atol=1e-5)
    names = [n for b in outs[0]["buckets"] for n in b]
    assert len(outs[0]["buckets"]) > 1 and len(names) == len(set(names))
    assert names.count("transformer.embeddings.word.weight") == 1  # tied with the MLM head: once


@pytest.mark.timeout(400)
def test_ddp_bench_smoke(tmp_path, capsys):
    """The benchmark end to end on BERT tiny, one measured step, every row present."""
    from minidist.bench import ddp as bench

    cfg = bench.DdpBench(model="tiny", batch=1, seq=8, steps=1, warmup=0)
    result = bench.run(cfg, transports=("pipe",), emulated=True, out=str(tmp_path), plot=False)
    labels = [(transport, label) for transport, label, _ in result["rows"]]
    assert labels == [
        ("-", "one process"),
        ("gloo", "torch DDP"),
        ("pipe", "after backward"),
        ("pipe", "buckets"),
        ("pipe", "overlap"),
        ("10G", "after backward (10G)"),
        ("10G", "buckets (10G)"),
        ("10G", "overlap (10G)"),
    ]
    rows = {label: r for _, label, r in result["rows"]}
    ring = rows["one process"]["grad_bytes"]  # 2(p-1)/p x gradient bytes = all of them at p = 2
    assert rows["after backward"]["bytes_per_step"] == ring and rows["overlap"]["bytes_per_step"] == ring
    assert rows["after backward"]["buckets"] == 1 < rows["overlap"]["buckets"]
    assert rows["after backward"]["overlap"] == 0.0
    for label in ("overlap", "overlap (10G)"):  # >= 1: perfect overlap never makes a step slower
        assert rows[label]["bound"] >= 1.0 and 0 < rows[label]["tail_share"] <= 1
    assert rows["torch DDP"]["step_s"] == rows["overlap"]["torch_step_s"]  # same launch, same reference
    assert (tmp_path / "ddp_tiny_p2_b1.json").exists()
    assert "x torch" in capsys.readouterr().out


@pytest.mark.parametrize("transport, algorithm", [("shm", "auto"), ("pipe", "ring"), ("pipe", "auto")])
def test_allreduce_average_is_the_mean_of_every_rank(transport, algorithm):
    """The default hook divides inside the collective (op="avg"): wait() returns exactly
    the mean of the ranks' buffers, computed here in one process -- divided once, not twice."""
    outs = md.launch(w.average_buckets, 3, args=(algorithm,), transport=transport, timeout=60)
    for index, numel in enumerate((7, 1000, 33)):
        ranks = [
            torch.randn(numel, generator=torch.Generator().manual_seed(100 * index + r)) for r in range(3)
        ]
        want = torch.stack(ranks).sum(0) / 3
        for out in outs:
            torch.testing.assert_close(out[index], want, rtol=1e-6, atol=1e-6)


def test_collective_work_calls_done_callbacks_once_in_the_thread_that_finished_it():
    """DDP ends a bucket's trace span from the work's done callback (the true completion
    time): pending -> called once by the communication thread, after the work is done;
    already done -> at once in the caller; an error still calls it; a failing callback
    does not stop the stream."""
    import threading

    from minidist.collectives.async_ops import CollectiveStream

    stream = CollectiveStream(SoloComm())
    gate = threading.Event()
    seen = []

    def note(work):
        seen.append((work, threading.current_thread() is stream.thread, work.is_completed()))

    gated = stream.submit("gated", lambda: gate.wait(10) and None)
    gated.add_done_callback(note)
    gated.add_done_callback(lambda work: 1 / 0)  # printed, then ignored
    assert seen == []
    failing = stream.submit("failing", lambda: [][1])
    failing.add_done_callback(note)
    gate.set()
    stream.stop()  # runs what is queued, then joins the thread
    assert seen == [(gated, True, True), (failing, True, True)]
    gated.add_done_callback(note)
    assert seen[-1] == (gated, False, True)
    with pytest.raises(IndexError):
        failing.wait(1)


def test_overlap_bound_formula():
    """The bench's bound: after-backward step 100 ms with B = 40, C = 30; the last bucket
    holds half the bytes, so 15 ms of C can never hide: best step 100 - 70 + max(55, 30) = 85."""
    from minidist.parallel.overlap import overlap_bound

    after = {"step_s": 0.100, "backward_ms": 40.0, "comm_ms_per_step": 30.0}
    step_bound, bc_bound = overlap_bound(after, 0.5)
    assert step_bound == pytest.approx(100 / 85)
    assert bc_bound == pytest.approx(70 / 40)
    slow_link = {"step_s": 0.200, "backward_ms": 40.0, "comm_ms_per_step": 80.0}  # C > B + C/4: C bounds
    assert overlap_bound(slow_link, 0.25)[0] == pytest.approx(200 / (200 - 120 + 80))


def test_a_comm_hook_that_returns_a_new_tensor():
    """comm_hook contract: wait() returns the averaged flat gradient, here a new tensor
    (mean of an allgather), which DDP copies back into the bucket."""
    cfg = w.config(bucket_mb=w.SEVERAL_BUCKETS_MB, tie=True)
    outs = md.launch(w.train_ddp_allgather_hook, 2, args=(cfg,), transport="pipe", timeout=90)
    reference = w.train_single(cfg)
    for out in outs:
        assert_states_close(out["state"], reference)

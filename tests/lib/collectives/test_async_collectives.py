"""Async collectives (``async_op=True``) against the blocking versions and a single-process reference."""

from __future__ import annotations

import pytest
import torch

import async_workers
import minidist as md
from async_workers import CASES, rank_input

TRANSPORTS = ["pipe", "shm", "torch"]


def reference(kind: str, rank: int, p: int, inputs: list[torch.Tensor]) -> torch.Tensor:
    """What rank ``rank`` must hold after the collective, computed in this process."""
    stacked = torch.stack(inputs)
    if kind == "allreduce":
        return stacked.sum(0)
    if kind == "broadcast":
        return inputs[p - 1]
    if kind == "reduce":  # max into rank 1; the others keep their input
        return stacked.max(0).values if rank == 1 else inputs[rank]
    if kind == "allgather":
        return stacked
    if kind == "reduce_scatter":
        rows = inputs[0].shape[0] // p
        return stacked.sum(0)[rank * rows : (rank + 1) * rows]
    raise ValueError(kind)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_async_results_equal_blocking_and_reference(transport, world_size):
    outs = md.launch(async_workers.async_and_blocking, world_size, transport=transport, timeout=180)
    for rank, out in enumerate(outs):
        assert out["completed"]
        for seed, (kind, algorithm, shape) in enumerate(CASES):
            inputs = [rank_input(r, shape, seed) for r in range(world_size)]
            want = reference(kind, rank, world_size, inputs)
            what = f"rank {rank}, {kind} {algorithm} {shape} on {transport}"
            torch.testing.assert_close(out["blocking"][seed], want, msg=what)
            # async and mixed calls run the same algorithm on the same data: bit-identical
            assert torch.equal(out["async"][seed], out["blocking"][seed]), what
            assert torch.equal(out["mixed"][seed], out["blocking"][seed]), what


@pytest.mark.parametrize(
    "numel, algorithm", [(256, "ring"), (300_000, "ring"), (256, "shm"), (100_000, "shm")]
)
def test_traffic_counters_see_messages_sent_from_the_comm_thread(numel, algorithm):
    """The shm fast path keeps one tally per thread; the comm thread's must be summed too."""
    p = 3
    outs = md.launch(
        async_workers.stats_async_vs_blocking, p, args=(numel, algorithm), transport="shm", timeout=60
    )
    for blocking, from_thread in outs:
        assert from_thread == blocking
        if algorithm == "ring":  # reduce-scatter + allgather: 2 (p-1) messages, 2 (p-1)/p n bytes
            assert blocking["messages_sent"] >= 2 * (p - 1)
            assert blocking["bytes_sent"] == pytest.approx(2 * (p - 1) / p * numel * 4, abs=8 * p)
        else:  # the shared workspace: no messages at all
            assert blocking["messages_sent"] == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_errors_are_raised_at_the_call_site_or_by_wait_and_never_lost(transport):
    p = 2
    outs = md.launch(async_workers.errors_and_validation, p, transport=transport, timeout=120)
    for seen in outs:
        assert "op" in seen["bad_op"] and "median" in seen["bad_op"]
        assert seen["bad_algorithm"].startswith("ValueError") and "magic" in seen["bad_algorithm"]
        assert (
            seen["not_divisible"].startswith("ValueError")
            and "multiple of world_size" in seen["not_divisible"]
        )
        assert seen["bad_root"].startswith("ValueError")
        assert not seen["thread_started_by_bad_calls"]
        assert seen["late_result"] == [float(sum(range(p)))] * 4
        assert seen["mismatch"].startswith("MessageMismatch")
        for after in ("after_async", "after_blocking"):
            assert seen[after].startswith("CollectiveStreamError"), seen[after]
            assert "allreduce" in seen[after] and "was not run" in seen[after]
    timeout = outs[0]["timeout"]
    assert "allreduce" in timeout and "did not complete within 0.01 s" in timeout and "rank 0" in timeout


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_rank_that_dies_is_reported_without_a_hang(transport):
    with pytest.raises(md.WorkerError) as caught:
        md.launch(async_workers.die_while_others_wait, 2, transport=transport, timeout=60)
    assert caught.value.rank == 1
    assert caught.value.exitcode == 3


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_close_stops_the_comm_thread_after_queued_work(transport):
    (out0, out1) = md.launch(async_workers.threads_after_close, 2, transport=transport, timeout=60)
    for out in (out0, out1):
        assert out["results"] == [[2.0] * 8, [2.0] * 9, [2.0] * 8]
        assert len(out["before"]) == 1  # the view uses the communicator's thread
        assert out["after_view_close"] == out["before"]  # the view does not own it
        assert out["after_close"] == []
        assert out["pending_done"]
        assert out["pending_value"] == [2.0] * 8


@pytest.mark.parametrize("transport", ["shm", "pipe"])
def test_async_allreduce_of_cuda_tensors(transport):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # shm and pipe stage through the CPU, so the two ranks may share one GPU
    outs = md.launch(async_workers.cuda_async_allreduce, 2, transport=transport, device="cuda", timeout=120)
    for out in outs:
        assert out["ok"] == [True, True]
        assert out["on_device"] == [out["comm_device"]] * 2
        assert out["thread_device"] == out["comm_device"]  # the comm thread uses the rank's GPU

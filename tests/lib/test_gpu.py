"""CUDA paths (skipped without a GPU): NCCL through the torch transport, staging via CPU for shm/pipe."""

from __future__ import annotations

import pytest
import torch

import minidist as md
import workers


def _world_size() -> int:
    return 2 if torch.cuda.device_count() >= 2 else 1


@pytest.mark.parametrize("transport", ["torch", "shm", "pipe"])
def test_cuda_tensors_travel_between_ranks(transport):
    # shm and pipe stage through the CPU, so two ranks may share one GPU; NCCL needs two
    world_size = _world_size() if transport == "torch" else 2
    if world_size < 2:
        pytest.skip("NCCL needs two GPUs for two ranks")
    outs = md.launch(workers.cuda_pingpong, world_size, args=(1 << 20,), transport=transport, device="cuda")
    expected = torch.arange(1 << 20, dtype=torch.float32) * 2
    assert torch.equal(outs[0], expected) and torch.equal(outs[1], expected)


def test_each_rank_gets_its_own_gpu():
    outs = md.launch(workers.identity, _world_size(), transport="torch", device="cuda")
    assert [o[3] for o in outs] == [f"cuda:{r}" for r in range(len(outs))]


# --- DistributedDataParallel on CUDA (tests/lib/parallel/ddp_workers.py; pytest tests/lib/test_gpu.py -k ddp)
def _ddp_reference(cfg):
    import ddp_workers

    return ddp_workers.train_single(cfg)  # on the CPU, in this process


@pytest.mark.parametrize("overlap", [True, False])
def test_ddp_cuda_on_shm_equals_one_process(overlap):
    """Two ranks on one or two GPUs (shm stages through the CPU); gradients are allreduced
    on the comm thread's own CUDA stream, ordered against backward by events."""
    import ddp_workers

    cfg = ddp_workers.config(
        bucket_mb=ddp_workers.SEVERAL_BUCKETS_MB, tie=True, frozen=True, overlap=overlap, steps=4
    )
    outs = md.launch(ddp_workers.train_ddp, 2, args=(cfg,), transport="shm", device="cuda", timeout=120)
    reference = _ddp_reference(cfg)
    for out in outs:
        for name, value in reference.items():
            torch.testing.assert_close(out["state"][name], value, rtol=1e-4, atol=1e-5)


def test_ddp_cuda_no_sync_and_unused_on_pipe():
    import ddp_workers

    cfg = ddp_workers.config(micro=2, sometimes_used=True, unused=True, find_unused=True, bucket_mb=0.0)
    outs = md.launch(ddp_workers.train_ddp, 2, args=(cfg,), transport="pipe", device="cuda", timeout=120)
    reference = _ddp_reference(cfg)
    for out in outs:
        for name, value in reference.items():
            torch.testing.assert_close(out["state"][name], value, rtol=1e-4, atol=1e-5)


def test_ddp_cuda_over_nccl_equals_one_process():
    import ddp_workers

    if torch.cuda.device_count() < 2:
        pytest.skip("the torch transport (NCCL) needs one GPU per rank: two GPUs")
    cfg = ddp_workers.config(bucket_mb=ddp_workers.SEVERAL_BUCKETS_MB, tie=True, steps=4)
    outs = md.launch(ddp_workers.train_ddp, 2, args=(cfg,), transport="torch", device="cuda", timeout=180)
    reference = _ddp_reference(cfg)
    for out in outs:
        for name, value in reference.items():
            torch.testing.assert_close(out["state"][name], value, rtol=1e-4, atol=1e-5)

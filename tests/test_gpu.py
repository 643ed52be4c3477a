"""CUDA paths (skipped without a GPU): NCCL through the torch transport, staging via CPU for shm/pipe."""

from __future__ import annotations

import pytest
import torch

import minidist as md
import workers

pytestmark = pytest.mark.gpu


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

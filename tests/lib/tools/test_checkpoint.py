"""Checkpoints that reshard (``minidist.checkpoint``): saved at 4 ranks, loaded at 1, 2 and 3.

References: the full tensors gathered at save time (ZeRO-3's ``full_state``, the ZeRO-2 moments
allgathered), the dense one-process decoder the tensor-parallel one was cut from, and
torch.distributed.checkpoint (DCP) on gloo for the same weights (in the benchmark's launch).
One launch per world size (module fixtures); every test reads their results.
"""

from __future__ import annotations

import json
import os

import pytest

import checkpoint_workers as w
import minidist as md
from minidist.bench import checkpoint as checkpoint_bench

UNITS = {"fsdp.unit0:Linear": 35, "fsdp.unit1:Linear": 18}  # elements per ZeRO-3 unit


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt"))
    ref = md.launch(w.save_at_four, 4, args=(path,), transport="shm", timeout=90)[0]
    return path, ref


@pytest.fixture(scope="module")
def loaded(saved):
    """Rank results of the load at each world size (2 on the torch transport, with DCP beside it)."""
    path, ref = saved
    out = {}
    for world in (1, 2, 3):
        transport = "torch" if world == 2 else "shm"
        out[world] = md.launch(w.load_at, world, args=(path, ref), transport=transport, timeout=90)
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("what", ["fsdp", "fsdp_optim", "zero", "zero_optim", "tp", "tp_into_zero3"])
def test_load_at_another_world_size_is_bit_equal(loaded, world, what):
    """ZeRO-3 weights and its optimizer's moments and steps, ZeRO-2 weights and moments, the TP
    decoder (and it loaded into ZeRO-3): torch.equal to the reference, on every rank."""
    for rank, result in enumerate(loaded[world]):
        assert result[what] == [], f"rank {rank} of {world}: {what} differs in {result[what]}"


def test_zero_optimizer_state_loads_into_a_plain_optimizer(loaded):
    """ZeRO-2's flat moment shards saved at 4, loaded into AdamW state over a plain model: equal."""
    assert loaded[1][0]["zero_into_plain"] == []


def test_the_tensor_parallel_save_has_the_dense_models_names(loaded):
    assert loaded[1][0]["tp_names"] == len(w.dense().state_dict())


@pytest.mark.parametrize("world", [2, 3])
def test_padding_of_the_new_shards_is_zero(loaded, world):
    """The fresh shards' padding was set to 7 before the load: it must come back 0."""
    pads = [pad for result in loaded[world] for unit in result["fsdp_padding"] for pad in unit]
    assert pads and set(pads) == {0.0}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_rank_reads_only_what_it_holds(loaded, world):
    for result in loaded[world]:
        assert result["bytes_read"] == result["bytes_held"]


def test_metadata_records_shapes_offsets_and_padding(saved):
    path, _ = saved
    with open(os.path.join(path, "sync", "metadata.json")) as f:
        meta = json.load(f)
    assert meta["world_size"] == 4
    for group, numel in UNITS.items():
        assert meta["flat_groups"][group]["padding"] == -numel % 4
    assert meta["flat_groups"]["zero_optim.exp_avg"]["padding"] == -53 % 4
    up = meta["tensors"]["tp.transformer.blocks.0.mlp.up.weight"]  # column-parallel: 96 rows / 4
    assert up["shape"] == [96, 24]
    assert [p["offsets"] for p in up["pieces"]] == [[24 * r, 0] for r in range(4)]
    down = meta["tensors"]["tp.transformer.blocks.0.mlp.down.weight"]  # row-parallel: columns
    assert [p["offsets"] for p in down["pieces"]] == [[0, 24 * r] for r in range(4)]
    bias = meta["tensors"]["tp.transformer.blocks.0.mlp.down.bias"]  # replicated: written once
    assert [p["file"] for p in bias["pieces"]] == ["rank00000.safetensors"]
    first = meta["tensors"]["fsdp.first.weight"]  # 30 of unit0's 35 elements, 9 per rank
    assert [p["flat"] for p in first["pieces"]] == [[0, 9], [9, 18], [18, 27], [27, 30]]


def test_async_save_is_the_snapshot_of_its_step(loaded):
    """Saved asynchronously, then a training step ran while it wrote: the save has the old weights."""
    result = loaded[1][0]
    assert result["async_vs_sync"] == []
    assert len(result["async_vs_after"]) == 4  # the step changed all four parameters


def test_a_mismatched_model_is_refused_naming_the_tensor_and_shapes(loaded):
    message = loaded[1][0]["mismatch"]
    assert "'fsdp.first.weight'" in message and "(5, 6)" in message and "(4, 6)" in message
    assert "metadata.json" in loaded[1][0]["missing"]


def test_a_missing_piece_is_an_error_not_garbage(loaded):
    """The TP save without rank 1's file, loaded into ZeRO-3 (the cross-form path)."""
    result = loaded[1][0]
    assert result["missing_file"].startswith("FileNotFoundError") and "rank00001" in result["missing_file"]
    assert result["missing_piece"].startswith("ValueError") and "is covered by" in result["missing_piece"]


def test_save_refuses_to_overwrite_and_overwrite_keeps_the_old_until_done(loaded):
    result = loaded[1][0]
    assert result["exists"].startswith("FileExistsError") and "overwrite=True" in result["exists"]
    assert "could not write" in result["dies"]
    assert result["after_death"] == []  # the old checkpoint still loads, bit-equal
    assert result["overwritten"] == []  # and then the new one
    assert result["files"] == ["metadata.json", "rank00000.g1.safetensors"]  # the dead save wrote none


def test_a_save_before_waiting_on_the_async_one_is_refused(loaded):
    result = loaded[1][0]
    assert result["unwaited"].startswith("RuntimeError") and "handle.wait()" in result["unwaited"]
    assert result["after_wait"] is None


def test_beside_torch_distributed_checkpoint(tmp_path):
    """The benchmark's launch (2 ranks, gloo): the same decoder saved by ours and by DCP, each
    loaded into zeros by its own side, replicated and sharded (ours ZeRO-3, DCP FSDP2's DTensors,
    loaded into the full model); the worker raises unless what each side loaded is torch.equal
    to what the other loaded and to the saved tensors. Both write one copy of the replicated state."""
    cfg = checkpoint_bench.CheckpointBench(hidden=32, layers=1, vocab=64, repeats=1, steps=1)
    result = checkpoint_bench.run(cfg, str(tmp_path))["result"]
    params = sum(p.numel() for p in checkpoint_bench._model(cfg, seed=0).state_dict().values())
    one_copy = params * 4  # 2 ranks hold it: two copies would be 2 x this
    assert one_copy < result["ours bytes"] < one_copy + 16 * 1024  # + safetensors headers, metadata.json
    assert one_copy < result["dcp bytes"] < 2 * one_copy
    assert all(len(result[k]) == 1 for k in ("ours save", "dcp load", "no save", "async save"))
    assert result["tensors equal"] == len(checkpoint_bench._model(cfg, seed=0).state_dict())
    assert one_copy < result["ours sharded bytes"] < one_copy + 16 * 1024  # each rank its shard
    assert one_copy < result["dcp sharded bytes"]  # (its metadata is larger than this tiny model)

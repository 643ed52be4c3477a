"""ZeRO stages 1, 2, 3 (minidist.parallel.zero) against one process, the formulas, the calculator and FSDP2.

Equality runs use float64 so that "equal to one process" can be tight (atol 1e-10 after 10 AdamW
steps; in float32 the same runs differ by ~2e-5, Adam's division amplifying summation-order
rounding of near-zero gradients).
"""

from __future__ import annotations

import pytest
import torch

import minidist as md
import zero_workers as w
from minidist import memory
from minidist.errors import LaunchTimeout, WorkerError
from minidist.models.decoder import DecoderLM
from minidist.parallel import zero

ATOL = 1e-10


def _assert_equal_states(got: dict, want: dict, atol: float = ATOL) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


def _check_run(outs: list[dict], cfg: dict) -> None:
    """Parameters vs one process, bytes sent vs the formula, bytes held vs the calculator."""
    world, stage, dtype_bytes = cfg["world_size"], cfg["stage"], 8
    want = w.reference(cfg)
    for rank, out in enumerate(outs):
        _assert_equal_states(out["state"], want)
        # Traffic: exactly the ring formula on the padded count (padding is sent as zeros).
        assert out["bytes_sent"] == zero.traffic_formula(stage, out["padded_numel"], world, dtype_bytes), rank
        # Memory held after the step vs the calculator (fp64: 8 bytes weights and grads, 16 Adam).
        est = memory.estimate(
            w.model_config(cfg), batch=cfg["batch"], seq=cfg["seq"], zero_stage=stage, dp=world,
            bytes_per_param=(8, 8, 16),
        )  # fmt: skip
        for kind in ("params", "grads", "optimizer"):
            assert out["held"][kind] == pytest.approx(est[kind], rel=0.05), (rank, kind, out["held"], est)
    if stage == 3:  # current unit + the prefetched one, never more
        assert all(out["peak_gathered_units"] == 2 for out in outs)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_equals_one_process_traffic_and_memory(stage):
    cfg = w.config(stage=stage, dtype="float64")
    outs = md.launch(w.train_zero, 2, args=(cfg,), transport="pipe", timeout=90)
    _check_run(outs, cfg)


def test_stage3_without_prefetch_holds_one_unit_at_a_time():
    cfg = w.config(stage=3, steps=3, prefetch=False, dtype="float64")
    outs = md.launch(w.train_zero, 2, args=(cfg,), transport="pipe", timeout=90)
    want = w.reference(cfg)
    for out in outs:
        assert out["peak_gathered_units"] == 1
        _assert_equal_states(out["state"], want)


def test_stage3_four_ranks_with_padding():
    """hidden 30 on 4 ranks: the norms' 30 elements do not divide by 4, so units are padded."""
    cfg = w.config(stage=3, world_size=4, hidden=30, steps=4, batch=1, dtype="float64")
    outs = md.launch(w.train_zero, 4, args=(cfg,), transport="pipe", timeout=120)
    out = outs[0]
    assert out["padded_numel"] > out["numel"]
    # The counter sees the padded count; the paper's psi is short by exactly the padding.
    formula_psi = zero.traffic_formula(3, out["numel"], 4, 8)
    assert out["bytes_sent"] - formula_psi == pytest.approx(
        3 * (out["padded_numel"] - out["numel"]) * 3 / 4 * 8
    )
    _check_run(outs, cfg)


def test_stage1_four_ranks():
    cfg = w.config(stage=1, world_size=4, steps=4, batch=1, dtype="float64")
    _check_run(md.launch(w.train_zero, 4, args=(cfg,), transport="pipe", timeout=120), cfg)


def test_fsdp2_equals_ours_and_one_process():
    """torch's fully_shard on gloo, in the same launch as ours: both equal one process."""
    cfg = w.config(steps=4, dtype="float64")
    outs = md.launch(w.compare_with_fsdp2, 2, args=(cfg,), transport="torch", timeout=120)
    want = w.reference(cfg)
    for out in outs:
        _assert_equal_states(out["fsdp2"], want)
        _assert_equal_states(out["ours"], out["fsdp2"])
        assert out["ours_step_s"] > 0 and out["fsdp2_step_s"] > 0


def test_traffic_formula_tends_to_the_papers_2_2_3_psi():
    psi = 1_000_000
    for stage, factor in ((1, 2), (2, 2), (3, 3)):
        assert zero.traffic_formula(stage, psi, 2, 4) == factor * psi * 4 / 2
        assert zero.traffic_formula(stage, psi, 10**6, 4) == pytest.approx(factor * psi * 4, rel=1e-5)


def test_default_units_of_decoder_are_embeddings_blocks_final_norm():
    model = DecoderLM(w.model_config(w.config(layers=3)))
    units = zero.default_units(model)
    t = model.transformer
    assert units == [t.embeddings, *t.blocks, t.final_norm]


@pytest.mark.parametrize("stage", [0, 4, "1", True])
def test_wrong_stage_is_refused(stage):
    with pytest.raises(ValueError, match="stage must be one of"):
        zero.ZeroOptimizer([torch.nn.Parameter(torch.zeros(2))], comm=None, stage=stage)
    with pytest.raises(ValueError, match="stage must be one of"):
        zero.traffic_formula(stage, 10, 2)


@pytest.mark.parametrize("stage", [2, 3])
def test_different_shapes_across_ranks_are_refused(stage):
    cfg = w.config(stage=stage)
    with pytest.raises(WorkerError, match="every rank must build the same model"):
        md.launch(w.mismatched_shapes, 2, args=(cfg,), transport="pipe", timeout=60)


def test_a_crashed_rank_ends_the_launch():
    with pytest.raises((WorkerError, LaunchTimeout), match="rank 1"):
        md.launch(w.crash_in_step, 2, args=(w.config(stage=3),), transport="pipe", timeout=30)


def test_stage3_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = w.config(stage=3, steps=3, dtype="float64", device="cuda")
    outs = md.launch(w.train_zero, 2, args=(cfg,), transport="pipe", timeout=120, device="cuda")
    for out in outs:
        _assert_equal_states(out["state"], w.reference(cfg), atol=1e-8)

"""``python -m minidist.bench diloco`` at tiny settings: its structure and its bytes, not its losses.

One launch (2 ranks, 4 steps of 1 x 8 tokens, DDP, DiLoCo H = 2 in fp32 and int8, a 10 Gbit/s link); the
full run and its table are in docs/benchmarks.md.
"""

from __future__ import annotations

import json

import pytest

from minidist.bench import diloco
from minidist.collectives import cost_model

pytestmark = pytest.mark.timeout(120)


def test_diloco_bench_counts_the_formula_bytes_and_times_syncs(tmp_path, capsys):
    cfg = diloco.DilocoBench(steps=4, hs=(2,), quantized=("int8",), quantized_h=2, eval_every=2,
                             eval_blocks=2, seq=8, batch=1, links_gbit=(10.0,), repeats=1)  # fmt: skip
    result = diloco.run(cfg, out=str(tmp_path))
    p, n = result["workers"], result["numel"]
    ddp, h2, int8 = result["rows"]
    assert [r["label"] for r in result["rows"]] == ["DDP", "DiLoCo H=2", "DiLoCo H=2 int8"]
    assert [r["syncs"] for r in result["rows"]] == [4, 2, 2]
    for row in (ddp, h2):  # counted bytes = one ring allreduce of the model per sync, per rank
        assert row["bytes_sent"] == [
            row["syncs"] * cost_model.bytes_sent("ring", p, r, n, 4) for r in range(p)
        ]
    blocks = -(-n // 64)  # int8: codes and one fp32 scale per 64 values, allgathered: (p-1) x payload
    assert int8["bytes_sent"] == [2 * (p - 1) * (64 * blocks + 4 * blocks)] * p
    for row in result["rows"]:
        assert [step for step, _ in row["curve"]] == [0, 2, 4]
        reached, every = row["steps_to_target"], row["h"]
        sync_s = result["sync_s"][row["quantize"] or "fp32"][10.0]
        assert row["time_s_10G"] == pytest.approx(reached * result["compute_s"] + (reached // every) * sync_s)
    assert h2["bytes_per_token"] * 2 == pytest.approx(ddp["bytes_per_token"])  # 1/H
    assert result["target"] == max(r["final_loss"] for r in result["rows"])  # the worst final loss
    assert result["compute_s"] == pytest.approx(6 * n * 8 / (125e12 * 0.4))
    saved = json.loads((tmp_path / "diloco.json").read_text())
    assert saved["rows"][1]["bytes_sent"] == h2["bytes_sent"]
    assert "DDP / this 10G" in capsys.readouterr().out

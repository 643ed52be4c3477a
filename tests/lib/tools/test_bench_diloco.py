"""``python -m minidist.bench diloco`` at tiny settings: its structure and its arithmetic, not its losses.

One launch (2 ranks, 4 steps of 1 x 8 tokens: DDP, DiLoCo H = 2 in fp32 and int8, Streaming H = 4, F = 2,
tau = 1; a 10 Gbit/s link); the full run and its table are in docs/benchmarks.md. The bytes are
checked against the formulas in tests/lib/parallel/test_local_sgd.py; here only the bench's own
bookkeeping (its counts equal its formulas, the targets, the times from ``local_sgd.time_to_target``).
"""

from __future__ import annotations

import json

import pytest

from minidist.bench import diloco
from minidist.parallel import local_sgd

pytestmark = pytest.mark.timeout(120)


def test_diloco_bench_rows_targets_and_times(tmp_path, capsys):
    cfg = diloco.DilocoBench(steps=4, hs=(2,), quantized=("int8",), quantized_h=2, streaming=(4, 2, 1, 0.5),
                             eval_every=2, eval_blocks=2, seq=8, batch=1, links_gbit=(10.0,), repeats=1,
                             check_tokens=8)  # fmt: skip
    result = diloco.run(cfg, out=str(tmp_path))
    rows = result["rows"]
    assert [r["label"] for r in rows] == [
        "DDP",
        "DiLoCo H=2",
        "DiLoCo H=2 int8",
        "Streaming H=4 F=2 tau=1 mix 0.5",
    ]
    assert [r["syncs"] for r in rows] == [4, 2, 2, 2]  # streaming: fragment 0 after step 2, 1 after 4
    for row in rows:
        assert row["bytes_sent"] == row["formula_bytes"] and row["peak_bytes"] == row["peak_formula"]
        assert [step for step, _ in row["curve"]] == [0, 2, 4]
    ddp, streaming = rows[0], rows[-1]
    assert streaming["peak_bytes"][0] < ddp["peak_bytes"][0] == rows[1]["peak_bytes"][0]  # a fragment
    worst, half = result["targets"].values()
    assert worst == max(r["final_loss"] for r in rows)
    assert half == ddp["curve"][1][1]  # DDP's loss at step 2 of 4
    for row in rows:
        sync_s = result["sync_s"][row["quantize"] or "fp32"][10.0]
        want = local_sgd.time_to_target(
            row["curve"], worst, result["compute_s"], sync_s, row["h"] or 1, row["fragments"], row["delay"]
        )
        assert row["time worst final 10G"] == want is not None
    assert result["compute_s"] == pytest.approx(6 * result["numel"] * 8 / (125e12 * 0.4))
    assert [c["steps"] for c in result["check"]] == [8, 9]  # 2H and 2H + tau
    saved = json.loads((tmp_path / "diloco.json").read_text())
    assert saved["rows"][1]["bytes_sent"] == rows[1]["bytes_sent"]
    text = capsys.readouterr().out
    assert "DDP / this 10G" in text and "the overlap model, checked" in text

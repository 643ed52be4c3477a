"""``python -m minidist.bench elastic`` at tiny settings: the counted steps and the time formula.

3 ranks, 12 steps, kills at steps 3 and 8, a checkpoint every 5 steps: checkpoint-restart redoes
(3 - 0) + (8 - 5) = 6 steps; live recovery redoes none and runs exactly the two failing steps
below N when the quorum waits for the replacement.
"""

from __future__ import annotations

import pytest

from minidist.bench import elastic as bench

pytestmark = pytest.mark.timeout(120)


def test_elastic_bench_counts_steps_redone_and_prints_the_ratio(capsys):
    cfg = bench.ElasticBench(world_size=3, steps=12, kill_steps=(3, 8), checkpoint_every=5)
    result = bench.main(cfg)
    live, no_wait, ckpt = result["live"], result["no_wait"], result["checkpoint"]
    assert live["steps executed"] == no_wait["steps executed"] == 12
    assert live["steps below N"] == 2 and live["recovery rounds"] == 2
    assert ckpt["steps redone"] == (3 - 0) + (8 - 5) and ckpt["steps executed"] == 12 + 6
    assert ckpt["launches"] == 3
    state = 12 * cfg.params
    link, storage = cfg.link_gbps * bench.GBIT, cfg.storage_gbps * bench.GBIT
    want_ckpt = cfg.restart_s + state / storage + 3 * cfg.step_s + (12 // 5) * state / storage / 2
    assert result["seconds"] == pytest.approx(
        (cfg.restart_s + state / link, state / link + cfg.restart_s / 3, want_ckpt)
    )
    assert f"{want_ckpt / (cfg.restart_s + state / link):.2f}x" in capsys.readouterr().out

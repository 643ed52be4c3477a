"""The benchmarks run end to end (small sizes) and report ours next to the baseline.

No timing is asserted (shared machines are noisy): only that every number is
measured, positive, and that the ratios printed are the ratios of those numbers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(*args: str, out) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "minidist.bench", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.slow
def test_p2p_benchmark_reports_every_transport_against_gloo(tmp_path):
    out = run_bench("p2p", "--max-size", "64KiB", "--repeats", "1", "--scale", "0.02", out=tmp_path)
    for column in ["pipe us", "shm GB/s", "torch us", "gloo us", "x gloo"]:
        assert column in out
    for size in ["1 KiB", "4 KiB", "16 KiB", "64 KiB"]:
        assert any(line.strip().startswith(size) for line in out.splitlines()), size
    data = json.loads((tmp_path / "p2p.json").read_text())
    assert set(data["seconds"]) == {"pipe", "shm", "torch", "gloo"}
    for per_size in data["seconds"].values():
        assert all(0 < t < 10 for t in per_size.values())
    gloo, shm = data["seconds"]["gloo"], data["seconds"]["shm"]
    assert math.isclose(data["goals"]["shm_latency_ratio_1KiB"], gloo["1024"] / shm["1024"])
    assert (tmp_path / "p2p.png").stat().st_size > 10_000


@pytest.mark.slow
def test_launch_benchmark_reports_ours_against_torch_spawn(tmp_path):
    out = run_bench("launch", "--world-sizes", "2", "--repeats", "1", out=tmp_path)
    assert "torch.mp.spawn ms" in out and "x torch" in out
    data = json.loads((tmp_path / "launch.json").read_text())
    assert set(data["2"]) == {"ours_warm", "ours_cold", "ours_spawn", "torch_spawn"}
    assert all(v > 0 for v in data["2"].values())
    assert (tmp_path / "launch.png").exists()


@pytest.mark.slow
def test_collectives_benchmark_reports_every_algorithm_against_gloo(tmp_path):
    out = run_bench(
        "collectives",
        "--world-size",
        "2",
        "--max-size",
        "16KiB",
        "--repeats",
        "1",
        "--scale",
        "0.01",
        out=tmp_path,
    )
    assert "busbw GB/s" in out and "x gloo" in out
    data = json.loads((tmp_path / "collectives_p2.json").read_text())
    expected = {"gloo"} | {f"{a}/shm" for a in ["shm", "ring", "butterfly", "tree", "star"]}
    expected |= {f"{a}/{t}" for a in ["ring", "butterfly", "tree", "star"] for t in ["pipe", "torch"]}
    assert set(data["seconds"]) == expected
    for per_size in data["seconds"].values():
        assert set(per_size) == {"1024", "4096", "16384"}
        assert all(0 < t < 10 for t in per_size.values())
    assert (tmp_path / "collectives_p2.png").exists()
    for transport in ["shm", "pipe", "torch"]:
        report = data["crossovers"][transport]
        assert len(report["measured_best"]) == len(report["predicted_best"]) == 3
        assert report["alpha_us"] > 0 and report["beta_GBps"] > 0


@pytest.mark.slow
def test_glove_benchmark_reports_every_trainer_against_single(tmp_path):
    out = run_bench("glove", "--corpus", "small", "--epochs", "1", "--workers", "2", out=tmp_path)
    assert "x single" in out and "WS353" in out and "goals:" in out and "paired runs" in out
    data = json.loads((tmp_path / "glove.json").read_text())
    trainers = {"data-sparse", "data-dense", "model", "ps-sync", "ps-async", "ps-async-stale", "hogwild"}
    assert set(data) == {"single/1"} | {f"{t}/2" for t in trainers}
    single = data["single/1"]
    for key, row in data.items():
        assert row["pairs_per_second"] > 0 and len(row["history"]) == 1, key
        # every trainer saw the same pairs once: the epoch losses agree to within a few percent
        assert row["final_loss"] == pytest.approx(single["final_loss"], rel=0.1), key
    assert data["data-sparse/2"]["comm_bytes"] < data["data-dense/2"]["comm_bytes"]
    assert data["model/2"]["comm_bytes"] < data["data-sparse/2"]["comm_bytes"]
    assert (tmp_path / "glove.png").stat().st_size > 10_000

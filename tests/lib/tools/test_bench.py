"""The benchmarks run end to end (small sizes) and report ours next to the baseline.

No timing is asserted (shared machines are noisy): only that every number is
measured, positive, and that the ratios printed are the ratios of those numbers.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse

ROOT = str(Path(__file__).resolve().parents[3])


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


def test_launch_benchmark_reports_ours_against_torch_spawn(tmp_path):
    out = run_bench("launch", "--world-sizes", "2", "--repeats", "1", out=tmp_path)
    assert "torch.mp.spawn ms" in out and "x torch" in out
    data = json.loads((tmp_path / "launch.json").read_text())
    assert set(data["2"]) == {"ours_warm", "ours_cold", "ours_spawn", "torch_spawn"}
    assert all(v > 0 for v in data["2"].values())
    assert (tmp_path / "launch.png").exists()


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
    assert "busbw GB/s" in out and "x gloo" in out and "% ceiling" in out and "memory-copy ceiling" in out
    data = json.loads((tmp_path / "collectives_p2.json").read_text())
    assert set(data["memcpy_seconds"]) == {"1024", "4096", "16384"}
    assert all(0 < t < 10 for t in data["memcpy_seconds"].values())
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
    # all_to_all: every form on every transport beside gloo's all_to_all_single, equal and uneven
    a2a = data["all_to_all"]
    forms = {f"{f}/{t}" for f in ["equal", "split", "counts"] for t in ["shm", "pipe", "torch"]}
    assert set(a2a) == forms | {"gloo equal", "gloo split"}
    for per_size in a2a.values():
        assert set(per_size) == {"1024", "4096", "16384"} and all(0 < t < 10 for t in per_size.values())
    assert "all_to_all of float32" in out and "all_to_all_single" in out


def test_glove_benchmark_reports_every_trainer_against_single(tmp_path):
    out = run_bench("glove", "--corpus", "small", "--epochs", "1", "--workers", "2", out=tmp_path)
    assert "x single" in out and "x base" in out and "WS353" in out and "goals:" in out
    assert "paired runs" in out
    data = json.loads((tmp_path / "glove.json").read_text())
    trainers = {"data-sparse", "data-dense", "model", "ps-sync", "ps-async", "ps-async-stale", "hogwild"}
    paired = data.pop("paired")
    assert set(data) == {"single/1", "glove-python/2"} | {f"{t}/2" for t in trainers}
    single = data["single/1"]
    for key, row in data.items():
        assert row["pairs_per_second"] > 0 and len(row["history"]) == 1, key
        # every trainer saw the same pairs once: the final models' losses agree within a few percent
        assert row["end_loss"] == pytest.approx(single["end_loss"], rel=0.1), key
        if row["trainer"] != "glove-python":  # the loss as visited (glove-python reports none)
            assert row["final_loss"] == pytest.approx(single["final_loss"], rel=0.1), key
    assert data["data-sparse/2"]["comm_bytes"] < data["data-dense/2"]["comm_bytes"]
    assert data["model/2"]["comm_bytes"] < data["data-sparse/2"]["comm_bytes"]
    # paired one-epoch runs: 3 rounds of each ratio, all measured
    assert set(paired) == {"hogwild/2 / single/1", "hogwild/2 / glove-python/2"}
    assert all(len(ratios) == 3 and all(r > 0 for r in ratios) for ratios in paired.values())
    assert (tmp_path / "glove.png").stat().st_size > 10_000


# --- the GloVe benchmark's baseline: glove-python's trainer on our pairs ---------------------


@pytest.fixture(scope="module")
def small_glove():
    from minidist import glove

    return glove.load("small")


def glove_loss(word_vectors, word_biases, rows, cols, counts, x_max=10.0) -> float:
    """Mean f(X) (w_i . w_j + b_i + b_j - log X)^2 / 2 over the pairs, in float64 numpy (the paper's
    formula with word and context vectors tied, as glove-python trains them)."""
    diff = (word_vectors[rows] * word_vectors[cols]).sum(1) + word_biases[rows] + word_biases[cols]
    diff -= np.log(counts)
    weight = np.minimum(counts / x_max, 1.0) ** 0.75
    return float((weight * diff**2).mean() / 2)


def test_glove_python_baseline_is_glove_fit_on_exactly_our_pairs(small_glove):
    from glove import Glove

    from minidist.bench.glove_baseline import BASELINE_LR, cooccurrence_matrix, train_glove_python
    from minidist.glove import GloveConfig

    cooc, vocab_size = small_glove.cooc, len(small_glove.vocab)
    # the matrix holds the counted pairs (word ids, counts), every one and only those
    matrix = cooccurrence_matrix(small_glove.pairs)
    assert matrix.shape == (vocab_size, vocab_size) and matrix.nnz == len(cooc)
    np.testing.assert_allclose(matrix.tocsr()[cooc.rows.copy(), cooc.cols.copy()].A1, cooc.counts, rtol=1e-6)

    # the bench's epoch-by-epoch driver is Glove.fit (one thread: deterministic), bit for bit
    pairs = small_glove.pairs.shuffled(1).subset(slice(0, 20_000))
    config = GloveConfig(epochs=2, seed=5)
    ours = train_glove_python(pairs, config, threads=1)
    reference = Glove(
        no_components=50,
        learning_rate=BASELINE_LR,
        alpha=0.75,
        max_count=10.0,
        max_loss=100.0,
        random_state=5,
    )
    reference.fit(cooccurrence_matrix(pairs), epochs=2, no_threads=1)
    np.testing.assert_array_equal(ours.extra["word_vectors"], reference.word_vectors)
    np.testing.assert_array_equal(ours.extra["word_biases"], reference.word_biases)
    # its reported loss is the loss of those vectors and biases on those pairs
    rows, cols = pairs.rows.numpy().copy(), pairs.cols.numpy() - vocab_size
    counts = scipy.sparse.csr_matrix((cooc.counts, (cooc.rows, cooc.cols)))[rows, cols].A1
    expected = glove_loss(reference.word_vectors, reference.word_biases, rows, cols, counts)
    assert ours.history[-1][1] == pytest.approx(expected, rel=1e-4)
    assert ours.pairs_trained == 2 * len(pairs) and ours.workers == 1


def test_glove_python_baseline_learns_through_the_benchmark(small_glove, tmp_path):
    """The bench's code path, 2 threads: the loss falls every epoch, far below the loss of its
    initialisation, and WordSim353 beats every one of 20 random sets of vectors."""
    from minidist.bench import glove as bench
    from minidist.glove import similarity_score

    results = bench.run("small", epochs=5, workers=(2,), trainers=("glove-python",), out=tmp_path, plot=False)
    row = results["glove-python/2"]
    losses = [loss for _seconds, loss in row["history"]]
    assert len(losses) == 5 and all(b < a for a, b in zip(losses, losses[1:]))
    vocab_size, dim = len(small_glove.vocab), 50
    initial = np.random.default_rng(0).random((vocab_size, dim)) - 0.5
    cooc = small_glove.cooc
    untrained = glove_loss(initial / dim, np.zeros(vocab_size), cooc.rows, cooc.cols, cooc.counts)
    assert row["end_loss"] < untrained / 2
    random_scores = [
        similarity_score(np.random.default_rng(seed).standard_normal((vocab_size, dim)), small_glove.vocab)[0]
        for seed in range(20)
    ]
    assert row["wordsim353"] > max(random_scores)
    assert row["pairs_per_second"] > 0


def test_model_parallel_benchmark_reports_every_row_and_bytes_equal_the_formulas(tmp_path):
    """Tiny decoder, 2 ranks: every row is printed, the bytes each rank sent equal the formulas
    (written out again here), and every row trained the same thing (same last-step loss)."""
    vocab, d, layers, seq, batch, m, steps = 64, 32, 2, 8, 2, 2, 2
    out = run_bench(
        "model_parallel",
        *("--vocab", str(vocab), "--hidden", str(d), "--layers", str(layers), "--heads", "2"),
        *("--seq", str(seq), "--batch", str(batch), "--microbatches", str(m), "--steps", str(steps)),
        *("--bubble-microbatches", "2", "--t-forward", "0.005", "--t-backward", "0.01"),
        out=tmp_path,
    )
    names = ["DP (our DDP)", "TP-2", "PP GPipe", "PP 1F1B", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    names += ["ZeRO-3 (gloo)", "FSDP2 (torch, gloo)"]
    for name in names:
        assert any(line.strip().startswith(name) for line in out.splitlines()), name
    assert "x DP" in out and "sent/formula" in out and "held/calc" in out and "ours ZeRO-3 / FSDP2" in out
    data = json.loads((tmp_path / "model_parallel.json").read_text())
    rows = data["rows"]
    assert list(rows) == names
    from minidist.models.zero_training import config, make_model

    numel = sum(
        p.numel() for p in make_model(config(vocab=vocab, hidden=d, layers=layers, seq=seq)).parameters()
    )
    B = 2 * batch  # global batch
    bsd, tokens = B * seq * d, B * (seq - 1)
    want = {  # 2 ranks: an allreduce of n bytes sends n per rank; ring reduce-scatter/allgather n/2
        "DP (our DDP)": numel * 4,
        "TP-2": ((1 + 4 * layers + 1) * bsd + 3 * tokens) * 4,
        "PP GPipe": m * (B // m * seq * d * 4 + 64) + vocab * d * 4,
        "PP 1F1B": m * (B // m * seq * d * 4 + 64) + vocab * d * 4,
    }
    for stage, factor in ((1, 2), (2, 2), (3, 3)):
        padded = numel + numel % 2
        want[f"ZeRO-{stage}"] = factor * padded / 2 * 4
    want["ZeRO-3 (gloo)"] = want["ZeRO-3"]
    for name, expected in want.items():
        assert rows[name]["formula"] == expected, name
        assert rows[name]["bytes_sent"] == [expected, expected], name
    counts = rows["TP-2"]["collectives"]
    assert (
        counts["forward"]["allreduce"] == 2 * layers + 3 and counts["backward"]["allreduce"] == 2 * layers + 1
    )
    assert rows["PP GPipe"]["peak_in_flight"] == [m, m] and rows["PP 1F1B"]["peak_in_flight"] == [2, 1]
    losses = [row["loss"] for row in rows.values()]
    assert all(loss == pytest.approx(losses[0], rel=1e-4) for loss in losses)
    for row in rows.values():
        assert row["step_s"] > 0
    (bubble,) = [b for b in data["bubble"] if b["schedule"] == "1F1B"]
    assert bubble["formula"] == pytest.approx(1 / (2 + 1)) and 0 < bubble["measured"] < 1


def test_all_to_all_benchmark_reconciles_the_emulated_link_with_the_cost_model(capsys):
    """The rows beside gloo are checked with the collectives benchmark above; here the
    emulated-link table: the slowest rank's time beside (p-1)(alpha + beta S/p)."""
    import minidist as md
    from minidist.bench import all_to_all
    from minidist.collectives import cost_model
    from minidist.transport.emulated import ETHERNET_10G

    outs = md.launch(all_to_all.emulated_worker, 3, args=([3072], 1), transport="shm", timeout=60)
    emulated = all_to_all.reconcile(outs, 3)
    model = cost_model.AlphaBeta(alpha=ETHERNET_10G.alpha_s, beta=1 / ETHERNET_10G.bandwidth_Bps)
    assert emulated[3072]["measured_s"] == max(o[3072] for o in outs) > 0
    assert emulated[3072]["predicted_s"] == pytest.approx(2 * (15e-6 + 1024 / 1.25e9))
    assert emulated[3072]["predicted_s"] == cost_model.predict("all_to_all", 3, 3072, model)
    assert "measured / predicted" in capsys.readouterr().out

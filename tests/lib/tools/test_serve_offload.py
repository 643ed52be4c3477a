"""Streamed inference (minidist.serve.offload): equal to the in-memory DecoderLM, blocks released,
RSS within the budget.

References: ``DecoderLM.forward`` and ``generate.generate`` on the whole model in memory (the
same weights, read with ``shards.load_decoder``); the parameter-count formula for the budget;
the process's peak resident memory (VmHWM) measured in child processes, against a control that
keeps every block (and one that loads the whole model).
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from minidist.models import generate as gen
from minidist.models import shards
from minidist.models.decoder import DecoderLM
from minidist.models.transformer import TransformerConfig
from minidist.serve import offload
from minidist.serve.offload import BlockLoadError, StreamedDecoder, demonstration
from minidist.serve.offload.budget import _dtype_bytes
from minidist.serve.offload.loader import _Loader


def tiny_config(position: str = "learned", n_layers: int = 4) -> TransformerConfig:
    return TransformerConfig(
        vocab_size=97,
        hidden_size=32,
        n_layers=n_layers,
        n_heads=4,
        max_positions=32,
        causal=True,
        pre_ln=True,
        position=position,
        embedding_layernorm=position == "alibi",
        layer_norm_eps=1e-5,
    )


def save(tmp_path, cfg: TransformerConfig, blocks_per_shard: int = 1, seed: int = 0):
    torch.manual_seed(seed)
    model = DecoderLM(cfg).eval()
    directory = tmp_path / f"ck-{cfg.position}-{blocks_per_shard}"
    shards.save_sharded(model, directory, blocks_per_shard=blocks_per_shard)
    return model, directory


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "minidist-block-loader"]


@pytest.fixture
def checkpoint(tmp_path):
    return save(tmp_path, tiny_config())


# --- equality with the in-memory model ------------------------------------------------------
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("position, blocks_per_shard", [("learned", 1), ("learned", 3), ("alibi", 2)])
def test_forward_equals_the_in_memory_model(tmp_path, prefetch, position, blocks_per_shard):
    model, directory = save(tmp_path, tiny_config(position, n_layers=5), blocks_per_shard)
    ids = torch.randint(97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
    with StreamedDecoder(directory, prefetch=prefetch) as streamed:
        logits = streamed(ids)
        assert torch.equal(logits, expected)  # the same operations in the same order
        assert streamed.blocks_read == 5


@pytest.mark.parametrize("prefetch", [True, False])
def test_generate_equals_generate_with_and_without_cache(checkpoint, prefetch):
    model, directory = checkpoint
    prompt = torch.randint(97, (3, 5), generator=torch.Generator().manual_seed(2))
    expected = gen.generate(model, prompt, 9, use_cache=False)
    assert torch.equal(expected, gen.generate(model, prompt, 9, use_cache=True))
    with StreamedDecoder(directory, prefetch=prefetch) as streamed:
        out = streamed.generate(prompt, 9)
        assert torch.equal(out, expected)
        assert streamed.blocks_read == 9 * 4  # one pass for the prompt, one per later token
        assert torch.equal(streamed.generate(prompt, 0), prompt)


def test_prefetch_on_and_off_agree_and_dtype_converts(checkpoint):
    model, directory = checkpoint
    ids = torch.randint(97, (1, 16), generator=torch.Generator().manual_seed(3))
    with StreamedDecoder(directory, prefetch=True) as a, StreamedDecoder(directory, prefetch=False) as b:
        assert torch.equal(a(ids), b(ids))
    with StreamedDecoder(directory, dtype=torch.float64) as wide:
        with torch.no_grad():
            expected = model.double()(ids).logits
        out = wide(ids)
        assert out.dtype == torch.float64 and torch.equal(out, expected)


# --- release: at most two blocks, none after a pass ------------------------------------------
def test_at_most_two_blocks_exist_and_none_after_a_pass(checkpoint, monkeypatch):
    _, directory = checkpoint
    ids = torch.randint(97, (1, 8))
    with StreamedDecoder(directory, prefetch=True) as streamed:
        streamed.generate(ids, 3)
        # the one computing and the one being read; whether the read finishes before the compute
        # (2) or after (1) depends on thread timing
        assert 1 <= streamed.max_live_blocks <= 2
        assert streamed.live_blocks() == 0
    with StreamedDecoder(directory, prefetch=False) as streamed:
        streamed(ids)
        assert streamed.max_live_blocks == 1
        assert streamed.live_blocks() == 0
    # exactly two: a loader whose block i's compute waits until block i + 1 has been read
    real = shards.load_block

    def gated(directory, i, *args, **kwargs):  # block i's compute waits until block i + 1 is read
        block = real(directory, i, *args, **kwargs)

        def wait_for_next(module, inputs):
            deadline = time.monotonic() + 30
            while streamed.live_blocks() < 2 and time.monotonic() < deadline:
                time.sleep(0.005)

        if i + 1 < 4:
            block.register_forward_pre_hook(wait_for_next)
        return block

    monkeypatch.setattr(shards, "load_block", gated)
    with StreamedDecoder(directory, prefetch=True) as streamed:
        streamed(ids)
        assert streamed.max_live_blocks == 2 and streamed.live_blocks() == 0  # exactly two, never three


def test_budget_matches_the_parameter_formula(checkpoint):
    _, directory = checkpoint
    cfg = tiny_config()
    d, v, p = cfg.hidden_size, cfg.vocab_size, cfg.max_positions
    block = 4 * (12 * d * d + 13 * d)  # fp32
    resident = 4 * (v * d + p * d + 2 * d)  # word table (tied head), positions, final norm
    assert offload.block_bytes(directory) == [block] * cfg.n_layers
    assert offload.resident_bytes(directory) == resident
    assert offload.budget_bytes(directory) == resident + 2 * block
    assert offload.checkpoint_bytes(directory) > resident + cfg.n_layers * block  # plus headers, index


# --- errors: clear messages, never a hang, no thread left ------------------------------------
def test_missing_shard_is_refused_at_construction(checkpoint):
    _, directory = checkpoint
    (directory / shards.shard_name(3, 6)).unlink()
    with pytest.raises(FileNotFoundError, match="model-00003-of-00006"):
        StreamedDecoder(directory)
    assert not loader_threads()


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_shard_lost_during_a_run_names_the_block(checkpoint, prefetch):
    _, directory = checkpoint
    with StreamedDecoder(directory, prefetch=prefetch) as streamed:
        (directory / shards.shard_name(4, 6)).unlink()  # block 2's shard (shard 1 is the embeddings)
        with pytest.raises(BlockLoadError, match="block 2") as info:
            streamed(torch.randint(97, (1, 4)))
        assert info.value.index == 2
        assert streamed.live_blocks() == 0
    assert not loader_threads()


def test_an_error_in_the_loader_thread_reaches_the_caller_and_the_model_recovers(checkpoint, monkeypatch):
    model, directory = checkpoint
    real = shards.load_block

    def failing(directory, i, *args, **kwargs):
        if i == 1:
            raise OSError("disk on fire")
        return real(directory, i, *args, **kwargs)

    ids = torch.randint(97, (1, 6))
    with StreamedDecoder(directory, prefetch=True) as streamed:
        monkeypatch.setattr(shards, "load_block", failing)
        with pytest.raises(BlockLoadError, match="block 1.*disk on fire") as info:
            streamed(ids)
        assert isinstance(info.value.__cause__, OSError)
        monkeypatch.setattr(shards, "load_block", real)
        with torch.no_grad():
            assert torch.equal(streamed(ids), model(ids).logits)  # the thread kept serving
        assert streamed.live_blocks() == 0


def test_an_error_in_the_compute_leaves_no_block_behind(checkpoint):
    model, directory = checkpoint
    ids = torch.randint(97, (1, 6))
    with StreamedDecoder(directory, prefetch=True) as streamed:
        cache = gen.KVCache(4)
        cache[0] = (torch.zeros(5, 4, 3, 8), torch.zeros(5, 4, 3, 8))  # another batch's cache
        with pytest.raises(ValueError, match="another batch"):
            streamed.step(torch.zeros(1, 1, dtype=torch.long), cache, past_len=3)
        assert streamed.live_blocks() == 0  # block 1, already prefetched, was collected and dropped
        with torch.no_grad():
            assert torch.equal(streamed(ids), model(ids).logits)


def test_a_read_slower_than_the_timeout_raises_and_its_late_block_is_dropped(checkpoint, monkeypatch):
    model, directory = checkpoint
    real, gate = shards.load_block, threading.Event()

    def slow(directory, i, *args, **kwargs):
        if i == 2 and not gate.is_set():
            gate.wait(30)
        return real(directory, i, *args, **kwargs)

    real_result = _Loader.result

    def result(self, i):  # a short deadline for the gated block only; every other read gets 120 s
        self._timeout = 2.0 if i == 2 and not gate.is_set() else 120.0
        return real_result(self, i)

    ids = torch.randint(97, (1, 6))
    with StreamedDecoder(directory, prefetch=True, load_timeout=120.0) as streamed:
        monkeypatch.setattr(shards, "load_block", slow)
        monkeypatch.setattr(_Loader, "result", result)
        with pytest.raises(TimeoutError, match="block 2"):
            streamed(ids)
        gate.set()  # the late block 2 arrives now; the next pass must not take it for block 0
        with torch.no_grad():
            assert torch.equal(streamed(ids), model(ids).logits)


def test_close_stops_the_thread_and_bad_input_is_refused(checkpoint):
    _, directory = checkpoint
    before = len(loader_threads())
    streamed = StreamedDecoder(directory, prefetch=True)
    assert len(loader_threads()) == before + 1 and loader_threads()[-1].daemon
    with pytest.raises(ValueError, match="batch, seq_len"):
        streamed(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="32"):
        streamed.generate(torch.zeros(1, 30, dtype=torch.long), 5)  # 35 positions > 32
    streamed.close()
    streamed.close()  # idempotent
    assert len(loader_threads()) == before
    with pytest.raises(RuntimeError, match="closed"):
        streamed(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="no checkpoint index"):
        StreamedDecoder(directory / "nowhere")
    forgotten = StreamedDecoder(directory, prefetch=True)  # never closed: collected, thread stopped
    forgotten(torch.zeros(1, 3, dtype=torch.long))
    del forgotten
    gc.collect()
    deadline = time.monotonic() + 10
    while len(loader_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(loader_threads()) == before


def test_step_refuses_a_past_len_that_disagrees_with_the_cache(checkpoint):
    _, directory = checkpoint
    ids = torch.randint(97, (1, 4))
    with StreamedDecoder(directory, prefetch=False) as streamed:
        cache = gen.KVCache(4)
        with pytest.raises(ValueError, match="holds 0 positions but past_len is 3"):
            streamed.step(ids, cache, 3)
        streamed.step(ids, cache, 0)
        with pytest.raises(ValueError, match="holds 4 positions but past_len is 0"):
            streamed.step(ids[:, :1], cache, 0)  # would attend to the old positions as if new
        assert cache.length == 4  # the refused steps changed nothing
        streamed.step(ids[:, :1], cache, 4)
        assert cache.length == 5


def test_dtype_sizes_match_safetensors_and_unknown_dtypes_are_named(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    dtypes = [torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16, torch.int8]
    dtypes += [torch.uint8, torch.int16, torch.int32, torch.int64, torch.float32, torch.float64]
    tensors = {str(d): torch.zeros(3, dtype=d) for d in dtypes}
    save_file(tensors, tmp_path / "all.safetensors")
    with safe_open(str(tmp_path / "all.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            stored = f.get_slice(name).get_dtype()
            assert _dtype_bytes(stored, name) == tensors[name].element_size(), (name, stored)
    with pytest.raises(ValueError, match="'w' is stored as 'C64'"):
        _dtype_bytes("C64", "w")


def test_demo_deletes_only_the_checkpoint_it_wrote(tmp_path, monkeypatch):
    """With ``directory``, demo() writes ``directory/checkpoint`` and removes only that, also when
    writing fails; the user's other files stay. (The real writing and measuring are replaced.)"""
    written = []

    def write(target, cfg, seed=0, timeout=0):
        written.append(target)
        target.mkdir()
        (target / "model.safetensors").write_bytes(b"x")
        if fail:
            raise RuntimeError("disk full")

    def measure(target, **kwargs):
        assert (target / "model.safetensors").exists()
        return {"disk_bytes": 10, "budget_bytes": 5}

    monkeypatch.setattr(demonstration, "write_random_checkpoint", write)
    monkeypatch.setattr(demonstration, "measure_streaming", measure)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    fail = False
    result = offload.demo(tiny_config(), directory=mine)
    assert written == [mine / "checkpoint"] and result["directory"] is None and result["times_budget"] == 2
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    fail = True
    with pytest.raises(RuntimeError, match="disk full"):
        offload.demo(tiny_config(), directory=mine)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    fail = False
    kept = offload.demo(tiny_config(), directory=mine, keep=True)
    assert kept["directory"] == str(mine / "checkpoint") and (mine / "checkpoint").is_dir()
    with pytest.raises(ValueError, match="already exists"):  # never written into, never deleted
        offload.demo(tiny_config(), directory=mine)
    assert (mine / "checkpoint" / "model.safetensors").exists() and (mine / "notes.txt").exists()
    result = offload.demo(tiny_config())  # a temporary directory of its own: gone afterwards
    assert not written[-1].parent.exists()


# --- resident memory, measured in child processes --------------------------------------------
def test_peak_rss_stays_within_the_budget(tmp_path):
    """A 53 MB checkpoint (16 blocks of 3.2 MB, a 2 MB resident part) runs in 8.5 MB of weights.

    Bound: peak RSS growth <= budget + the compute overhead + THREAD_SLACK_BYTES, where the
    compute overhead (activations, logits, KV cache) is measured on the same generation with the
    whole model in memory. Controls: the in-memory model, and a streamed run that keeps each
    block after use (so the mapped pages stay resident), both exceed the bound by far.
    Four child processes (measure_streaming runs three), each with a fresh peak.
    """
    cfg = offload.demo_config(hidden=256, n_layers=16, vocab=2048, positions=64)
    directory = offload.write_random_checkpoint(tmp_path / "ck", cfg, timeout=180)
    budget = offload.budget_bytes(directory)
    assert offload.checkpoint_bytes(directory) >= 4 * budget
    setup = dict(prompt_len=8, new_tokens=4, repeats=1, timeout=180)
    result = offload.measure_streaming(directory, in_memory=True, **setup)
    if "error" in result:
        pytest.skip(result["error"])
    assert result["budget_bytes"] == budget and result["same_output"]
    in_memory = result["in_memory"]
    bound = budget + in_memory["compute_overhead"] + offload.THREAD_SLACK_BYTES
    assert in_memory["peak_growth"] > bound, (in_memory, bound)  # the control: the model does not fit
    for mode in ("prefetch", "no_prefetch"):
        assert result[mode]["peak_growth"] <= bound, (mode, result[mode], bound)
        # prefetch: 2 when a read overlaps a compute, 1 when every read finished first (thread timing)
        assert 1 <= result[mode]["max_live_blocks"] <= (2 if mode == "prefetch" else 1)
        assert result[mode]["tokens_per_s"] > 0
    assert result["overhead_bytes"] == result["prefetch"]["peak_growth"] - budget
    assert result["ratio_vs_in_memory"] == pytest.approx(
        result["prefetch"]["tokens_per_s"] / in_memory["tokens_per_s"]
    )

    held = offload.measure_rss(directory, "hold", **setup)  # every block kept after use
    assert held["peak_growth"] > bound, (held, bound)  # so releasing is what kept the RSS down
    assert held["peak_growth"] >= 0.9 * sum(offload.block_bytes(directory))
    assert held["max_live_blocks"] == 4 * cfg.n_layers  # 4 passes (the prompt, 3 tokens), all kept


def test_measurement_rejects_bad_input(checkpoint):
    _, directory = checkpoint
    with pytest.raises(ValueError, match="positions"):
        offload.measure_streaming(directory, prompt_len=30, new_tokens=5)
    with pytest.raises(ValueError, match="must be >= 1"):
        offload.measure_streaming(directory, new_tokens=0)
    with pytest.raises(ValueError, match="mode"):
        offload.measure_rss(directory, "sideways")


# --- CUDA: blocks streamed to the GPU -----------------------------------------------------------
def test_blocks_stream_to_cuda(tmp_path):
    """Weights read from the shards and copied to the GPU one block at a time: the GPU holds the
    resident part and at most two blocks (3.2 MB each here), never the 25 MB of blocks."""
    cfg = offload.demo_config(hidden=256, n_layers=8, vocab=97, positions=32)
    model, directory = save(tmp_path, cfg)
    model = model.cuda()
    ids = torch.randint(97, (2, 10), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad():
        expected = model(ids).logits
    expected_ids = gen.generate(model, ids, 6)
    del model
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with StreamedDecoder(directory, prefetch=True, device="cuda") as streamed:
        logits = streamed(ids)
        assert logits.device.type == "cuda"
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
        assert torch.equal(streamed.generate(ids, 6), expected_ids)
        assert streamed.max_live_blocks == 2 and streamed.live_blocks() == 0
        torch.cuda.synchronize()
    blocks = offload.block_bytes(directory)
    weights_peak = offload.resident_bytes(directory) + 2 * max(blocks)
    growth = torch.cuda.max_memory_allocated() - start
    assert growth < weights_peak + (2 << 20), (growth, weights_peak)  # + activations, logits, cache
    assert growth < sum(blocks) / 2  # far from the whole model

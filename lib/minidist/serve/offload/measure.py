"""Measuring streamed inference: peak RSS and tokens/s, each run in a fresh child process.

A process's peak resident memory (VmHWM) counts everything it ever held, so each run gets a
process of its own (``python -m minidist.serve.offload``, whose ``__main__`` calls
``_measure_here``): streamed with prefetch, without, and the model loaded whole as the control.
``measure_streaming`` compares them with the bound of ``budget``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from minidist.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from minidist.models import generate as gen
from minidist.models import shards
from minidist.models.transformer import Embeddings, TransformerBlock, TransformerConfig
from minidist.serve.offload.budget import block_bytes, budget_bytes, checkpoint_bytes, resident_bytes
from minidist.serve.offload.streamed import StreamedDecoder

__all__ = ["measure_rss", "measure_streaming"]


def _available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is no /proc)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _warm_up_torch(cfg: TransformerConfig) -> None:
    """Run each kind of operation once on tiny tensors, so torch's lazy set-up (thread pool, kernels'
    first-use tables, the modules a first ``torch.device("meta")`` imports) happens before the
    baseline and is not counted as the model's."""
    with torch.device("meta"):  # the first nn.Embedding built on meta imports ~800 modules (~70 MB)
        Embeddings(cfg), TransformerBlock(cfg)
    x = torch.randn(1, 4, cfg.hidden_size)
    w = torch.randn(cfg.hidden_size, cfg.hidden_size)
    y = F.layer_norm(F.gelu(F.linear(x, w)), (cfg.hidden_size,))
    torch.softmax(y @ y.transpose(-2, -1), dim=-1).argmax()


def _measure_here(
    directory: str,
    mode: str,
    prompt_len: int,
    new_tokens: int,
    batch: int,
    threads: int,
    seed: int,
    repeats: int,
) -> dict:
    """The measurement behind :func:`measure_rss`, in this process (call it in a fresh one).

    ``mode``: "prefetch", "no_prefetch" (StreamedDecoder), "hold" (the control of the release:
    no prefetch, and every block read is kept in a list, as a forgotten reference would keep it)
    or "in_memory" (shards.load_decoder). RSS growth is counted from just before the model is
    built: the weights that become resident, the computation's temporaries, the KV cache and
    (streamed) the loader thread. ``seconds`` is the best of ``repeats`` generations.
    """
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    cfg = shards.read_index(directory).config
    _warm_up_torch(cfg)
    prompt = torch.randint(cfg.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    if not reset_peak_rss():
        return {"error": "cannot reset VmHWM via /proc/self/clear_refs"}
    baseline = rss_bytes()
    out: dict = {"mode": mode}
    times = []
    if mode == "in_memory":
        model = shards.load_decoder(directory).eval().requires_grad_(False)
        for t in model.state_dict().values():  # read the weights in (they are mapped from the shards)
            t.reshape(-1).view(torch.uint8)[::4096].sum()
        out["weights_rss"] = rss_bytes() - baseline
        load_peak = peak_rss_bytes() - baseline
        # What the generation itself needs beyond the weights (activations, logits, KV cache):
        # the "compute overhead" that the streamed runs carry too.
        reset_peak_rss()
        before = rss_bytes()
        for _ in range(repeats):
            start = time.perf_counter()
            ids = gen.generate(model, prompt, new_tokens)
            times.append(time.perf_counter() - start)
        out["compute_overhead"] = peak_rss_bytes() - before
        out["peak_growth"] = max(load_peak, peak_rss_bytes() - baseline)
    elif mode in ("prefetch", "no_prefetch", "hold"):
        with StreamedDecoder(directory, prefetch=mode == "prefetch") as model:
            out["resident_rss"] = rss_bytes() - baseline
            if mode == "hold":
                held, read = [], model._read_block
                model._read_block = lambda i: held.append(read(i)) or held[-1]
            for _ in range(repeats):
                start = time.perf_counter()
                ids = model.generate(prompt, new_tokens)
                times.append(time.perf_counter() - start)
            out["peak_growth"] = peak_rss_bytes() - baseline
            out["max_live_blocks"] = model.max_live_blocks
            out["blocks_read"] = model.blocks_read
            if mode == "hold":
                del held
            out["rss_after_run"] = rss_bytes() - baseline
        out["rss_after_close"] = rss_bytes() - baseline
    else:
        raise ValueError(f'mode must be "prefetch", "no_prefetch", "hold" or "in_memory", got {mode!r}')
    out["seconds"] = min(times)
    out["tokens_per_s"] = batch * new_tokens / out["seconds"]
    out["ids"] = ids.tolist()
    out["baseline_rss"] = baseline
    return out


def _child(task: dict, timeout: float) -> dict:
    """Run ``task`` in ``python -m minidist.serve.offload`` (a fresh process); its JSON answer."""
    proc = subprocess.run(
        [sys.executable, "-m", "minidist.serve.offload", json.dumps(task)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the child process ({task.get('task')}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_rss(
    directory: str | os.PathLike,
    mode: str = "prefetch",
    prompt_len: int = 16,
    new_tokens: int = 8,
    batch: int = 1,
    threads: int = 1,
    seed: int = 0,
    repeats: int = 2,
    timeout: float = 600.0,
) -> dict:
    """One generation run in a fresh child process: its peak RSS growth, tokens/s and the ids.

    ``mode``: "prefetch", "no_prefetch", "hold" (the control: every block kept after use) or
    "in_memory". Returns the child's dict: ``peak_growth`` (VmHWM - RSS before the model was built),
    ``tokens_per_s`` (best of ``repeats``), ``ids``, and per mode ``max_live_blocks``,
    ``resident_rss`` / ``weights_rss``, ``compute_overhead`` (in memory: the peak beyond the weights).
    """
    if mode not in ("prefetch", "no_prefetch", "hold", "in_memory"):
        raise ValueError(f'mode must be "prefetch", "no_prefetch", "hold" or "in_memory", got {mode!r}')
    task = dict(
        task="measure",
        directory=str(directory),
        mode=mode,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        batch=batch,
        threads=threads,
        seed=seed,
        repeats=repeats,
    )
    return _child(task, timeout)


def measure_streaming(
    directory: str | os.PathLike,
    prompt_len: int = 16,
    new_tokens: int = 8,
    batch: int = 1,
    threads: int = 1,
    in_memory: bool | None = None,
    seed: int = 0,
    repeats: int = 2,
    timeout: float = 600.0,
) -> dict:
    """Peak RSS and tokens/s of streamed generation, with and without prefetch, and of the model in memory.

    Each run is a fresh child process (``python -m minidist.serve.offload``), so its peak RSS
    (VmHWM) is the run's own, not the caller's: the growth is counted from just before the model
    is built. The runs generate ``new_tokens`` greedily after a random prompt of ``prompt_len``
    tokens (``batch`` of them); ``threads`` torch threads each (1: the loader thread gets the
    other core).

    ``in_memory`` (default: when the checkpoint takes less than half of the available memory)
    adds the control: ``shards.load_decoder`` and ``generate.generate``. It gives the baseline
    tokens/s and the *compute overhead*: the peak RSS the generation needs beyond the weights
    (activations, logits, KV cache), which the streamed runs need too. The budget then holds when

        streamed peak growth <= budget_bytes + compute_overhead + THREAD_SLACK_BYTES

    Returns ``disk_bytes``, ``budget_bytes``, ``resident_bytes``, ``block_bytes`` (largest),
    ``n_layers``, ``prefetch`` / ``no_prefetch`` / ``in_memory`` (each the child's dict: peak_growth,
    tokens_per_s, ...; ``in_memory`` None if skipped), ``same_output`` (all runs produced the same
    ids), ``overhead_bytes`` (prefetch peak growth - budget), ``streaming_extra_bytes`` (that minus
    the compute overhead: what streaming itself adds, bounded by THREAD_SLACK_BYTES),
    ``speedup_prefetch`` (tokens/s with / without prefetch), ``ratio_vs_in_memory`` (streamed with
    prefetch / in memory). Timings are best of ``repeats``; on a shared machine run it twice.
    Raises RuntimeError with the child's stderr if one fails, TimeoutExpired after ``timeout`` s.
    """
    directory = Path(directory)
    if min(prompt_len, new_tokens, batch, threads) < 1:
        raise ValueError(
            f"prompt_len {prompt_len}, new_tokens {new_tokens}, batch {batch}, threads {threads} must be >= 1"
        )
    cfg = shards.read_index(directory).config
    if cfg.position == "learned" and prompt_len + new_tokens > cfg.max_positions:
        raise ValueError(
            f"prompt_len {prompt_len} + new_tokens {new_tokens} exceeds the model's "
            f"{cfg.max_positions} positions: ask for fewer tokens"
        )
    disk = checkpoint_bytes(directory)
    if in_memory is None:
        available = _available_bytes()
        in_memory = available is not None and disk < available // 2
    common = dict(
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        batch=batch,
        threads=threads,
        seed=seed,
        repeats=repeats,
        timeout=timeout,
    )
    runs = {mode: measure_rss(directory, mode, **common) for mode in ("prefetch", "no_prefetch")}
    runs["in_memory"] = measure_rss(directory, "in_memory", **common) if in_memory else None
    for run in runs.values():
        if run is not None and "error" in run:
            return {"error": run["error"]}
    outputs = [run.pop("ids") for run in runs.values() if run is not None]
    budget = budget_bytes(directory)
    result = {
        "disk_bytes": disk,
        "budget_bytes": budget,
        "resident_bytes": resident_bytes(directory),
        "block_bytes": max(block_bytes(directory)),
        "n_layers": cfg.n_layers,
        **runs,
        "same_output": all(o == outputs[0] for o in outputs),
        "overhead_bytes": runs["prefetch"]["peak_growth"] - budget,
        "speedup_prefetch": runs["prefetch"]["tokens_per_s"] / runs["no_prefetch"]["tokens_per_s"],
        "streaming_extra_bytes": (
            runs["prefetch"]["peak_growth"] - budget - runs["in_memory"]["compute_overhead"]
            if in_memory
            else None
        ),
        "ratio_vs_in_memory": (
            runs["prefetch"]["tokens_per_s"] / runs["in_memory"]["tokens_per_s"] if in_memory else None
        ),
    }
    return result

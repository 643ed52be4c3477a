"""What the KV cache costs and saves: bytes held, FLOPs counted, tokens per second measured.

Cost per generated token, for a context of T tokens, d = hidden size, per layer, in FLOPs
(the counts of ``transformer.py``):

    without cache   recompute every position:  24·T·d² (projections, MLP) + 4·T²·d (attention)
    with cache      the new position only:      24·d²                   +  4·T·d

so the attention part goes from O(T²·d) to O(T·d) and the rest from O(T·d²) to O(d²): a
sequence of n tokens costs O(n²·d) attention work in all instead of O(n³·d). (Appending with
``torch.cat`` copies the layer's cache each step, O(T·d) bytes, the same order as reading it
for attention; serving systems preallocate the cache for the longest sequence instead.)
Measured speed-ups are smaller than the FLOP ratio (``generation_flops``) at batch 1: a step
is a few tiny matrix products, so its time goes to per-operation overhead and to reading
every weight once per token. Larger batches share those reads and come closer
(``measure_tokens_per_s``).

The price is memory. Per sequence the cache holds a key and a value vector of size d for
every position of every layer::

    cache bytes = 2 (K and V) · n_layers · T · d · bytes per value          (kv_cache_bytes)

    model        layers  d       T      fp16 cache per sequence
    opt-175b     96      12288   2048   9,663,676,416 B  (9.7 GB)
    bloom-176b   70      14336   2048   8,220,835,840 B  (8.2 GB)

Next to 350 GB of fp16 weights that looks small, but it is per sequence: a batch of 32 full
OPT-175B contexts needs 309 GB of cache, about as much as the weights. This is why serving
systems (and a Petals server, ``minidist.serve.swarm``) budget cache memory per session.
"""

from __future__ import annotations

import math
import time

import torch

from minidist.models.decoder import DecoderLM
from minidist.models.generate.decode import generate
from minidist.models.transformer import TransformerConfig

__all__ = ["generation_flops", "kv_cache_bytes", "measure_tokens_per_s"]


def kv_cache_bytes(cfg: TransformerConfig, batch: int, seq: int, bytes_per_value: int = 2) -> int:
    """Bytes of a full KV cache: 2 (keys and values) · n_layers · batch · seq · hidden · bytes_per_value.

    ``bytes_per_value`` is 2 for fp16/bf16 (how big models are served), 4 for fp32.
    OPT-175B at 2048 tokens: 2 · 96 · 2048 · 12288 · 2 = 9,663,676,416 bytes per sequence;
    BLOOM-176B (70 layers, d = 14336): 8,220,835,840 bytes.
    """
    if min(batch, seq, bytes_per_value) < 0:
        raise ValueError(f"batch {batch}, seq {seq} and bytes_per_value {bytes_per_value} must be >= 0")
    return 2 * cfg.n_layers * batch * seq * cfg.hidden_size * bytes_per_value


def generation_flops(
    cfg: TransformerConfig, prompt_len: int, new_tokens: int, use_cache: bool, batch: int = 1
) -> int:
    """Matrix-multiply FLOPs (2 per multiply-add) of ``generate(model, prompt, new_tokens, use_cache)``.

    Per layer, a position costs ``2·(4d² + 2·d·f)`` in its projections and MLP and ``4·K·d`` in
    attention over K keys (Q·Kᵀ and weights·V); the tied head ``2·d·V`` per position. The
    forward on T tokens computes all T² scores (the causal mask zeroes half after the fact).

        without cache   step k runs the full forward on T = prompt + k tokens, k = 0..n-1
        with cache      the prompt's forward once, then n-1 steps of one token over t+1 keys

    LayerNorms, GELU and softmax are not counted (they are O(T·d), not matrix products).
    """
    if min(prompt_len, new_tokens, batch) < 0 or prompt_len < 1:
        raise ValueError(
            f"prompt_len {prompt_len} must be >= 1, new_tokens {new_tokens} and batch {batch} >= 0"
        )
    d, f, n_layers, vocab = cfg.hidden_size, cfg.ffn_size, cfg.n_layers, cfg.vocab_size

    def forward_flops(new: int, past: int) -> int:
        """``new`` positions after ``past`` cached ones: new queries over past + new keys."""
        per_layer = new * 2 * (4 * d * d + 2 * d * f) + 4 * new * (past + new) * d
        return n_layers * per_layer + 2 * new * d * vocab

    if new_tokens == 0:
        return 0
    if use_cache:
        total = forward_flops(prompt_len, 0)
        total += sum(forward_flops(1, past) for past in range(prompt_len, prompt_len + new_tokens - 1))
    else:
        total = sum(forward_flops(prompt_len + k, 0) for k in range(new_tokens))
    return batch * total


def measure_tokens_per_s(
    model: DecoderLM,
    prompt_len: int,
    new_tokens: int,
    use_cache: bool,
    batch: int = 1,
    repeats: int = 3,
    seed: int = 0,
    threads: int | None = None,
) -> float:
    """Generated tokens per second of ``generate`` on a random prompt: batch · new_tokens / wall time,
    the best of ``repeats`` runs after a warm-up.

    For benchmarks and notebooks: compare ``use_cache=True`` and ``False`` side by side, on the
    same machine, in the same process. ``threads`` sets torch's intra-op threads for the
    measurement (restored afterwards): one token's matrices are tiny, and on a machine whose
    cores are busy, waking several threads per operation can cost more than the arithmetic.
    """
    if prompt_len < 1 or new_tokens < 1 or repeats < 1 or batch < 1:
        raise ValueError(
            f"prompt_len {prompt_len}, new_tokens {new_tokens}, batch {batch}, repeats {repeats} must be >= 1"
        )
    device = model.word_embeddings.device
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(model.cfg.vocab_size, (batch, prompt_len), generator=gen).to(device)
    threads_before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        generate(model, prompt, min(new_tokens, 2), use_cache=use_cache)  # warm-up
        best = math.inf
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            generate(model, prompt, new_tokens, use_cache=use_cache)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads_before)
    return batch * new_tokens / best

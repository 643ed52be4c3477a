"""Incremental decoding with a KV cache: generate one token at a time without recomputing the past.

A decoder predicts token t + 1 from tokens 0..t. Generating n tokens the naive way runs the
whole model on the whole sequence n times, although the keys and values of the old positions
never change: in a causal model position j only looks at positions <= j, so nothing that
comes later can alter what was computed for it. The KV cache keeps, for every layer, the keys
and values of all positions seen so far; each step computes q, k, v for the *new* token only::

    step t (one layer, one head; T = t tokens already in the cache)

        x_t ──► q_t = x_t W_q                                  the new token's query
            ──► k_t = x_t W_k ─┐                               its key and value
            ──► v_t = x_t W_v ─┤
                               ▼
        cache  K: [k_0 k_1 ... k_{t-1}] + k_t  ──►  [k_0 ... k_t]     (B, H, T+1, d_head)
               V: [v_0 v_1 ... v_{t-1}] + v_t  ──►  [v_0 ... v_t]
                               │
        scores = q_t [k_0 ... k_t]ᵀ / √d_head + bias[t, 0..t]          (B, H, 1, T+1)
        out_t  = softmax(scores) [v_0 ... v_t] ──► W_o                 (B, 1, d)

    The MLP, the LayerNorms and the residuals act on each position alone, so they run on
    the new token only as well.

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
every weight once per token. Larger batches share those reads and come closer.

The price is memory. Per sequence the cache holds a key and a value vector of size d for
every position of every layer::

    cache bytes = 2 (K and V) · n_layers · T · d · bytes per value          (kv_cache_bytes)

    model        layers  d       T      fp16 cache per sequence
    opt-175b     96      12288   2048   9,663,676,416 B  (9.7 GB)
    bloom-176b   70      14336   2048   8,220,835,840 B  (8.2 GB)

Next to 350 GB of fp16 weights that looks small, but it is per sequence: a batch of 32 full
OPT-175B contexts needs 309 GB of cache, about as much as the weights. This is why serving
systems (and a Petals server, ``minidist.serve.swarm``) budget cache memory per session.

Functions, from the inside out (each one a step of the full forward, for new tokens only):

    attention_step   one MultiHeadSelfAttention on new tokens, given the layer's past keys/values
    block_step       one TransformerBlock (pre-LN or post-LN) around it
    step_bias        rows past..past+new of the causal (+ ALiBi) bias the full forward uses
    embed            word + learned positions past..past+new
    span_step        a list of consecutive blocks (what a swarm server holds), caches updated
    decoder_step     a whole DecoderLM: new ids -> logits, the model's KVCache updated
    generate         greedy decoding, with or without the cache (same tokens either way)

and the accounting: ``kv_cache_bytes`` (the memory price), ``generation_flops`` (the work
saved, counted exactly as torch's FlopCounterMode counts it) and ``measure_tokens_per_s``.

Everything calls the model's own submodules (``attn.query(x)``, never ``attn.query.weight``),
so a model whose Linear layers were swapped for ``quant.QuantizedLinear`` decodes the same way.

Layer 5 (next to the models): imports torch and ``minidist.models``.
"""

from __future__ import annotations

import math
import time
from collections.abc import MutableSequence, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from minidist.models.decoder import DecoderLM
from minidist.models.transformer import (
    Embeddings,
    MultiHeadSelfAttention,
    Transformer,
    TransformerBlock,
    TransformerConfig,
    alibi_slopes,
)

__all__ = [
    "KVCache",
    "attention_step",
    "block_step",
    "step_bias",
    "embed",
    "span_step",
    "decoder_step",
    "generate",
    "kv_cache_bytes",
    "generation_flops",
    "measure_tokens_per_s",
]

KV = tuple[torch.Tensor, torch.Tensor]


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


class KVCache:
    """The keys and values of every past position, per layer: ``cache[i] = (keys, values)``.

    Each is (B, H, T_past, d_head); an entry is None until the layer has seen a token. The
    cache is a plain mutable sequence of these entries, so ``span_step`` can fill any list of
    per-layer entries (a swarm server keeps one list per session for its span of blocks).
    """

    def __init__(self, n_layers: int) -> None:
        if n_layers < 1:
            raise ValueError(f"n_layers must be positive, got {n_layers}")
        self.layers: list[KV | None] = [None] * n_layers

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> KV | None:
        return self.layers[i]

    def __setitem__(self, i: int, entry: KV | None) -> None:
        self.layers[i] = entry

    def __iter__(self):  # noqa: ANN204
        return iter(self.layers)

    @property
    def length(self) -> int:
        """Positions cached so far (T_past); every filled layer must agree."""
        lengths = {kv[0].shape[2] for kv in self.layers if kv is not None}
        if len(lengths) > 1:
            raise ValueError(
                f"layers of this cache hold different lengths {sorted(lengths)}: a step was cut short"
            )
        return lengths.pop() if lengths else 0

    @property
    def batch_size(self) -> int | None:
        """Sequences in the cache (B), or None while it is empty."""
        filled = [kv for kv in self.layers if kv is not None]
        return filled[0][0].shape[0] if filled else None

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached keys and values (measured from the tensors)."""
        return sum(t.numel() * t.element_size() for kv in self.layers if kv is not None for t in kv)

    def __repr__(self) -> str:
        return f"KVCache(n_layers={len(self)}, length={self.length}, nbytes={self.nbytes})"


# --------------------------------------------------------------------------------------------
# One layer
# --------------------------------------------------------------------------------------------


def attention_step(
    attn: MultiHeadSelfAttention,
    x_new: torch.Tensor,
    past_kv: KV | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, KV]:
    """Attention of T_new new positions over past and new keys: ``(out, (keys, values))``.

    ``x_new`` (B, T_new, d); ``past_kv`` the layer's cached (keys, values), each
    (B, H, T_past, d_head), or None for the first step; ``bias`` broadcastable to
    (B, H, T_new, T_past + T_new) (``step_bias``). Returns the output (B, T_new, d) and the
    keys and values of *all* T_past + T_new positions: the layer's new cache entry.

    The same arithmetic as ``MultiHeadSelfAttention.forward``, except that keys and values of
    earlier positions come from the cache instead of being recomputed.
    """
    batch, new_len, d = x_new.shape
    q = attn.split_heads(attn.query(x_new))  # (B, H, T_new, d_head)
    k = attn.split_heads(attn.key(x_new))
    v = attn.split_heads(attn.value(x_new))
    if past_kv is not None:
        past_k, past_v = past_kv
        # the cache must match everywhere but in its length (dim 2): same B, H, d_head
        expected = (batch, k.shape[1], past_k.shape[2] if past_k.dim() == 4 else -1, k.shape[3])
        if past_k.shape != expected or past_v.shape != expected:
            raise ValueError(
                f"cached keys have shape {tuple(past_k.shape)}, values {tuple(past_v.shape)} "
                f"(B, H, T_past, d_head), new keys "
                f"{tuple(k.shape)}: the cache belongs to another batch or model; start a new KVCache"
            )
        k = torch.cat([past_k, k], dim=2)  # append the new positions: (B, H, T_past + T_new, d_head)
        v = torch.cat([past_v, v], dim=2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(attn.head_dim)  # (B, H, T_new, T_past + T_new)
    if bias is not None:
        scores = scores + bias
    weights = attn.attn_dropout(torch.softmax(scores, dim=-1))
    out = (weights @ v).transpose(1, 2).reshape(batch, new_len, d)
    return attn.output(out), (k, v)


def block_step(
    block: TransformerBlock, x_new: torch.Tensor, past_kv: KV | None, bias: torch.Tensor | None
) -> tuple[torch.Tensor, KV]:
    """``TransformerBlock.forward`` for new positions only: ``(x, (keys, values))``.

    LayerNorms, the MLP and the residual additions act on each position alone, so only the
    attention needs the past (``attention_step``).
    """
    if block.pre_ln:
        attended, kv = attention_step(block.attention, block.attention_norm(x_new), past_kv, bias)
        x = x_new + block.dropout(attended)
        return x + block.dropout(block.mlp(block.mlp_norm(x))), kv
    attended, kv = attention_step(block.attention, x_new, past_kv, bias)
    x = block.attention_norm(x_new + block.dropout(attended))
    return block.mlp_norm(x + block.dropout(block.mlp(x))), kv


def step_bias(
    cfg: TransformerConfig, past_len: int, new_len: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor | None:
    """Rows past_len..past_len+new_len of ``transformer.attention_bias`` for past_len + new_len keys.

    Query i (absolute position past_len + row) may see key j when j <= i (``cfg.causal``), and
    with ALiBi pays ``slope_h · |i - j|``. Shape (1, H or 1, new_len, past_len + new_len), or
    None when the config has neither a causal mask nor ALiBi. Built for the new rows only:
    O(new · total) work, not the full (total, total) matrix.
    """
    if past_len < 0 or new_len < 1:
        raise ValueError(f"need past_len >= 0 and new_len >= 1, got past_len={past_len}, new_len={new_len}")
    queries = torch.arange(past_len, past_len + new_len, device=device)
    keys = torch.arange(past_len + new_len, device=device)
    distance = queries[:, None] - keys[None, :]  # (T_new, T_total): i - j
    bias = None
    if cfg.position == "alibi":
        slopes = alibi_slopes(cfg.n_heads).to(device=device, dtype=dtype)
        bias = (-slopes[:, None, None] * distance.abs().to(dtype)[None])[None]  # (1, H, T_new, T_total)
    very_negative = torch.finfo(dtype).min
    if cfg.causal:
        causal = torch.zeros(distance.shape, dtype=dtype, device=device)
        causal.masked_fill_(distance < 0, very_negative)  # keys after the query
        bias = causal[None, None] if bias is None else bias + causal
    if bias is not None:
        bias = bias.clamp(min=very_negative)  # as attention_bias: finite everywhere
    return bias


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


def _embeddings(model: nn.Module) -> Embeddings:
    if isinstance(model, Embeddings):
        return model
    if isinstance(model, DecoderLM):
        return model.transformer.embeddings
    if isinstance(model, Transformer):
        return model.embeddings
    raise TypeError(f"expected a DecoderLM, Transformer or Embeddings, got {type(model).__name__}")


def embed(model: nn.Module, input_ids: torch.Tensor, past_len: int) -> torch.Tensor:
    """Word vectors of ``input_ids`` (B, T_new) plus learned positions past_len..past_len+T_new.

    ``model`` is a DecoderLM (or its Transformer or Embeddings). With ALiBi there is no
    position table: the positions enter through ``step_bias``. Refuses positions beyond the
    learned table (``max_positions``) with a ValueError.
    """
    emb = _embeddings(model)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, new_tokens), got shape {tuple(input_ids.shape)}")
    new_len = input_ids.shape[1]
    if emb.position is not None and past_len + new_len > emb.cfg.max_positions:
        raise ValueError(
            f"{past_len} cached + {new_len} new tokens = {past_len + new_len} positions, but the model "
            f"has {emb.cfg.max_positions} learned positions: generate fewer tokens or start a new cache"
        )
    x = emb.word(input_ids)
    if emb.position is not None:
        positions = torch.arange(past_len, past_len + new_len, device=input_ids.device)
        x = x + emb.position(positions)[None]
    if emb.segment is not None:
        x = x + emb.segment(torch.zeros_like(input_ids))
    if emb.norm is not None:
        x = emb.norm(x)
    return emb.dropout(x)


def span_step(
    blocks: Sequence[TransformerBlock],
    cfg: TransformerConfig,
    hidden: torch.Tensor,
    caches: MutableSequence[KV | None],
    past_len: int,
) -> torch.Tensor:
    """Run new positions through consecutive ``blocks``; ``caches[i]`` (block i's entry) updated in place.

    ``hidden`` (B, T_new, d) holds the states of positions past_len..past_len+T_new entering
    the first block; ``caches`` is a KVCache or a list with one entry per block (None before
    the first step). This is what a swarm server runs for its span of layers: two spans one
    after the other give what one span of all their blocks gives.
    """
    if len(caches) != len(blocks):
        raise ValueError(f"{len(blocks)} blocks but {len(caches)} cache entries: pass one entry per block")
    if hidden.dim() != 3 or hidden.shape[-1] != cfg.hidden_size:
        raise ValueError(f"hidden must be (batch, new_tokens, {cfg.hidden_size}), got {tuple(hidden.shape)}")
    for i, kv in enumerate(caches):
        held = 0 if kv is None else kv[0].shape[2]
        if held != past_len:
            raise ValueError(
                f"cache entry {i} holds {held} positions but past_len is {past_len}: "
                "pass the cache of this session, and past_len = the tokens already sent"
            )
    bias = step_bias(cfg, past_len, hidden.shape[1], hidden.dtype, hidden.device)
    for i, block in enumerate(blocks):
        hidden, caches[i] = block_step(block, hidden, caches[i], bias)
    return hidden


def decoder_step(model: DecoderLM, new_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (B, T_new, V) of new tokens, given the ``cache`` of the tokens before them (filled in place).

    The first call (empty cache) takes the whole prompt ("prefill"); each later call one token.
    Equal, position for position, to ``model(all_ids).logits`` on the concatenated ids.
    """
    if len(cache) != model.cfg.n_layers:
        raise ValueError(
            f"cache has {len(cache)} layers, the model {model.cfg.n_layers}: use KVCache(cfg.n_layers)"
        )
    if cache.batch_size is not None and cache.batch_size != new_ids.shape[0]:
        raise ValueError(
            f"cache holds {cache.batch_size} sequences, new_ids has {new_ids.shape[0]}: one cache per batch"
        )
    past_len = cache.length
    hidden = embed(model, new_ids, past_len)
    hidden = span_step(model.transformer.blocks, model.cfg, hidden, cache, past_len)
    if model.transformer.final_norm is not None:
        hidden = model.transformer.final_norm(hidden)
    return F.linear(hidden, model.word_embeddings)


@torch.no_grad()
def generate(
    model: DecoderLM,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    use_cache: bool = True,
    eos_id: int | None = None,
) -> torch.Tensor:
    """Greedy decoding: append the argmax token ``max_new_tokens`` times; returns (B, T + new) ids.

    ``input_ids`` (B, T): B >= 1 prompts of equal length. ``use_cache=False`` reruns the full
    model on the whole sequence at every step (the reference); ``True`` runs the prompt once
    and then one token per step (``decoder_step``). Both give the same tokens.
    With ``eos_id``, a sequence that produced it keeps producing it, and generation stops early
    once every sequence has (the result is then shorter than T + max_new_tokens).
    The model runs in eval mode (dropout off: otherwise the argmax would be of randomly thinned
    activations) and is put back in the mode it had.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(
            "input_ids must be (batch, prompt_len) with prompt_len >= 1, "
            f"got shape {tuple(input_ids.shape)}: "
            "use input_ids[None] for one prompt, prompts of one length for a batch"
        )
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    cfg = model.cfg
    total = input_ids.shape[1] + max_new_tokens
    if cfg.position == "learned" and total > cfg.max_positions:
        raise ValueError(
            f"prompt of {input_ids.shape[1]} + {max_new_tokens} new tokens = {total} positions, "
            f"but the model has {cfg.max_positions}: shorten the prompt or ask for at most "
            f"{cfg.max_positions - input_ids.shape[1]} new tokens"
        )
    was_training = model.training
    model.eval()
    try:
        return _greedy(model, input_ids, max_new_tokens, use_cache, eos_id)
    finally:
        model.train(was_training)


def _greedy(
    model: DecoderLM, input_ids: torch.Tensor, max_new_tokens: int, use_cache: bool, eos_id: int | None
) -> torch.Tensor:
    ids = input_ids
    cache = KVCache(model.cfg.n_layers) if use_cache else None
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    new_ids = ids  # what the cached model has not seen yet
    for _ in range(max_new_tokens):
        # with a cache: only the tokens the cache has not seen; without: the whole sequence again
        logits = decoder_step(model, new_ids, cache) if cache is not None else model(ids).logits
        next_id = logits[:, -1].argmax(dim=-1)  # (B,)
        if eos_id is not None:
            next_id = torch.where(done, torch.full_like(next_id, eos_id), next_id)
            done = done | (next_id == eos_id)
        new_ids = next_id[:, None]
        ids = torch.cat([ids, new_ids], dim=1)
        if eos_id is not None and bool(done.all()):
            break
    return ids


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

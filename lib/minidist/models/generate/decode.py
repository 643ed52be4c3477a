"""Incremental decoding through the whole model: new ids in, logits out, the cache filled in place.

Each function is a step of the full forward, for new tokens only, built on the one-layer
steps of the sibling ``cache``:

    embed            word + learned positions past..past+new
    span_step        a list of consecutive blocks (what a swarm server holds), caches updated
    decoder_step     a whole DecoderLM: new ids -> logits, the model's KVCache updated
    generate         greedy decoding, with or without the cache (same tokens either way)

Everything calls the model's own submodules (``attn.query(x)``, never ``attn.query.weight``),
so a model whose Linear layers were swapped for ``quant.QuantizedLinear`` decodes the same way.
"""

from __future__ import annotations

from collections.abc import MutableSequence, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from minidist.models.decoder import DecoderLM
from minidist.models.generate.cache import KV, KVCache, block_step, step_bias
from minidist.models.transformer import Embeddings, Transformer, TransformerBlock, TransformerConfig

__all__ = ["decoder_step", "embed", "generate", "span_step"]


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

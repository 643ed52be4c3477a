"""Incremental decoding with a KV cache: generate one token at a time without recomputing the past.

A decoder predicts token t + 1 from tokens 0..t. Generating n tokens the naive way runs the
whole model on the whole sequence n times, although the keys and values of the old positions
never change: in a causal model position j only looks at positions <= j, so nothing that
comes later can alter what was computed for it. The KV cache keeps, for every layer, the keys
and values of all positions seen so far, and each step computes the new token only. Three
modules, from the inside out:

    cache    ``KVCache``; ``attention_step``, ``block_step``, ``step_bias``: one layer, new tokens
             only (the picture of a step is there)
    decode   ``embed``, ``span_step``, ``decoder_step``, ``generate``: the whole model, greedy
    cost     ``kv_cache_bytes`` (the memory price), ``generation_flops`` (the work saved, counted
             exactly as torch's FlopCounterMode counts it), ``measure_tokens_per_s``

Models layer: imports torch and ``minidist.models``.
"""

from minidist.models.generate.cache import KVCache, attention_step, block_step, step_bias
from minidist.models.generate.cost import generation_flops, kv_cache_bytes, measure_tokens_per_s
from minidist.models.generate.decode import decoder_step, embed, generate, span_step

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

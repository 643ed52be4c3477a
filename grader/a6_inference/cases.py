"""The case table of assignment 6 (int8, NF4, the KV-cached attention step, generation). Instructors only.

Every test is a ``Case`` of ``cases(seed)``: a job (a worker of ``workers.py``, one process,
JSON arguments) and a trusted check of what it reports (``reference.py``: the formats written
again, attention and the decoder recomputed over the whole sequence). pytest runs them with
seed 0; ``grading.py`` runs the same cases with a seed per student (other shapes and values).

* int8: codes and per-row scales on shapes the public tests do not use (3-D, float64 and
  bfloat16 inputs, a row of zeros, outliers); dequantization of the grader's codes; the bytes
  stored, measured from the storages (task 1);
* packing: bytes of random codes, codes of random bytes, high four bits first (task 1);
* NF4: codes (unpacked by the grader) and scales with a last block cut short and an odd
  number of weights; the bytes stored, exactly codes + scales; dequantization of random bytes
  and scales; quantize then dequantize gives what the codes hold, not the original (task 1);
* attention: without a cache, one new token with a cache and a batch of 3, several new tokens
  with a cache, 2-4 heads; the output and the grown cache against attention over the whole
  sequence; the projections called once, on the new tokens only; the past first, unchanged
  (task 2);
* generation on the grader's decoder (float64, projections that count tokens): without the
  cache, and with it for a one-token prompt and for a batch of 3, equal to greedy decoding
  recomputed over the whole sequence; with the cache, each step after the first sends one token
  per sequence through every projection (task 3);
* measured (task 4, in tiers): the student's ``quantize_model`` on the shipped course decoder's
  24 linear weights (786,432). The grader rebuilds every matrix from the returned fields
  (``reference.rebuild``: codes, code values or evenly spaced integers, scales or quantized
  scales), counts their bits from the same fields, and runs the decoder on 16 held-out blocks
  of the eval split: a perplexity more than 1% above fp16's fails; otherwise the bits per weight
  earn the tier (4.0 / 4.25 / 4.5).

The folder holding the student's ``inference.py`` must be on PYTHONPATH; it is imported only in
the worker processes. Each ``Case`` carries its points; ``grading.py`` declares the assignment.
"""

from __future__ import annotations

import random

from grader.assignment import Case
from grader.tiers import Tiers

from . import reference as ref

TASKS = {
    "quantize_int8": 1,
    "dequantize_int8": 1,
    "pack_4bit": 1,
    "quantize_nf4": 1,
    "dequantize_nf4": 1,
    "attention_step": 2,
    "generate": 3,
    "quantize_model": 4,
}


def _seed(seed: int, base: int) -> int:
    return (seed * 1000 + base) % 2**31


def int8_spec(seed: int, base: int, lead: list[int], dtype: str) -> dict:
    rng = random.Random(_seed(seed, base))
    return {"seed": _seed(seed, base), "shape": [*lead, rng.choice([9, 17, 30])], "dtype": dtype}


def nf4_spec(seed: int, base: int, block: int, zero_block: bool = False) -> dict:
    """A shape whose size is not a multiple of ``block`` (the last block is cut short)."""
    rng = random.Random(_seed(seed, base))
    while True:
        shape = [rng.choice([3, 5, 7]), rng.choice([11, 19, 25, 37])]
        if (shape[0] * shape[1]) % block:
            break
    return {"seed": _seed(seed, base), "shape": shape, "block": block, "zero_block": zero_block}


def attention_spec(seed: int, base: int, batch: int, past: int, new: int) -> dict:
    rng = random.Random(_seed(seed, base))
    heads = rng.choice([2, 3, 4])
    return {
        "seed": _seed(seed, base),
        "batch": batch,
        "past": past,
        "new": new,
        "heads": heads,
        "d": heads * rng.choice([4, 6]),
        "layers": 1,
        "vocab": 5,
        "positions": 1,
    }


def generation_spec(seed: int, base: int, batch: int, prompt: int, use_cache: bool) -> dict:
    rng = random.Random(_seed(seed, base))
    heads, new_tokens = rng.choice([2, 3, 4]), rng.choice([5, 6, 7])
    return {
        "seed": _seed(seed, base),
        "batch": batch,
        "prompt": prompt,
        "new_tokens": new_tokens,
        "heads": heads,
        "d": heads * rng.choice([4, 6]),
        "layers": 2,
        "vocab": rng.choice([17, 23, 29]),
        "positions": prompt + new_tokens + 1,
        "use_cache": use_cache,
    }


# --- the cases ---------------------------------------------------------------------------------
def cases(seed: int) -> list[Case]:
    out: list[Case] = []

    def add(name, points, function, worker, spec, check):
        out.append(Case(name, points, function, worker, 1, [spec], check, transport="pipe"))

    int8_cases = (("3d-float64", 10, [2, 3], "float64"), ("rows-bfloat16", 11, [6], "bfloat16"))
    for name, base, lead, dtype in int8_cases:
        s = int8_spec(seed, base, lead, dtype)
        what = f"quantize_int8 on {dtype} {tuple(s['shape'])}"
        add(
            f"test_int8_quantize[{name}]",
            3,
            "quantize_int8",
            "int8_quantize",
            s,
            ref.int8_quantize_check(what, s),
        )
    s = int8_spec(seed, 12, [5], "float32")
    add(
        "test_int8_dequantize",
        2,
        "dequantize_int8",
        "int8_dequantize",
        s,
        ref.int8_dequantize_check("dequantize_int8", s),
    )
    s = int8_spec(seed, 13, [7], "float32")
    what = f"quantize_int8 on {tuple(s['shape'])}"
    add("test_int8_memory", 2, "quantize_int8", "int8_quantize", s, ref.int8_memory_check(what, s))
    rng = random.Random(_seed(seed, 20))
    n = 2 * rng.randint(20, 40)
    s = {"seed": _seed(seed, 20), "n": n, "codes_shape": [2, n // 2]}
    add("test_pack_4bit", 3, "pack_4bit", "pack", s, ref.pack_check(f"{n} codes", s))
    nf4_cases = (("block-64", 30, 64, False), ("block-6-zeros", 31, 6, True))
    for name, base, block, zero in nf4_cases:
        s = nf4_spec(seed, base, block, zero)
        what = f"quantize_nf4 on {tuple(s['shape'])}, block {block}"
        add(
            f"test_nf4_quantize[{name}]",
            3,
            "quantize_nf4",
            "nf4_quantize",
            s,
            ref.nf4_quantize_check(what, s),
        )
    for name, base, block, zero in nf4_cases:
        s = nf4_spec(seed, base + 10, block, zero)
        what = f"quantize_nf4 on {tuple(s['shape'])}, block {block}"
        add(f"test_nf4_memory[{name}]", 2, "quantize_nf4", "nf4_quantize", s, ref.nf4_memory_check(what, s))
    s = nf4_spec(seed, 50, 16)
    what = f"dequantize_nf4 on {tuple(s['shape'])}, block 16"
    add("test_nf4_dequantize", 3, "dequantize_nf4", "nf4_dequantize", s, ref.nf4_dequantize_check(what, s))
    s = nf4_spec(seed, 51, 32)
    what = f"quantize_nf4 then dequantize_nf4 on {tuple(s['shape'])}, block 32"
    add("test_nf4_round_trip", 2, "dequantize_nf4", "nf4_round_trip", s, ref.nf4_round_trip_check(what, s))
    for name, base, batch, past, new in (
        ("prefill", 60, 2, 0, 5),
        ("one-token-batch-3", 61, 3, 6, 1),
        ("several-tokens", 62, 2, 4, 3),
    ):
        s = attention_spec(seed, base, batch, past, new)
        what = f"attention_step, {s['heads']} heads, batch {batch}, {past} cached + {new} new tokens"
        add(f"test_attention_step[{name}]", 3, "attention_step", "attention", s, ref.attention_check(what, s))
    s = attention_spec(seed, 63, 2, 5, 1)
    what = f"attention_step, {s['heads']} heads, {s['past']} cached + 1 new token"
    add("test_attention_cache_grows", 3, "attention_step", "attention", s, ref.attention_cache_check(what, s))
    s = generation_spec(seed, 70, 2, 4, use_cache=False)
    what = f"generate(use_cache=False), batch 2, prompt of 4, {s['new_tokens']} new tokens"
    add("test_generate_without_cache", 3, "generate", "generation", s, ref.generate_check(what, s))
    for name, base, batch, length in (("prompt-1", 71, 1, 1), ("batch-3", 72, 3, 5)):
        s = generation_spec(seed, base, batch, length, use_cache=True)
        what = f"generate(use_cache=True), batch {batch}, prompt of {length}, {s['new_tokens']} new tokens"
        add(f"test_generate_with_cache[{name}]", 3, "generate", "generation", s, ref.generate_check(what, s))
    s = generation_spec(seed, 73, 2, 3, use_cache=True)
    what = f"generate(use_cache=True), batch 2, prompt of 3, {s['new_tokens']} new tokens"
    add("test_generate_uses_the_cache", 4, "generate", "generation", s, ref.cache_use_check(what, s))
    # measured: the same for every seed (the course's decoder and held-out text are fixed)
    out.append(
        Case(
            "test_quantized_decoder_bits",
            8,
            "quantize_model",
            "quantizer",
            1,
            [{}],
            ref.quantizer_check("quantize_model on the course's decoder"),
            transport="pipe",
            tiers=QUANTIZER_TIERS,
        )
    )
    return out


#: bits per weight of the linear layers, the decoder rebuilt within 1% of fp16's perplexity
QUANTIZER_TIERS = Tiers(
    quantity="bits per weight within 1% of fp16's perplexity",
    unit=" bits",
    levels=((4.0, 1.0), (4.25, 0.5), (4.5, 0.25)),
    lower_is_better=True,
    baseline="the library's NF4 with double-quantized scales (block 64): 4.135 bits",
)

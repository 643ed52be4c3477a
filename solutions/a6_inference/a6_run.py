"""Helpers for the notebook of assignment 6: run a part that may not be written yet, count the
tokens the projections see, measure a format on the course's decoder, run the public tests.
Nothing to change here.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def try_run(function, *args, **kwargs):
    """``function(*args)``, or None (and a note) while a part of your code is not written yet."""
    try:
        return function(*args, **kwargs)
    except NotImplementedError as error:
        print(f"not implemented yet ({error}): nothing to show.")
    return None


def stored_bytes(*tensors) -> int:
    """Bytes of the tensors' memory (each tensor's whole storage, once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


class TokenCounter:
    """Counts the tokens every projection (q, k, v, o) of ``model`` receives, with forward hooks.

    >>> counter = TokenCounter(model); ...; counter.total, counter.per_call; counter.remove()
    """

    def __init__(self, model) -> None:
        self.per_call: list[int] = []
        self.handles = [
            getattr(block, name).register_forward_hook(self._count)
            for block in model.blocks
            for name in ("q", "k", "v", "o")
        ]

    def _count(self, module, args, output) -> None:
        self.per_call.append(math.prod(args[0].shape[:-1]))

    @property
    def total(self) -> int:
        return sum(self.per_call)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


#: one public test per task: what the course's own CI runs from this notebook
#: (MINIDIST_PUBLIC_TESTS=one-per-task), where the whole file is run once by `make test`
ONE_PER_TASK = [
    "test_int8_known_values",
    "test_packing_known_values_and_round_trip",
    "test_nf4_codes_are_the_nearest_values_and_memory_is_4_bits_plus_scales",
    "test_attention_with_cache_equals_the_whole_sequence",
    "test_generate_with_and_without_cache_gives_the_same_tokens",
]


def run_public_tests(*pytest_args: str) -> bool:
    """Run test_a6_inference.py in a fresh process (your latest code); print its report."""
    targets = ["test_a6_inference.py"]
    if os.environ.get("MINIDIST_PUBLIC_TESTS") == "one-per-task" and not pytest_args:
        targets = [f"test_a6_inference.py::{name}" for name in ONE_PER_TASK]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets]
    result = subprocess.run([*command, *pytest_args], cwd=HERE, capture_output=True, text=True)
    print(result.stdout[-20_000:], result.stderr[-5_000:], sep="")
    return result.returncode == 0


# --- task 4: a format measured on the course's decoder -------------------------------------------
def rebuild(q) -> tuple:
    """``(weights, bits)`` of one ``Quantized``, read the way its docstring says the grader reads
    it: float32 weights of ``q.shape`` and the bits of its codes, code values and scales."""
    import torch

    if q.values is None:
        values, bits = q.codes.double() - (2 ** (q.bits - 1) - 1), q.bits * q.codes.numel()
    else:
        values = q.values.double()[q.codes.long()]
        bits = q.bits * q.codes.numel() + 16 * q.values.numel()
    if torch.is_tensor(q.scales):
        scales, scale_bits = q.scales.double(), 8 * q.scales.element_size() * q.scales.numel()
    else:
        scales, scale_bits = rebuild(q.scales)
        scales = scales.double().reshape(-1)
    n = math.prod(q.shape)
    weights = (values.reshape(-1, q.block) * scales[:, None]).reshape(-1)[:n].reshape(q.shape)
    return weights.float(), bits + scale_bits


def measure_quantizer(quantize_model, blocks: int = 16) -> dict:
    """Your ``quantize_model`` on the course's pretrained decoder: bits per weight of its linear
    layers and the perplexity on the first ``blocks`` blocks of the eval split (those the grader
    uses), against the same decoder with its linear weights in fp16."""
    import torch

    from minidist import data
    from minidist.models import pretrained

    model, tok = pretrained.load("course")
    text = data.lm_dataset(tok, 128, "eval")[:blocks]
    linears = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    original = {name: m.weight.detach().clone() for name, m in linears.items()}

    def perplexity(weights: dict) -> float:
        with torch.no_grad():
            for name, module in linears.items():
                module.weight.copy_(weights[name])
        return pretrained.perplexity(model, blocks=text)

    fp16 = perplexity({name: w.half().float() for name, w in original.items()})
    formats = quantize_model({name: w.clone() for name, w in original.items()})
    rebuilt = {name: rebuild(formats[name]) for name in original}
    bits = sum(b for _, b in rebuilt.values()) / sum(w.numel() for w in original.values())
    quantized = perplexity({name: w for name, (w, _) in rebuilt.items()})
    return {"bits_per_weight": bits, "fp16": fp16, "perplexity": quantized, "increase": quantized / fp16 - 1}

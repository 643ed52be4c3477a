"""Helpers for the notebook of assignment 6: run a part that may not be written yet, count the
tokens the projections see, run the public tests. Nothing to change here.
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

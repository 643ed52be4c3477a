"""Measuring memory on real tensors: what the calculator in ``minidist.memory`` is checked against.

A foundation: pure tensor bookkeeping, no communication and no model, so that models,
parallel code and the calculator can all use it (``minidist.memory`` re-exports the ones
the lectures call: ``tensor_bytes``, ``saved_activation_bytes``, ``build_on_meta``).

``tensor_bytes(obj)``               bytes of the distinct storages reachable from obj
``saved_activation_bytes(fn, ...)`` bytes autograd saves for backward while fn runs
``saved_tensors(fn, ...)``          the tensors themselves, with their storage and shape
``build_on_meta(factory)``          build a model with shapes only; seconds and RSS it cost
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from minidist._proc import peak_rss_bytes, reset_peak_rss, rss_bytes

__all__ = [
    "MetaBuild",
    "SavedTensor",
    "build_on_meta",
    "saved_activation_bytes",
    "saved_tensors",
    "tensor_bytes",
]


# --------------------------------------------------------------------------------------------
# Measurement: bytes held by tensors
# --------------------------------------------------------------------------------------------
def _storage_key(t: torch.Tensor) -> tuple:
    """Identifies the storage under ``t``: two views of one buffer give the same key.

    On a real device the storage's address is the identity. A meta tensor has no address
    (data_ptr 0), so there we fall back to the tensor object's id: tied parameters (one
    Parameter under two names) still count once, but two views of one meta storage count twice.
    """
    storage = t.untyped_storage()
    ptr = storage.data_ptr()
    if ptr == 0:
        return ("object", id(t))
    return (str(t.device), ptr)


def _storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _collect(obj, out: list[torch.Tensor], seen: set[int]) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        if obj.grad is not None:
            out.append(obj.grad)
    elif isinstance(obj, nn.Module):
        for p in obj.parameters():
            _collect(p, out, seen)
        for b in obj.buffers():
            _collect(b, out, seen)
    elif isinstance(obj, torch.optim.Optimizer) or isinstance(getattr(obj, "state", None), Mapping):
        # an optimizer, or an optimizer-like wrapper (ZeroOptimizer) with a per-parameter ``state`` dict
        for state in obj.state.values():
            _collect(state, out, seen)
    elif isinstance(obj, Mapping):
        for value in obj.values():
            _collect(value, out, seen)
    elif isinstance(obj, list | tuple | set | frozenset):
        for value in obj:
            _collect(value, out, seen)


def tensor_bytes(obj) -> int:
    """Bytes of the distinct storages reachable from ``obj``; each storage counted once, in full.

    ``obj`` may be a tensor (its ``.grad`` too), an ``nn.Module`` (its parameters, their
    gradients, its buffers), an optimizer (its state: Adam's ``exp_avg``, ``exp_avg_sq``, ``step``
    -- not the parameters, count the model for those; any object with a ``state`` dict is taken
    as an optimizer), or lists / tuples / dicts / sets of these. Anything else (numbers, strings,
    None in an optimizer's state) holds no tensor memory and is skipped.

    Counting storages, not tensors, is what memory is: a view (``x[0]``, ``x.t()``) shares its
    base's storage and costs nothing more, a tied weight is one storage under two names, and a
    small view of a big buffer keeps the whole buffer alive -- so the whole buffer is counted.
    Meta tensors report what they would occupy (see ``_storage_key`` for how they are deduplicated).
    """
    tensors: list[torch.Tensor] = []
    _collect(obj, tensors, set())
    total, counted = 0, set()
    for t in tensors:
        key = _storage_key(t)
        if key not in counted:
            counted.add(key)
            total += _storage_nbytes(t)
    return total


@dataclass(frozen=True)
class SavedTensor:
    """One tensor autograd saved for backward: its shape, dtype, and the size of the storage under it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    storage_bytes: int
    new_storage: bool  # False when an earlier saved tensor already holds this storage


def _is_trainable_leaf(t: torch.Tensor) -> bool:
    """A parameter (or a view of one): a leaf that requires grad. Its storage exists anyway."""
    root = t._base if t._base is not None else t
    return root.is_leaf and root.requires_grad


def saved_tensors(fn: Callable, *args, **kwargs) -> tuple[object, list[SavedTensor]]:
    """Run ``fn(*args, **kwargs)`` and list every tensor autograd saves for backward, in order.

    Uses ``torch.autograd.graph.saved_tensors_hooks``: autograd calls our ``pack`` hook with each
    tensor it keeps for the backward pass (a linear's input, a softmax's output, a LayerNorm's
    input, mean and rstd, ...). Parameters are left out (they are held anyway; a saved weight
    is no new memory): a saved tensor is a parameter when it, or the tensor it is a view of, is
    a leaf that requires grad -- so pass inputs that do NOT require grad, or they are left out too.
    Returns ``(fn's result, list of SavedTensor)``; the result keeps the graph alive.
    """
    records: list[SavedTensor] = []
    keep: list[torch.Tensor] = []  # hold every saved tensor, so no storage is freed and its address reused
    seen: set[tuple] = set()

    def pack(t: torch.Tensor):
        if not _is_trainable_leaf(t):
            key = _storage_key(t)
            records.append(SavedTensor(tuple(t.shape), t.dtype, _storage_nbytes(t), key not in seen))
            seen.add(key)
            keep.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn(*args, **kwargs)
    return result, records


def saved_activation_bytes(fn: Callable, *args, **kwargs) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn(*args, **kwargs)`` runs.

    What counts: every tensor passed to autograd's pack hook (``saved_tensors``) that is not a
    parameter, each storage once and in full (a view such as Q split into heads shares the
    linear's output storage). Integer tensors count too (an embedding saves its token ids).
    What does not: parameters, tensors freed before backward that autograd did not save, and
    the output itself unless an op saved it. The graph is dropped when this returns.
    Under ``torch.utils.checkpoint`` (either flavour) only what the checkpoint keeps is seen:
    the region's inputs, not the tensors it will recompute.
    """
    _, records = saved_tensors(fn, *args, **kwargs)
    return sum(r.storage_bytes for r in records if r.new_storage)


# --------------------------------------------------------------------------------------------
# Measurement: resident memory of this process (Linux /proc)
# --------------------------------------------------------------------------------------------
# rss_bytes, peak_rss_bytes, reset_peak_rss: from minidist._proc (one copy, below offload and us).


class MetaBuild(NamedTuple):
    """``build_on_meta``'s result: the model (shapes only), seconds to build, resident memory it cost."""

    model: nn.Module
    seconds: float
    rss_increase_bytes: int


def build_on_meta(factory: Callable[[], nn.Module]) -> MetaBuild:
    """Build ``factory()`` under ``torch.device("meta")``: every parameter has a shape and no storage.

    That is how one inspects a 175B model on a laptop: OPT-175B's fp32 weights would take 698 GB,
    its meta version takes about a second and a few MB (the Python objects of 96 layers).
    ``rss_increase_bytes`` is the peak resident memory during the build minus the memory before
    it (the current RSS if the peak cannot be reset on this system).
    """
    can_reset = reset_peak_rss()
    before = rss_bytes()
    start = time.perf_counter()
    with torch.device("meta"):
        model = factory()
    seconds = time.perf_counter() - start
    after = peak_rss_bytes() if can_reset else rss_bytes()
    return MetaBuild(model, seconds, max(0, after - before))

"""Where the bytes of training go: a calculator, and the measurements that check it (layer 5).

Training a model holds four kinds of state on every rank:

    parameters      the weights themselves                               Ψ · bytes/param
    gradients       one per parameter                                    Ψ · bytes/grad
    optimizer       Adam's m and v (and, in mixed precision, an fp32     Ψ · K
                    master copy of the weights)
    activations     what the forward pass saves for the backward pass    ∝ batch · seq · layers

The first three depend on the parameter count Ψ only; ZeRO (Rajbhandari et al., 2020) shards
them over the data-parallel ranks, tensor parallelism splits the matrices, pipeline parallelism
splits the layers. Activations depend on the batch, the sequence and the recomputation policy
(Korthikanti et al., 2022). This module computes all of them per rank (``estimate``) and
measures the same quantities on real tensors (``tensor_bytes``, ``saved_activation_bytes``,
``rss_bytes``) so that each formula is checked against what torch actually holds.

Measurement
-----------
``tensor_bytes(obj)``               bytes of the distinct storages reachable from obj
``saved_activation_bytes(fn, ...)`` bytes autograd saves for backward while fn runs
``rss_bytes()``, ``peak_rss_bytes()``, ``reset_peak_rss()``   the process's resident memory (Linux)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "tensor_bytes",
    "saved_activation_bytes",
    "saved_tensors",
    "SavedTensor",
    "rss_bytes",
    "peak_rss_bytes",
    "reset_peak_rss",
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
    elif isinstance(obj, torch.optim.Optimizer):
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
    -- not the parameters, count the model for those), or lists / tuples / dicts of these.

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
    """
    _, records = saved_tensors(fn, *args, **kwargs)
    return sum(r.storage_bytes for r in records if r.new_storage)


# --------------------------------------------------------------------------------------------
# Measurement: resident memory of this process (Linux /proc)
# --------------------------------------------------------------------------------------------
def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """Resident set size now (VmRSS in /proc/self/status), in bytes. Raises on a system without /proc."""
    kib = _proc_status_kib("VmRSS")
    if kib is None:
        raise RuntimeError("rss_bytes needs Linux's /proc/self/status (VmRSS); not available here")
    return kib * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size (VmHWM, the 'high water mark') since start or the last ``reset_peak_rss``."""
    kib = _proc_status_kib("VmHWM")
    if kib is None:
        raise RuntimeError("peak_rss_bytes needs Linux's /proc/self/status (VmHWM); not available here")
    return kib * 1024


def reset_peak_rss() -> bool:
    """Reset the peak to the current RSS (write "5" to /proc/self/clear_refs); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True

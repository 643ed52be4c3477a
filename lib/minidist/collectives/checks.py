"""The collectives' checks: arguments, and whether the ranks agree on the call.

``collectives.api`` calls these before any message is sent, so a wrong argument raises at once
in the caller's thread; ``_agree_on_root`` is the one extra round broadcast and reduce need,
because their messages alone cannot expose a disagreement about the root.
"""

from __future__ import annotations

import torch

from ..comm import Communicator
from ..errors import MessageMismatch


def _check(comm: Communicator, tensor, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} expects a torch.Tensor, got {type(tensor).__name__}")
    if not isinstance(comm, Communicator):
        raise TypeError(
            f"{name}(comm, tensor, ...): the first argument must be the communicator (a "
            f"minidist.comm.Communicator), got {type(comm).__name__}"
        )


def _check_root(comm: Communicator, root: int, what: str) -> None:
    if not 0 <= root < comm.world_size:
        raise ValueError(f"{what}={root} is not a rank: ranks are 0..{comm.world_size - 1}")


def _describe(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')} {tuple(tensor.shape)}"


def _explained(name: str, error: MessageMismatch, advice: str | None = None) -> MessageMismatch:
    advice = advice or (
        "Every rank must pass a tensor of the same shape and dtype, with the same op, root and algorithm."
    )
    return MessageMismatch(f"{name}: the ranks do not agree ({error}). {advice}")


def _agree_on_root(comm: Communicator, tag: int) -> None:
    """One ring round of empty messages that carry the signature.

    Broadcast and reduce need it because their messages alone cannot expose a
    disagreement about the root: with two ranks that each believe they are the
    root, both would send and return (broadcast: each keeps its own tensor) or
    both would wait for the other (reduce). If the signatures are not all equal,
    some rank's left neighbour differs from it, and that rank raises. Cost: one
    latency, no payload bytes.
    """
    p, rank = comm.world_size, comm.rank
    nothing = torch.empty(0)
    work = comm.isend(nothing, (rank + 1) % p, tag)
    comm.recv(torch.empty(0), (rank - 1) % p, tag)
    work.wait()


def _check_split(comm: Communicator, tensors, recv_sizes) -> list[int] | None:
    """The list form of all_to_all: world_size tensors with one trailing shape, dtype and
    device; ``recv_sizes`` (optional) world_size counts whose own entry matches. Returns
    the counts as ints (or None: they will be exchanged)."""
    if not isinstance(comm, Communicator):
        raise TypeError(
            "all_to_all(comm, tensors, ...): the first argument must be the communicator (a "
            f"minidist.comm.Communicator), got {type(comm).__name__}"
        )
    p = comm.world_size
    if len(tensors) != p:
        raise ValueError(
            f"all_to_all with a list needs one tensor per rank (world_size={p}), got {len(tensors)}: "
            "pass an empty tensor (first dimension 0) for a rank that gets nothing"
        )
    for j, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"all_to_all: entry {j} of the list is a {type(t).__name__}, not a torch.Tensor")
        if t.dim() == 0:
            raise ValueError(f"all_to_all: entry {j} is a 0-dim tensor; the pieces are split along dim 0")
        first = tensors[0]
        if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"all_to_all: every tensor of the list must have the same trailing shape, dtype and device; "
                f"entry 0 is {_describe(first)} on {first.device}, entry {j} is {_describe(t)} on {t.device}"
            )
    if recv_sizes is None:
        return None
    sizes = [int(n) for n in recv_sizes]
    if len(sizes) != p or min(sizes) < 0:
        raise ValueError(f"recv_sizes needs {p} counts >= 0 (entry i: rows rank i sends here), got {sizes}")
    if sizes[comm.rank] != tensors[comm.rank].shape[0]:
        raise ValueError(
            f"recv_sizes[{comm.rank}]={sizes[comm.rank]}, but this rank's own piece has "
            f"{tensors[comm.rank].shape[0]} rows: entry i is what rank i sends here, this rank included"
        )
    return sizes

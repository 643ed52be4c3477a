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


def _explained(name: str, error: MessageMismatch) -> MessageMismatch:
    return MessageMismatch(
        f"{name}: the ranks do not agree ({error}). Every rank must pass a tensor of the same "
        "shape and dtype, with the same op, root and algorithm."
    )


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

"""A sub-communicator: some of the ranks of a communicator, renumbered 0..k-1.

A parameter-server job launches workers *and* servers in one ``md.launch``, but
data parallelism (DDP's initial broadcast, the workers' collectives) must run
among the workers only. ``SubComm(comm, ranks)`` is that group::

    full communicator     0    1    2  |  3 (server)  4 (server)
    SubComm(comm, [0,1,2]) 0    1    2     -- not a member --

It is a thin view (``comm.CommView``), like ``comm.PlainComm``: ``send(t, dst)`` is
``comm.send(t, ranks[dst])``, the same mailboxes and the same ``stats`` (traffic of a
member is counted once, whichever view sent it); no shared workspace, so collectives
on it run the point-to-point algorithms. Async collectives issued on it run on the
communication thread of the communicator it wraps (``inner``), so they are ordered
with everything else that rank sends. Closing it does not close ``inner``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..comm import Communicator, CommView, Handle


class SubComm(CommView):
    """The members ``ranks`` of ``inner`` (in that order), as a communicator of ``len(ranks)``."""

    def __init__(self, inner: Communicator, ranks: Sequence[int]) -> None:
        ranks = [int(r) for r in ranks]
        if not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"a group needs distinct ranks, got {ranks}")
        if not all(0 <= r < inner.world_size for r in ranks):
            raise ValueError(f"group ranks {ranks} must lie in 0..{inner.world_size - 1}")
        if inner.rank not in ranks:
            raise ValueError(
                f"rank {inner.rank} is not in the group {ranks}: only members may build it "
                "(test `comm.rank in ranks` first)"
            )
        super().__init__(inner, rank=ranks.index(inner.rank), world_size=len(ranks))
        self.ranks = ranks

    def __repr__(self) -> str:
        return f"SubComm({self.inner!r}, ranks={self.ranks})"

    # --- what the view changes: peers are renumbered, the barrier spans the members only ---
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._check_peer(dst, "send to")
        self.inner.send(tensor, self.ranks[dst], tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        self._check_peer(src, "receive from")
        return self.inner.recv(tensor, self.ranks[src], tag)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        self._check_peer(dst, "send to")
        return self.inner.isend(tensor, self.ranks[dst], tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        self._check_peer(src, "receive from")
        return self.inner.irecv(tensor, self.ranks[src], tag)

    def barrier(self) -> None:
        """Dissemination barrier among the members only (one-byte messages, ceil(log2 k) rounds)."""
        p = self.world_size
        token = torch.zeros(1, dtype=torch.uint8)
        for k in range(math.ceil(math.log2(p)) if p > 1 else 0):
            step = 1 << k
            work = self.isend(token, (self.rank + step) % p)
            self.recv(torch.empty(1, dtype=torch.uint8), (self.rank - step) % p)
            work.wait()

"""The push/pull protocol of the averaging architectures: a worker's DDP hook and a server's loop.

Workers are full ranks ``0..n-1`` and servers ``n..n+k-1`` of one
``md.launch``; DDP runs on ``group.SubComm(comm, range(n))`` while the hook talks over
the full communicator. A push to a server is a 32-byte header ``(step, bucket,
numel, dtype)`` and the piece; the server (``serve_summation``) reads one push from
every worker, checks they agree, and sends back the average. Pieces between workers
need no header (both sides know the partition). When training ends each worker's
``hook.close()`` sends a stop header (step = -1) to every server; a server returns
when all workers have stopped. All of it runs on the rank's communication thread
(``async_ops.stream_of``), so it overlaps backward like the default hook.

A worker, per bucket (``PushPullAveraging``)::

    push   every piece it does not own to the piece's owner (header first if a server)
    sum    the pieces it owns: the other workers' copies, then / n   (its summation service)
    reply  the averages of its pieces to every other worker
    pull   the average of every other piece from its owner

``RingAveraging`` is the default DDP hook (ring allreduce) with the same ``close()``;
``make_hook`` gives the hook of an architecture. Who owns which piece: ``partition.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...collectives.async_ops import stream_of
from ...comm import Communicator
from ...wire import DTYPES
from ..buckets import allreduce_average
from .partition import byteps_server_share, partition, servers_for

HEADER_NUMEL = 4  # int64: step, bucket, numel, dtype code
HEADER_BYTES = HEADER_NUMEL * 8
STOP = -1
_TAG = 11  # tag of every averaging message (a mismatch with another protocol is a clear error)


class PushPullAveraging:
    """A DDP comm hook: push the pieces of a bucket to their owners, pull the averages.

    ``comm`` is the *full* communicator (workers and servers); ``workers`` and
    ``servers`` are full ranks. Call ``close()`` after the last step (it stops the
    servers). ``hook(group_comm, flat, bucket_index)`` ignores ``group_comm``.
    """

    def __init__(self, comm: Communicator, workers: list[int], servers: list[int], server_share: float):
        if comm.rank not in workers:
            raise ValueError(f"rank {comm.rank} is not a worker {workers}: servers run serve_summation")
        self.comm, self.workers, self.servers = comm, list(workers), list(servers)
        self.server_share = server_share
        partition(1, self.workers, self.servers, server_share)  # validates the arguments
        self.step = -1
        self.closed = False

    def __call__(self, _group_comm, flat: torch.Tensor, bucket_index: int):
        if bucket_index == 0:  # DDP launches bucket 0 first in every step
            self.step += 1
        step = self.step
        return stream_of(self.comm).submit(
            f"push/pull of bucket {bucket_index}", lambda: self._push_pull(flat, bucket_index, step)
        )

    def _push_pull(self, flat: torch.Tensor, bucket: int, step: int) -> torch.Tensor:
        comm, me, n = self.comm, self.comm.rank, len(self.workers)
        pieces = partition(flat.numel(), self.workers, self.servers, self.server_share)
        sends = []
        for piece in pieces:  # push
            if piece.owner == me:
                continue
            if piece.owner in self.servers:
                header = torch.tensor([step, bucket, piece.numel, DTYPES.index(flat.dtype)])
                sends.append(comm.isend(header, piece.owner, tag=_TAG))
            sends.append(comm.isend(flat[piece.start : piece.stop], piece.owner, tag=_TAG))
        mine = next((p for p in pieces if p.owner == me), None)
        if mine is not None:  # my summation service: add the other workers' copies of my piece
            total = flat[mine.start : mine.stop].clone()
            incoming = torch.empty_like(total)
            for worker in self.workers:
                if worker != me:
                    total += comm.recv(incoming, worker, tag=_TAG)
            total /= n
        for work in sends:  # the pushed pieces may be overwritten only once they have left
            work.wait()
        replies = []
        if mine is not None:
            flat[mine.start : mine.stop] = total
            replies = [comm.isend(flat[mine.start : mine.stop], w, tag=_TAG) for w in self.workers if w != me]
        for piece in pieces:  # pull
            if piece.owner != me:
                comm.recv(flat[piece.start : piece.stop], piece.owner, tag=_TAG)
        for work in replies:
            work.wait()
        return flat

    def close(self) -> None:
        """Tell every server this worker is done (a header with step = -1). Idempotent."""
        if self.closed:
            return
        self.closed = True
        stop = torch.tensor([STOP, 0, 0, 0])
        for server in self.servers:
            self.comm.send(stop, server, tag=_TAG)


@dataclass(frozen=True)
class ServeReport:
    """What a summation server did: rounds summed (one per bucket per step), and
    the traffic of its whole run (``CommStats``)."""

    rounds: int
    stats: object


def serve_summation(comm: Communicator, workers: list[int]) -> ServeReport:
    """A summation server: until every worker has sent its stop header, read one push from
    each worker (in worker order), sum, divide by len(workers), send the average back.

    Cost per round of a piece of m bytes: receives n*(m + 32) bytes, sends n*m.
    """
    header = torch.empty(HEADER_NUMEL, dtype=torch.int64)
    rounds = 0
    while True:
        headers = [comm.recv(header, w, tag=_TAG).clone() for w in workers]
        stopped = [int(h[0]) == STOP for h in headers]
        if all(stopped):
            return ServeReport(rounds, comm.stats)
        if any(stopped) or any(not torch.equal(h, headers[0]) for h in headers):
            raise RuntimeError(
                f"server rank {comm.rank}: workers {workers} pushed different (step, bucket, numel, dtype) "
                f"headers {[h.tolist() for h in headers]} (step -1 = stopped): every worker must run "
                "the same steps with the same model and buckets"
            )
        _, _, numel, code = headers[0].tolist()
        total = torch.zeros(numel, dtype=DTYPES[code])
        incoming = torch.empty_like(total)
        for i, w in enumerate(workers):  # header i was read; its payload follows
            if i == 0:
                comm.recv(total, w, tag=_TAG)
            else:
                total += comm.recv(incoming, w, tag=_TAG)
        total /= len(workers)
        for work in [comm.isend(total, w, tag=_TAG) for w in workers]:
            work.wait()
        rounds += 1


class RingAveraging:
    """The default hook (ring allreduce, then / n) with the same ``close()`` as the others."""

    servers: list[int] = []

    def __init__(self) -> None:
        self._hook = functools.partial(allreduce_average, algorithm="ring")

    def __call__(self, comm: Communicator, flat: torch.Tensor, bucket_index: int):
        return self._hook(comm, flat, bucket_index)

    def close(self) -> None:
        pass


def make_hook(architecture: str, comm: Communicator, n_workers: int, n_servers: int = 0):
    """The comm hook of ``architecture`` for worker ``comm.rank`` (< n_workers) of the full
    communicator; servers are ranks n_workers .. n_workers + servers_for(...) - 1."""
    k = servers_for(architecture, n_servers)
    workers, servers = list(range(n_workers)), list(range(n_workers, n_workers + k))
    if comm.world_size != n_workers + k:
        raise ValueError(
            f"{architecture} with {n_workers} workers needs {k} server process(es): "
            f"launch world_size={n_workers + k}, got {comm.world_size}"
        )
    if architecture == "ring":
        return RingAveraging()
    share = {"central": 1.0, "sharded": 0.0}.get(architecture) if architecture != "byteps" else None
    if share is None:
        share = byteps_server_share(n_workers, k)
    return PushPullAveraging(comm, workers, servers, share)


__all__ = [
    "HEADER_BYTES",
    "HEADER_NUMEL",
    "STOP",
    "PushPullAveraging",
    "RingAveraging",
    "ServeReport",
    "make_hook",
    "serve_summation",
]

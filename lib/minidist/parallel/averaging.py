"""Who averages the gradients: four architectures, each a DDP communication hook.

Every data-parallel step ends with the same result -- each worker holds the average of
the n workers' gradients -- but *who* adds them up decides who sends how much::

    central server          sharded server (every node)   ring allreduce        BytePS
    W0  W1  W2              W0 <-> W1                      W0 -> W1             W0  W1  W2
      \\ | /                 \\    /                             ^     |            |\\  /|\\ /|
        S                      W2                          W2 <-----+            S0  S1  (CPU)
    server moves n*M        each serves 1/n, 2(n-1)/n*M    2(n-1)/n*M per rank  + worker shards

All four are *push/pull* of pieces of a bucket to the process that sums that piece:
``PushPullAveraging`` is given, per bucket, a partition of its elements into pieces
and the owner of each piece (a server rank or a worker rank). A worker pushes every
piece it does not own to its owner, sums the pieces it owns (its own "summation
service") and sends the averages back, then pulls every other piece's average:

* ``central_server``: one extra process owns the whole bucket. Worker traffic: M out,
  M in; the server receives n*M and sends n*M -- linear in n: the bottleneck.
* ``sharded_server``: no extra process; worker r owns 1/n of each bucket. That is a
  reduce-scatter (pushes) followed by an allgather (pulls), written as point-to-point
  messages so the parameter-server view is visible: each worker sends
  2(n-1)/n*M -- the same bytes as the ring, in n-1 messages per phase instead of n-1
  ring steps (more concurrent messages, no pipelining along a ring).
* ``ring_allreduce``: the default DDP hook with ``algorithm="ring"`` (for comparison).
* ``byteps``: k extra CPU-only summation servers *and* the workers' own summation
  services share each bucket. BytePS (Jiang et al., OSDI 2020, section 3.2) balances
  the busiest link: a worker sends x*M to the servers plus 2(n-1)/n*(1-x)*M for the
  worker shards; a server sends n*x*M/k. Equal when ::

      x = 2k(n-1) / (n^2 + kn - 2k)        (capped at 1: k >= n puts everything on servers)

  and then every machine sends 2n(n-1)/(n^2 + kn - 2k) * M: 2(n-1)/n*M with k = 0
  (allreduce), M with k = n (a sharded parameter server on CPU machines). A worker
  sends less as servers are added (for n >= 3; with n = 2 the ring already sends M).

Protocol. Workers are full ranks ``0..n-1`` and servers ``n..n+k-1`` of one
``md.launch``; DDP runs on ``group.SubComm(comm, range(n))`` while the hook talks over
the full communicator. A push to a server is a 32-byte header ``(step, bucket,
numel, dtype)`` and the piece; the server (``serve_summation``) reads one push from
every worker, checks they agree, and sends back the average. Pieces between workers
need no header (both sides know the partition). When training ends each worker's
``hook.close()`` sends a stop header (step = -1) to every server; a server returns
when all workers have stopped. All of it runs on the rank's communication thread
(``async_ops.stream_of``), so it overlaps backward like the default hook.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..collectives.async_ops import stream_of
from ..comm import Communicator
from ..wire import DTYPES
from .buckets import allreduce_average

ARCHITECTURES = ("central", "sharded", "ring", "byteps")
HEADER_NUMEL = 4  # int64: step, bucket, numel, dtype code
HEADER_BYTES = HEADER_NUMEL * 8
STOP = -1
_TAG = 11  # tag of every averaging message (a mismatch with another protocol is a clear error)


def byteps_server_share(n_workers: int, n_servers: int) -> float:
    """BytePS's optimal fraction of every bucket summed on the k CPU servers:
    x = 2k(n-1)/(n^2 + kn - 2k), capped at 1 (0 with no server)."""
    n, k = n_workers, n_servers
    if n < 1 or k < 0:
        raise ValueError(f"need n_workers >= 1 and n_servers >= 0, got {n}, {k}")
    if k == 0:
        return 0.0
    return min(1.0, 2 * k * (n - 1) / (n * n + k * n - 2 * k))


def _split(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) in ``parts`` contiguous near-equal ranges (the first ones one longer)."""
    size, extra = divmod(hi - lo, parts)
    bounds, start = [], lo
    for i in range(parts):
        stop = start + size + (i < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass(frozen=True)
class Piece:
    owner: int  # full rank of the process that sums it
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def partition(numel: int, workers: list[int], servers: list[int], server_share: float) -> list[Piece]:
    """Who sums which elements of a bucket of ``numel``: round(server_share * numel)
    elements split evenly over ``servers``, the rest evenly over ``workers``."""
    if not 0.0 <= server_share <= 1.0 or (server_share > 0 and not servers):
        raise ValueError(f"server_share must be in [0, 1] (0 without servers), got {server_share}")
    on_servers = round(server_share * numel) if servers else 0
    pieces = [Piece(s, a, b) for s, (a, b) in zip(servers, _split(0, on_servers, len(servers) or 1))]
    if on_servers < numel or not servers:
        pieces += [Piece(w, a, b) for w, (a, b) in zip(workers, _split(on_servers, numel, len(workers)))]
    return [p for p in pieces if p.numel > 0]


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


def servers_for(architecture: str, n_servers: int) -> int:
    """How many extra server processes ``architecture`` launches (central: 1; byteps: n_servers)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}: choose one of {ARCHITECTURES}")
    return {"central": 1, "byteps": n_servers}.get(architecture, 0)


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


def expected_bytes(
    numels: list[int], architecture: str, n_workers: int, n_servers: int = 0, element_size: int = 4
):
    """Payload bytes per step from the partition, per process: {"worker r" or "server s":
    (sent, received)}. Headers (32 bytes per push to a server) included. Not for "ring"."""
    k = servers_for(architecture, n_servers)
    workers, servers = list(range(n_workers)), list(range(n_workers, n_workers + k))
    share = {"central": 1.0, "sharded": 0.0}.get(architecture, byteps_server_share(n_workers, k))
    traffic = {r: [0, 0] for r in workers + servers}
    for numel in numels:
        for piece in partition(numel, workers, servers, share):
            m = piece.numel * element_size
            header = HEADER_BYTES if piece.owner in servers else 0
            for w in workers:
                if w != piece.owner:
                    traffic[w][0] += m + header  # push
                    traffic[w][1] += m  # pull
                    traffic[piece.owner][1] += m + header
                    traffic[piece.owner][0] += m
    return {
        (f"worker {r}" if r < n_workers else f"server {r - n_workers}"): tuple(v) for r, v in traffic.items()
    }


def push_pull_seconds(
    numels: list[int],
    architecture: str,
    n_workers: int,
    n_servers: int,
    alpha_s: float,
    bandwidth_Bps: float,
    element_size: int = 4,
) -> float:
    """The link-time model of one step of these hooks over ``EmulatedLinkComm`` (one
    outgoing link per process, buckets one after another). Ring: 2(n-1) messages of M/n.
    Push/pull: a push phase (the busiest worker sends its pushes one after another), then
    a pull phase (the busiest owner sends its piece to every other worker)."""
    n = n_workers
    total = 0.0
    for numel in numels:
        if architecture == "ring":
            total += 2 * (n - 1) * (alpha_s + numel * element_size / n / bandwidth_Bps)
            continue
        k = servers_for(architecture, n_servers)
        servers = list(range(n, n + k))
        share = {"central": 1.0, "sharded": 0.0}.get(architecture, byteps_server_share(n, k))
        pieces = partition(numel, list(range(n)), servers, share)
        push = pull = 0.0
        for worker in range(n):
            seconds = sum(
                (1 + (p.owner in servers)) * alpha_s
                + (p.numel * element_size + HEADER_BYTES * (p.owner in servers)) / bandwidth_Bps
                for p in pieces
                if p.owner != worker
            )
            push = max(push, seconds)
        for p in pieces:
            receivers = n - (p.owner < n)
            pull = max(pull, receivers * (alpha_s + p.numel * element_size / bandwidth_Bps))
        total += push + pull
    return total

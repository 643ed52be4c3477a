"""What one step of each averaging architecture costs: bytes per process, and time over a link.

Both follow from the partition (``partition.py``) and the protocol (``push_pull.py``):
every worker pushes each piece it does not own and pulls its average back (m bytes each
way, plus a 32-byte header on a push to a server); an owner receives n-1 copies of its
piece and sends n-1 averages. Per step, M bytes of gradient, n workers, k servers::

    central   worker: M out, M in        server: n*M out, n*M in (+ headers)
    sharded   worker: 2(n-1)/n*M out     (the same bytes as the ring allreduce)
    byteps    every machine 2n(n-1)/(n^2 + kn - 2k) * M out, at the balanced share x

The tests and ``python -m minidist.bench averaging`` compare these with ``comm.stats``
and with step times over ``EmulatedLinkComm``.
"""

from __future__ import annotations

from .partition import byteps_server_share, partition, servers_for
from .push_pull import HEADER_BYTES


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


__all__ = ["expected_bytes", "push_pull_seconds"]

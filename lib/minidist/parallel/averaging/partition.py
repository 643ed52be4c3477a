"""Who sums which elements of a bucket: the partition every averaging architecture is made of.

A bucket of ``numel`` elements is cut into contiguous pieces, each with an *owner*: the
process that receives every worker's copy of that piece, sums it and sends the average
back. ``server_share`` of the elements go to the summation servers (split evenly), the rest
to the workers themselves (split evenly)::

    central   server_share = 1, one server     [          server n          ]
    sharded   server_share = 0, no server      [ w0 | w1 | ... | w(n-1) ]
    byteps    server_share = x, k servers      [ s0 | s1 ][ w0 | w1 | ... ]

BytePS's x balances the busiest link (a worker sends x*M + 2(n-1)/n*(1-x)*M, a server
n*x*M/k): ``x = 2k(n-1) / (n^2 + kn - 2k)``, capped at 1. The protocol that moves the pieces
is ``push_pull.py``; what it sends, ``traffic.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = ("central", "sharded", "ring", "byteps")


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


def servers_for(architecture: str, n_servers: int) -> int:
    """How many extra server processes ``architecture`` launches (central: 1; byteps: n_servers)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}: choose one of {ARCHITECTURES}")
    return {"central": 1, "byteps": n_servers}.get(architecture, 0)


__all__ = ["ARCHITECTURES", "Piece", "byteps_server_share", "partition", "servers_for"]

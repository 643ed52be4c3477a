"""Routing: which servers run which blocks, a pure function of the servers' spans.

The swarm's lesson in lecture 9 has three steps: *route* (this module), *keep* each server's
inputs and *replay* them into a replacement (``failover``). A server holds a span of
consecutive blocks; the client needs blocks 0..L-1 run in order, so it picks a chain of
servers whose spans cover them. No process, socket or tensor here: ``plan_route`` takes
``{server: (start, end)}`` for the servers still alive and returns the hops, so it can be read
and tested on its own. When a server fails, the client asks again without it
(``Client.route`` asks with ``Swarm.alive_spans()``)::

    blocks      0     1     2     3
    server 0  [ ==== ==== ]                        plan_route(spans, 0, 4)
    server 1              [ ==== ==== ]              = [Hop(0, 0, 2), Hop(1, 2, 4)]
    server 2        [ ==== ==== ==== ]             server 1 dies: plan_route(alive, 2, 4)
                                                     = [Hop(2, 2, 4)]
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

__all__ = ["Hop", "RouteError", "even_spans", "plan_route"]


class RouteError(RuntimeError):
    """No chain of alive servers covers the blocks; ``missing`` lists the blocks nobody holds."""

    def __init__(self, missing: list[int], alive: dict[int, tuple[int, int]]) -> None:
        self.missing = missing
        held = ", ".join(f"server {i}: blocks {s}..{e - 1}" for i, (s, e) in sorted(alive.items())) or "none"
        super().__init__(
            f"no alive server holds block(s) {_ranges(missing)} (alive: {held}); start a swarm whose "
            "spans cover every block, e.g. with a spare server per span"
        )


def _ranges(blocks: list[int]) -> str:
    """[2, 3, 5] -> '2..3, 5'."""
    parts = []
    for _, group in itertools.groupby(enumerate(blocks), lambda p: p[1] - p[0]):
        run = [b for _, b in group]
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}..{run[-1]}")
    return ", ".join(parts)


class Hop(NamedTuple):
    """One leg of a route: ``server`` runs blocks ``start..end-1`` (a part of its span, or all)."""

    server: int
    start: int
    end: int


def plan_route(spans: dict[int, tuple[int, int]], start: int, end: int) -> list[Hop]:
    """The shortest chain of servers (fewest hops) that runs blocks ``start..end-1``, in order.

    Greedy: at block ``pos`` take, among the servers holding ``pos``, the one whose span reaches
    furthest (ties: the lowest index), let it run up to there, repeat. For intervals this is
    optimal: no chain with fewer hops gets past any point sooner. Fewest hops means fewest round
    trips, which dominate over a network. (Petals weighs hops by measured latency and throughput
    and runs a shortest-path search; with equal servers that reduces to this.)

        spans  0: [0, 2)   1: [2, 4)   2: [1, 4)        route(0, 4) = [0: 0..1, 1: 2..3]
        server 1 dies                                   route(2, 4) = [2: 2..3]  (part of its span)
    """
    hops, pos = [], start
    while pos < end:
        holders = [(e, -i) for i, (s, e) in spans.items() if s <= pos < e]
        if not holders:
            missing = [b for b in range(pos, end) if not any(s <= b < e for s, e in spans.values())]
            raise RouteError(missing, spans)
        reach, neg_i = max(holders)
        hops.append(Hop(-neg_i, pos, min(reach, end)))
        pos = min(reach, end)
    return hops


def even_spans(n_layers: int, n_servers: int) -> list[tuple[int, int]]:
    """``n_servers`` consecutive spans covering ``n_layers`` blocks, sizes differing by at most one."""
    if not 1 <= n_servers <= n_layers:
        raise ValueError(f"need 1 <= n_servers <= n_layers, got {n_servers} servers for {n_layers} blocks")
    bounds = [round(k * n_layers / n_servers) for k in range(n_servers + 1)]
    return list(zip(bounds[:-1], bounds[1:]))

"""Failover by replay: keep what each server was sent, replay it into a replacement.

The last two steps of lecture 9's lesson (the first, the route, is ``routing``).
``client.generate`` opens a session on every server of its route; each keeps a KV cache for
its blocks (``generate.span_step``), so a step sends one token's hidden state per hop. The
client also keeps, per hop, every hidden state it sent (the session's *history*). When a server
dies mid-generation, the client routes the dead server's blocks over other servers and
*replays* that history into them, entry by entry with the chunking and positions of the original
requests (the prompt, then one token per step), which rebuilds the same caches bit for bit, and
goes on: the continuation equals what an undisturbed run (and ``generate.generate``) produces.
Failover as data, not as luck: the state a server lost is a function of inputs the client kept.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from minidist.serve.swarm.adapters import _select
from minidist.serve.swarm.servers import RemoteError, ServerFailed

if TYPE_CHECKING:
    from minidist.serve.swarm.client import Client

__all__ = ["InferenceSession"]


@dataclass
class _SessionHop:
    server: int
    start: int
    end: int
    session: str | None = None  # opened on first use
    history: list[torch.Tensor] = field(default_factory=list)  # every hidden state sent to this hop


class InferenceSession:
    """A generation's state in the swarm: a KV cache on each server of the chain, and its history.

    Use it as a context manager, so the servers' caches are freed however the block ends (each
    server holds at most ``Swarm(max_sessions=...)`` sessions)::

        with client.inference_session(adapters) as session:
            out = session.step(client.embed(ids))               # the prompt: positions 0..T-1
            out = session.step(client.embed(next_ids, session.length))   # one more position

    ``step(hidden)`` sends ``hidden`` (B, T_new, d) (positions length..length+T_new) through the
    chain and returns the last block's output. If a server fails, its hop is replaced::

        hops:    [s0: 0..1] ──► [s1: 2..3]            s1 dies at step t
        history of hop s1:  h_0, h_1, ..., h_{t-1}  (each request's hidden states, kept on the client)
        route(2, 4) = [s2: 2..3]  ──  open a session on s2, send h_0 (past_len 0), h_1 (past_len
                                      T_0), ... -- the same requests s1 got, so s2 computes exactly
                                      what s1 computed and its cache equals s1's bit for bit; then
                                      step t as usual
    """

    def __init__(self, client: Client, adapters: dict | None = None) -> None:
        self.client, self.adapters = client, adapters
        self.hops = [_SessionHop(*hop) for hop in client.route()]
        self.length = 0

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, hop: _SessionHop, hidden: torch.Tensor, past_len: int) -> torch.Tensor:
        swarm = self.client.swarm
        if hop.session is None:
            hop.session = f"{os.getpid()}-{id(self)}-{next(self.client._session_ids)}"
            swarm.request(hop.server, "open", session=hop.session, blocks=(hop.start, hop.end))
        out = swarm.request(
            hop.server,
            "step",
            session=hop.session,
            hidden=hidden,
            past_len=past_len,
            adapters=_select(self.adapters, hop.start, hop.end),
        )
        hop.history.append(hidden)
        return out.to(hidden.device)

    def _replace(self, dead: _SessionHop) -> list[_SessionHop]:
        """New hops for the dead hop's blocks, their caches rebuilt by replaying its history.

        The history is replayed request by request (same chunks, same ``past_len``): sending it
        all at once would compute the same numbers in a different order (one (B, T, d) matmul
        instead of several), close but not bit-identical, and the continuation could drift.
        """
        failures = 0
        while True:
            new = [_SessionHop(*hop) for hop in self.client.route(dead.start, dead.end)]
            try:
                past_len = 0
                for chunk in dead.history:
                    x = chunk
                    for hop in new:
                        x = self._call(hop, x, past_len)
                    past_len += chunk.shape[1]
                return new
            except ServerFailed as error:
                self.client._record(error, (dead.start, dead.end), "replay")
                self._close_hops(new)  # sessions already rebuilt on servers that are still alive
                failures += 1
                if failures > len(self.client.swarm):
                    raise

    def step(self, hidden: torch.Tensor) -> torch.Tensor:
        x, k = hidden, 0
        while k < len(self.hops):
            hop = self.hops[k]
            try:
                out = self._call(hop, x, self.length)
            except ServerFailed as error:
                self.client._record(error, (hop.start, hop.end), "generate")
                self.hops[k : k + 1] = self._replace(hop)
                continue
            x, k = out, k + 1
        self.length += hidden.shape[1]
        return x

    def _close_hops(self, hops: list[_SessionHop]) -> None:
        for hop in hops:
            if hop.session is not None and self.client.swarm.alive(hop.server):
                with contextlib.suppress(ServerFailed, RemoteError):
                    self.client.swarm.request(hop.server, "close", session=hop.session)

    def close(self) -> None:
        """Drop the caches on the servers (those still alive)."""
        self._close_hops(self.hops)
        self.hops = []

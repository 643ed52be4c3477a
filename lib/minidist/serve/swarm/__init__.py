"""A Petals-style swarm: servers each hold a span of blocks, a client routes hidden states through them.

A 176B model does not fit one machine, but its 70 blocks can be spread over many: Petals
(Borzunov et al., 2023) lets volunteers each serve a few consecutive blocks, and a client that
holds only the embeddings and the head runs the model by sending hidden states from server
to server. Here each server is a process, and the "network" a socket per server::

                  client                               servers (one process each)
    ┌────────────────────────────────┐
    │ ids ─► embeddings ─► h (B,T,d) │ ── h ───►  server 0: blocks 0..1  (KV cache per session)
    │                                │ ◄─ h' ──┘
    │                                │ ── h' ──►  server 1: blocks 2..3  (KV cache per session)
    │ logits ◄─ head ◄─ final norm   │ ◄─ h'' ─┘
    │ (+ LoRA matrices, prompts)     │            server 2: blocks 0..3  (a spare, for failover)
    └────────────────────────────────┘

Only hidden states travel: B·T·d numbers per hop (with a KV cache, T = 1 per generated token),
never weights. The client talks to each server in turn (``route`` picks the chain).

At BLOOM-176B's scale: a block has 12·d² = 12·14336² ≈ 2.47e9 parameters, 2.47 GB in int8, so
a server with a 24 GB GPU holds about 8 blocks and 9 such servers cover all 70; per generated
token each hop carries one hidden state, 14336 values = 28,672 bytes in fp16, there and back.

One idea per module (read the first two for lecture 9's lesson: route, keep each server's
inputs, replay them into a replacement)::

    routing.py    plan_route, even_spans, Hop, RouteError: the chain of servers, a pure function
    failover.py   InferenceSession: KV caches on the servers, the history kept, replayed on failure
    servers.py    Swarm (the processes and their requests), ServerFailed, RemoteError
    client.py     Client: embeddings and head here; generate, forward, lm_forward
    adapters.py   a hop as an autograd node, LoRA matrices travelling with each request
    ../_server.py what a server process runs;  ../_wire.py  the message format

The throughput benchmark is ``minidist.bench.swarm`` (``python -m minidist.bench.swarm``): serving
is measured by ``bench``, never the reverse. Where this package sits among the library's layers: the package
docstring of ``minidist``.
"""

from __future__ import annotations

from minidist.serve.swarm.client import Client
from minidist.serve.swarm.failover import InferenceSession
from minidist.serve.swarm.routing import Hop, RouteError, even_spans, plan_route
from minidist.serve.swarm.servers import FORMATS, RemoteError, ServerFailed, ServerStats, Swarm

__all__ = [
    "FORMATS",
    "Client",
    "Hop",
    "InferenceSession",
    "RemoteError",
    "RouteError",
    "ServerFailed",
    "ServerStats",
    "Swarm",
    "even_spans",
    "plan_route",
]

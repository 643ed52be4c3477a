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

**Inference sessions.** ``client.generate`` opens a session on every server of its chain; each
keeps a KV cache for its blocks (``generate.span_step``), so a step sends one token's hidden
state per hop. The client also keeps, per hop, every hidden state it sent (the session
*history*). When a server dies mid-generation, the client routes the dead server's blocks over
other servers and *replays* that history into them, entry by entry with the chunking and positions
of the original requests (the prompt, then one token per step), which rebuilds the same caches bit
for bit, and goes on: the continuation equals what an undisturbed run (and ``generate.generate``)
produces.

**Training.** ``client.forward(hidden, adapters, prompts)`` is differentiable. Each hop is a
``torch.autograd.Function``: forward sends ``hidden`` (and the hop's LoRA matrices) for a
stateless forward; backward sends ``hidden`` and the output's gradient, and the server
*recomputes* its blocks with autograd and returns the gradients w.r.t. ``hidden`` and the LoRA
matrices (Petals does the same: a server keeps no activations between requests). The blocks stay
frozen; the adapters live on the client and travel with every request::

    adapters = {block index: {"query": (A, B), "value": (A, B)}, ..., "scale": s}
    #   A (r, d_in), B (d_out, r); the projection's output gets  s · (x Aᵀ) Bᵀ   (lora.lora_delta)
    client.forward(hidden (B, T, d), adapters=None, prompts=None) -> (B, P + T, d)
    #   prompts (P, d) or (B, P, d) are prepended to hidden; the result is the last block's output
    #   (before the final norm) for all P + T positions; gradients reach hidden, prompts, A and B
    client.lm_forward(input_ids, labels=None, adapters=None, prompts=None) -> CausalLMOutput
    #   embeddings (the prompt prepended before positions, as lora.prompt_forward), forward, head, loss

**Failures.** Every request has a deadline (``timeout``). A server that died shows up as a
closed connection, a stuck one as a missed deadline (it is then killed, so it cannot answer
late); both raise ``ServerFailed(server, reason)``, which the client handles by routing around
the server. When no alive server holds some blocks, ``RouteError`` names them. ``Swarm`` stops
and joins every server on exit, also when the client raised; servers exit by themselves when the
client process dies (their socket reports EOF; ``PR_SET_PDEATHSIG`` covers a busy server).

Layer 6: imports ``minidist.models`` (shards, generate, decoder), ``quant`` and ``launch``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import signal
import socket
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.multiprocessing as torch_mp
import torch.nn.functional as F
from torch import nn

from minidist import quant
from minidist.models import decoder, generate, shards
from minidist.models.transformer import Embeddings
from minidist.serve import _server, _wire

__all__ = [
    "Client",
    "Hop",
    "InferenceSession",
    "RemoteError",
    "RouteError",
    "ServerFailed",
    "Swarm",
    "even_spans",
    "format_throughput",
    "measure_throughput",
    "plan_route",
]

FORMATS = ("fp32", "bf16", "int8", "nf4")


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class ServerFailed(RuntimeError):
    """Server ``server`` died, closed its connection or missed a deadline (``reason`` says which)."""

    def __init__(self, server: int, reason: str) -> None:
        self.server, self.reason = server, reason
        super().__init__(f"swarm server {server} failed: {reason}")


class RemoteError(RuntimeError):
    """Server ``server`` is alive but raised while handling a request (a bad request, a bug)."""

    def __init__(self, server: int, op: str, remote_traceback: str) -> None:
        self.server, self.op, self.remote_traceback = server, op, remote_traceback
        last = remote_traceback.strip().splitlines()[-1] if remote_traceback.strip() else "?"
        super().__init__(f"swarm server {server} could not handle {op!r}: {last}\n{remote_traceback}")


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


# --------------------------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# The swarm: server processes and requests
# --------------------------------------------------------------------------------------------


@dataclass
class ServerStats:
    """Requests and bytes (headers included) the client exchanged with one server."""

    requests: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


def _stop_processes(processes: list, socks: list) -> None:
    """Close every socket (a server reading sees EOF and exits), wait briefly, SIGKILL the rest."""
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.close()
    deadline = time.monotonic() + 2.0
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(process.pid, signal.SIGKILL)
            process.join(timeout=5.0)


class Swarm:
    """Server processes, one per span; a context manager that stops them all on exit.

    ``Swarm(directory, spans=[(0, 2), (2, 4), (0, 4)], fmt="fp32", timeout=30.0)``

    directory           a checkpoint written by ``shards.save_sharded``
    spans               (start, end) per server: it holds blocks start..end-1, read from the shards
    fmt                 how servers store Linear weights: "fp32", "bf16", "int8", "nf4" (``quant``)
    timeout             seconds for each request (and for a server to load); a late server is killed
    device              where servers keep blocks and KV caches ("cpu", "cuda")
    threads_per_server  torch threads per server process
    start_method        "forkserver" (default: torch already imported, a server starts in well under a
                        second, as ``md.launch``) or "spawn" (a fresh interpreter per server)
    max_message_bytes   the largest message either side accepts (client and servers): a request over
                        it is refused before sending (ValueError), a reply over it comes back as a
                        ``RemoteError`` saying so; the server stays up (at least 4096)
    max_sessions        open inference sessions (KV caches) per server; ``open`` beyond it is a
                        ``RemoteError`` (close sessions: ``with client.inference_session() as s:``)

    ``request(i, op, **fields)`` is the raw call (see ``_server`` for the requests); ``kill(i)``
    SIGKILLs server i (the client notices at its next request, as it would a crashed machine).
    One request at a time per swarm: use it from one thread.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        spans: list[tuple[int, int]],
        fmt: str = "fp32",
        timeout: float = 30.0,
        *,
        device: str = "cpu",
        threads_per_server: int = 1,
        start_method: str = "forkserver",
        max_message_bytes: int = _wire.MAX_MESSAGE_BYTES,
        max_sessions: int = 64,
    ) -> None:
        self.directory = str(directory)
        self.config = shards.read_index(directory).config
        n = self.config.n_layers
        spans = [tuple(int(v) for v in span) for span in spans]
        for k, span in enumerate(spans):
            if len(span) != 2 or not 0 <= span[0] < span[1] <= n:
                raise ValueError(
                    f"span {k} is {span}: a span is (start, end) with 0 <= start < end <= {n} "
                    f"(the checkpoint has {n} blocks; the server holds blocks start..end-1)"
                )
        if not spans:
            raise ValueError("spans is empty: give at least one (start, end) span")
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; servers store weights in one of {FORMATS}")
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(
                f"start_method must be 'forkserver' or 'spawn' (no fork: CUDA), got {start_method!r}"
            )
        if not 4096 <= max_message_bytes <= _wire.MAX_MESSAGE_BYTES:
            raise ValueError(
                f"max_message_bytes must be between 4096 (room for an error's traceback) and "
                f"{_wire.MAX_MESSAGE_BYTES:,}, got {max_message_bytes!r}"
            )
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions!r}")
        self.spans: list[tuple[int, int]] = spans
        self.fmt, self.timeout, self.device = fmt, float(timeout), device
        self.threads_per_server, self.start_method = threads_per_server, start_method
        self.max_message_bytes, self.max_sessions = int(max_message_bytes), int(max_sessions)
        self.stats = [ServerStats() for _ in spans]
        self.info: list[dict] = []
        self._processes: list = []
        self._socks: list[socket.socket] = []
        self._failed: dict[int, str] = {}
        self._finalizer = None

    # --- life cycle ------------------------------------------------------------------------
    def __enter__(self) -> Swarm:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Start every server and wait until each has loaded its blocks (``timeout`` in all)."""
        if self._processes:
            raise RuntimeError("this Swarm is already started")
        context = torch_mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            context.set_forkserver_preload(["torch", "minidist"])
        self._finalizer = weakref.finalize(self, _stop_processes, self._processes, self._socks)
        try:
            for start, end in self.spans:
                ours, theirs = socket.socketpair()
                process = context.Process(
                    target=_server.serve,
                    args=(
                        theirs,
                        self.directory,
                        start,
                        end,
                        self.fmt,
                        self.device,
                        self.threads_per_server,
                        self.max_message_bytes,
                        self.timeout,
                        self.max_sessions,
                    ),
                    name=f"swarm-server-{len(self._processes)}",
                    daemon=True,
                )
                process.start()
                theirs.close()  # the server holds its end; ours must go, or its EOF never comes
                self._processes.append(process)
                self._socks.append(ours)
            deadline = time.monotonic() + self.timeout
            for i, sock in enumerate(self._socks):
                try:
                    reply, _ = _wire.recv_message(sock, self.max_message_bytes, deadline)
                except TimeoutError:
                    raise ServerFailed(i, f"did not load its blocks within {self.timeout} s") from None
                except (ConnectionError, OSError):
                    raise ServerFailed(i, f"{self._death_reason(i)} while loading its blocks") from None
                except (_wire.OversizedMessage, _wire.MalformedMessage) as error:
                    raise ServerFailed(i, f"sent a broken ready message: {error}") from None
                if "error" in reply:
                    raise ServerFailed(i, f"could not load blocks {self.spans[i]}:\n{reply['error']}")
                self.info.append(reply["ok"])
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop and join every server (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()  # runs _stop_processes once

    # --- state -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.spans)

    def alive(self, i: int) -> bool:
        """Server i is running and has not failed a request."""
        return i not in self._failed and i < len(self._processes) and self._processes[i].is_alive()

    def alive_spans(self) -> dict[int, tuple[int, int]]:
        return {i: span for i, span in enumerate(self.spans) if self.alive(i)}

    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def bytes_exchanged(self) -> int:
        return sum(s.bytes_sent + s.bytes_received for s in self.stats)

    def _death_reason(self, i: int) -> str:
        process = self._processes[i]
        process.join(timeout=1.0)
        code = process.exitcode
        if code is None:
            return "closed its connection but is still running"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"was killed by {signal.Signals(-code).name}"
            return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def _fail(self, i: int, reason: str) -> ServerFailed:
        """Mark server i failed, make sure it is gone (a late answer must never be read), return the error."""
        self._failed[i] = reason
        process = self._processes[i]
        if process.is_alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(process.pid, signal.SIGKILL)
            process.join(timeout=5.0)
        with contextlib.suppress(OSError):
            self._socks[i].close()
        return ServerFailed(i, reason)

    def kill(self, i: int) -> None:
        """SIGKILL server i, as if its machine crashed. The client finds out at its next request."""
        if not 0 <= i < len(self._processes):
            raise ValueError(f"no server {i}: this swarm has servers 0..{len(self._processes) - 1}")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self._processes[i].pid, signal.SIGKILL)
        self._processes[i].join(timeout=5.0)

    # --- requests --------------------------------------------------------------------------
    def request(self, i: int, op: str, timeout: float | None = None, **fields):  # noqa: ANN201
        """Send ``{"op": op, **fields}`` to server i and return its answer.

        Raises ``ServerFailed`` when the server is dead, closes the connection or does not answer
        within ``timeout`` (default: the swarm's) or sends a broken reply, ``RemoteError`` when it
        answers with an error (also: the reply would be over ``max_message_bytes``), ``ValueError``
        when the request itself is over ``max_message_bytes`` (nothing was sent).
        """
        if self._finalizer is None or not self._finalizer.alive:
            raise RuntimeError("this Swarm is not running: use it inside `with Swarm(...) as sw:`")
        if not 0 <= i < len(self._processes):
            raise ValueError(f"no server {i}: this swarm has servers 0..{len(self._processes) - 1}")
        if i in self._failed:
            raise ServerFailed(i, self._failed[i])
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        sock = self._socks[i]
        try:
            sent = _wire.send_message(sock, {"op": op, **fields}, self.max_message_bytes, deadline)
            reply, received = _wire.recv_message(sock, self.max_message_bytes, deadline)
        except TimeoutError:
            raise self._fail(
                i, f"no answer to {op!r} within {limit} s (stuck or overloaded); killed it"
            ) from None
        except (ConnectionError, OSError):
            raise self._fail(i, self._death_reason(i)) from None
        except (_wire.OversizedMessage, _wire.MalformedMessage) as error:
            # a server that knows our limit never announces more, and never sends a bad payload:
            # the stream (or the server) is broken, and nothing it sends can be trusted any more
            raise self._fail(i, f"sent a broken reply to {op!r}: {error}") from None
        stats = self.stats[i]
        stats.requests += 1
        stats.bytes_sent += sent
        stats.bytes_received += received
        if "error" in reply:
            raise RemoteError(i, op, reply["error"])
        return reply["ok"]


# --------------------------------------------------------------------------------------------
# Adapters: {block: {target: (A, B)}, "scale": s}  <->  flat lists for autograd
# --------------------------------------------------------------------------------------------


def _check_adapters(adapters: dict | None, n_layers: int) -> dict | None:
    if not adapters:
        return None
    if "scale" not in adapters:
        raise ValueError(
            'adapters need a "scale" entry (alpha / rank), e.g. {0: {"query": (A, B)}, "scale": 2.0}'
        )
    for key, targets in adapters.items():
        if key == "scale":
            continue
        if not isinstance(key, int) or not 0 <= key < n_layers:
            raise ValueError(f"adapter key {key!r}: use block indices 0..{n_layers - 1} (and 'scale')")
        for target, pair in targets.items():
            if target not in _server.LORA_TARGETS or len(pair) != 2:
                raise ValueError(
                    f"adapters[{key}][{target!r}]: give (A, B) for one of {_server.LORA_TARGETS}"
                )
    return adapters


def _select(adapters: dict | None, start: int, end: int) -> dict | None:
    """The adapters of blocks start..end-1 (what one hop needs), or None."""
    if not adapters:
        return None
    chosen = {k: v for k, v in adapters.items() if k != "scale" and start <= k < end}
    return {**chosen, "scale": float(adapters["scale"])} if chosen else None


def _flatten(adapters: dict | None) -> tuple[list[tuple[int, str]], list[torch.Tensor]]:
    keys, tensors = [], []
    for key, targets in (adapters or {}).items():
        if key == "scale":
            continue
        for target, (A, B) in targets.items():
            keys.append((key, target))
            tensors += [A, B]
    return keys, tensors


def _unflatten(keys: list[tuple[int, str]], scale: float, tensors) -> dict | None:
    if not keys:
        return None
    out: dict = {"scale": scale}
    for k, (key, target) in enumerate(keys):
        out.setdefault(key, {})[target] = (tensors[2 * k], tensors[2 * k + 1])
    return out


class _RemoteBlocks(torch.autograd.Function):
    """One hop as an autograd node: forward on the server, backward by the server's recomputation."""

    @staticmethod
    def forward(ctx, client, hop, keys, scale, hidden, *adapter_tensors):  # noqa: ANN001, ANN205
        adapters = _unflatten(keys, scale, [t.detach() for t in adapter_tensors])
        out = client.swarm.request(
            hop.server, "forward", hidden=hidden.detach(), blocks=(hop.start, hop.end), adapters=adapters
        )
        ctx.client, ctx.hop, ctx.keys, ctx.scale = client, hop, keys, scale
        ctx.save_for_backward(hidden, *adapter_tensors)
        return out.to(hidden.device)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        hidden, *adapter_tensors = ctx.saved_tensors
        adapters = _unflatten(ctx.keys, ctx.scale, adapter_tensors)
        grad_hidden, grad_adapters = ctx.client._backward_blocks(ctx.hop, hidden, grad_out, adapters)
        flat = []
        for key, target in ctx.keys:
            flat += list(grad_adapters[key][target])
        return (None, None, None, None, grad_hidden.to(hidden.device), *(g.to(hidden.device) for g in flat))


# --------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------


class Client:
    """Embeddings, final norm and head (tied word table) on this side; blocks on the swarm's servers.

    ``route()``            the chain of alive servers for blocks 0..L-1 (``plan_route``)
    ``generate(ids, n)``   greedy, with KV-cached inference sessions (``use_cache=True``) or by
                           resending the whole sequence every step; fails over (see the module doc)
    ``forward(...)``       differentiable, for training adapters and prompts (see the module doc)
    ``failovers``          what happened: one dict per server the client had to route around
    """

    def __init__(self, swarm: Swarm, device: str | torch.device = "cpu") -> None:
        self.swarm = swarm
        self.cfg = cfg = swarm.config
        self.device = torch.device(device)
        with torch.device("meta"):
            self.embeddings = Embeddings(cfg)
            self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps) if cfg.pre_ln else None
        for module, prefix in (
            (self.embeddings, "transformer.embeddings."),
            (self.final_norm, "transformer.final_norm."),
        ):
            if module is None:
                continue
            tensors = shards.load_tensors(swarm.directory, prefix=prefix, device=self.device)
            module.load_state_dict(
                {n[len(prefix) :]: t for n, t in tensors.items()}, strict=True, assign=True
            )
            module.requires_grad_(False).eval()
        self.failovers: list[dict] = []
        self._session_ids = itertools.count()

    # --- local parts -----------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, past_len: int = 0) -> torch.Tensor:
        """Word vectors (+ learned positions past_len..): the states entering block 0."""
        return generate.embed(self.embeddings, input_ids.to(self.device), past_len)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and the tied head: (B, T, d) -> (B, T, V)."""
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        return F.linear(hidden, self.embeddings.word.weight)

    def route(self, start: int = 0, end: int | None = None) -> list[Hop]:
        """The fewest-hop chain of alive servers for blocks start..end-1 (all blocks by default)."""
        return plan_route(self.swarm.alive_spans(), start, self.cfg.n_layers if end is None else end)

    def _record(self, error: ServerFailed, blocks: tuple[int, int], during: str) -> None:
        self.failovers.append(
            {"server": error.server, "blocks": blocks, "reason": error.reason, "during": during}
        )

    # --- training path ---------------------------------------------------------------------
    def forward(
        self, hidden: torch.Tensor, adapters: dict | None = None, prompts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """All blocks over ``hidden`` (B, T, d) through the swarm, differentiable (see the module doc).

        ``prompts`` (P, d) or (B, P, d) are prepended; returns (B, P + T, d), before the final norm.
        """
        if hidden.dim() != 3 or hidden.shape[-1] != self.cfg.hidden_size:
            raise ValueError(
                f"hidden must be (batch, seq, {self.cfg.hidden_size}), got {tuple(hidden.shape)}"
            )
        adapters = _check_adapters(adapters, self.cfg.n_layers)
        if prompts is not None:
            if prompts.dim() == 2:
                prompts = prompts.expand(hidden.shape[0], -1, -1)
            if (
                prompts.dim() != 3
                or prompts.shape[0] != hidden.shape[0]
                or prompts.shape[-1] != hidden.shape[-1]
            ):
                raise ValueError(
                    f"prompts must be (P, {hidden.shape[-1]}) or ({hidden.shape[0]}, P, {hidden.shape[-1]}), "
                    f"got {tuple(prompts.shape)}"
                )
            hidden = torch.cat([prompts.to(hidden.dtype), hidden], dim=1)
        scale = float(adapters["scale"]) if adapters else 1.0
        pos, failures = 0, 0
        while pos < self.cfg.n_layers:
            hop = self.route(pos)[0]
            keys, tensors = _flatten(_select(adapters, hop.start, hop.end))
            try:
                hidden = _RemoteBlocks.apply(self, hop, keys, scale, hidden, *tensors)
            except ServerFailed as error:  # route again from the same block, around the dead server
                self._record(error, (hop.start, hop.end), "forward")
                failures += 1
                if failures > len(self.swarm):
                    raise
                continue
            pos = hop.end
        return hidden

    def _backward_blocks(self, hop: Hop, hidden: torch.Tensor, grad_out: torch.Tensor, adapters: dict | None):
        """Gradients of blocks hop.start..hop.end-1 at ``hidden``: (grad_hidden, grad_adapters).

        Normally one backward request to the hop's server. If it died, the blocks are routed over
        other servers: forward through all but the last to get each one's input, then backward
        through them in reverse, summing the adapter gradients (each block's come from one server).
        """
        failures = 0
        chain = [hop]
        while True:
            try:
                inputs = [hidden]
                for h in chain[:-1]:
                    inputs.append(
                        self.swarm.request(
                            h.server,
                            "forward",
                            hidden=inputs[-1],
                            blocks=(h.start, h.end),
                            adapters=_select(adapters, h.start, h.end),
                        )
                    )
                grad, grad_adapters = grad_out, {}
                for h, x in zip(reversed(chain), reversed(inputs)):
                    answer = self.swarm.request(
                        h.server,
                        "backward",
                        hidden=x,
                        grad_out=grad,
                        blocks=(h.start, h.end),
                        adapters=_select(adapters, h.start, h.end),
                    )
                    grad = answer["hidden"]
                    grad_adapters.update(answer["adapters"])
                return grad, grad_adapters
            except ServerFailed as error:
                self._record(error, (hop.start, hop.end), "backward")
                failures += 1
                if failures > len(self.swarm):
                    raise
                chain = self.route(hop.start, hop.end)

    def lm_forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        adapters: dict | None = None,
        prompts: torch.Tensor | None = None,
    ) -> decoder.CausalLMOutput:
        """``DecoderLM(input_ids, labels)`` through the swarm, with LoRA ``adapters`` and soft ``prompts``.

        The prompt (P, d) is prepended to the *word* vectors; learned positions then cover all
        P + T positions (as ``lora.prompt_forward``). Logits are (B, P + T, V); the loss ignores
        the prompt positions' targets (the last prompt vector predicts the first token).
        """
        input_ids = input_ids.to(self.device)
        if prompts is None:
            hidden = self.embed(input_ids)
        else:
            emb, n_prompt = self.embeddings, prompts.shape[-2]
            x = emb.word(input_ids)
            prompts = prompts.expand(x.shape[0], -1, -1) if prompts.dim() == 2 else prompts
            x = torch.cat([prompts.to(x.dtype), x], dim=1)
            if emb.position is not None:
                if x.shape[1] > self.cfg.max_positions:
                    raise ValueError(
                        f"{n_prompt} prompt vectors + {input_ids.shape[1]} tokens = {x.shape[1]} positions, "
                        f"the model has {self.cfg.max_positions}: shorten the input or the prompt"
                    )
                x = x + emb.position(torch.arange(x.shape[1], device=x.device))[None]
            hidden = emb.norm(x) if emb.norm is not None else x
        logits = self.logits(self.forward(hidden, adapters))
        loss = None
        if labels is not None:
            decoder.check_labels(input_ids, labels)
            if prompts is not None:
                pad = labels.new_full((labels.shape[0], prompts.shape[-2]), decoder.IGNORE_INDEX)
                labels = torch.cat([pad, labels.to(pad.device)], dim=1)
            loss = decoder.next_token_loss(logits, labels.to(logits.device))
        return decoder.CausalLMOutput(loss, logits)

    # --- inference path --------------------------------------------------------------------
    def inference_session(self, adapters: dict | None = None) -> InferenceSession:
        """A KV-cached session over the current route (``with client.inference_session() as s:``)."""
        return InferenceSession(self, _check_adapters(adapters, self.cfg.n_layers))

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        use_cache: bool = True,
        adapters: dict | None = None,
        on_token: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Greedy decoding through the swarm; equal, token for token, to ``generate.generate``.

        ``use_cache=True`` sends the prompt once and then one position per step into an inference
        session; ``False`` sends the whole sequence every step (stateless ``forward``).
        ``on_token(t, ids)`` is called after the t-th new token (e.g. to kill a server for a demo).
        """
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(
                f"input_ids must be (batch, prompt_len >= 1), got shape {tuple(input_ids.shape)}"
            )
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        total = input_ids.shape[1] + max_new_tokens
        if self.cfg.position == "learned" and total > self.cfg.max_positions:
            raise ValueError(
                f"prompt of {input_ids.shape[1]} + {max_new_tokens} new tokens = {total} positions, but the "
                f"model has {self.cfg.max_positions}: shorten the prompt or ask for fewer tokens"
            )
        ids = input_ids.to(self.device)
        session = self.inference_session(adapters) if use_cache else None
        try:
            new_ids = ids
            for t in range(max_new_tokens):
                if session is not None:
                    out = session.step(self.embed(new_ids, session.length))
                else:
                    out = self.forward(self.embed(ids), adapters)
                next_id = self.logits(out)[:, -1].argmax(dim=-1)
                new_ids = next_id[:, None]
                ids = torch.cat([ids, new_ids], dim=1)
                if on_token is not None:
                    on_token(t + 1, ids)
        finally:
            if session is not None:
                session.close()
        return ids


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


# --------------------------------------------------------------------------------------------
# Throughput
# --------------------------------------------------------------------------------------------


def measure_throughput(
    directory: str | os.PathLike,
    servers: tuple[int, ...] = (2, 3),
    prompt_len: int = 16,
    new_tokens: int = 32,
    batch: int = 1,
    repeats: int = 3,
    fmt: str = "fp32",
    threads: int = 1,
    timeout: float = 120.0,
    seed: int = 0,
) -> dict:
    """Generated tokens/s locally and through swarms of ``servers`` servers, with and without KV cache.

    Every setup runs in each of ``repeats`` rounds, one after the other (side by side, so a busy
    machine slows all alike); the best round counts. The local model and every server use
    ``threads`` torch threads. Returns ``{"rows": [...], "ratios": {...}}``: a row per (setup,
    use_cache) with tokens_per_s, bytes_per_token (client <-> servers), vs_local (tokens/s over
    the local model's with the same use_cache) and same_tokens (equal to the local output);
    ratios["cache_speedup"][setup] = tokens/s with cache over without.
    """
    model = shards.load_decoder(directory).eval()
    if fmt != "fp32":
        quant.quantize_linear_weights(model, fmt)
    cfg = model.cfg
    prompt = torch.randint(cfg.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    previous_threads = torch.get_num_threads()
    rows: dict[tuple[str, bool], dict] = {}
    with contextlib.ExitStack() as stack:
        setups: dict[str, tuple[Callable, Swarm | None]] = {
            "local": (lambda n, cache: generate.generate(model, prompt, n, use_cache=cache), None)
        }
        for n in servers:
            swarm = stack.enter_context(
                Swarm(directory, even_spans(cfg.n_layers, n), fmt, timeout, threads_per_server=threads)
            )
            client = Client(swarm)
            setups[f"{n} servers"] = (
                lambda n_new, cache, c=client: c.generate(prompt, n_new, use_cache=cache),
                swarm,
            )
        torch.set_num_threads(threads)
        try:
            reference = {}
            for name, (run, _) in setups.items():  # warm-up, and the tokens every setup must give
                for cache in (True, False):
                    reference[name, cache] = run(new_tokens, cache)
            for _ in range(repeats):
                for name, (run, swarm) in setups.items():
                    for cache in (True, False):
                        before = swarm.bytes_exchanged() if swarm else 0
                        start = time.perf_counter()
                        run(new_tokens, cache)
                        seconds = time.perf_counter() - start
                        moved = (swarm.bytes_exchanged() if swarm else 0) - before
                        row = rows.setdefault((name, cache), {"seconds": math.inf})
                        if seconds < row["seconds"]:
                            row.update(seconds=seconds, bytes=moved)
        finally:
            torch.set_num_threads(previous_threads)
    local_ids = reference["local", True]
    out_rows = []
    for (name, cache), row in rows.items():
        tokens_per_s = batch * new_tokens / row["seconds"]
        local_tps = batch * new_tokens / rows["local", cache]["seconds"]
        out_rows.append(
            {
                "setup": name,
                "servers": 0 if name == "local" else int(name.split()[0]),
                "use_cache": cache,
                "tokens_per_s": tokens_per_s,
                "bytes_per_token": row["bytes"] / (batch * new_tokens),
                "vs_local": tokens_per_s / local_tps,
                "same_tokens": bool(torch.equal(reference[name, cache], local_ids)),
            }
        )
    speedup = {name: rows[name, False]["seconds"] / rows[name, True]["seconds"] for name in setups}
    return {
        "rows": out_rows,
        "ratios": {"cache_speedup": speedup},
        "config": {
            "n_layers": cfg.n_layers,
            "hidden": cfg.hidden_size,
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "batch": batch,
            "fmt": fmt,
            "threads": threads,
            "repeats": repeats,
        },
    }


def format_throughput(result: dict) -> str:
    """The rows of ``measure_throughput`` as a Markdown table."""
    lines = [
        "| setup | KV cache | tokens/s | vs local | bytes/token | same tokens |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['setup']} | {'yes' if r['use_cache'] else 'no'} | {r['tokens_per_s']:.1f} | "
            f"{r['vs_local']:.2f}x | {r['bytes_per_token']:,.0f} | {r['same_tokens']} |"
        )
    speedups = ", ".join(f"{k} {v:.1f}x" for k, v in result["ratios"]["cache_speedup"].items())
    return "\n".join(lines) + f"\n\nKV cache speed-up (tokens/s with over without): {speedups}"


def _main() -> None:  # python -m minidist.serve.swarm: the README's table on a random decoder
    import argparse

    parser = argparse.ArgumentParser(description="tokens/s locally and through a swarm of 2 and 3 servers")
    parser.add_argument("--config", default="mini", choices=["tiny", "mini", "small"])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fmt", default="fp32", choices=FORMATS)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = decoder.DecoderLM(decoder.CONFIGS[args.config])
    with tempfile.TemporaryDirectory(prefix="minidist-swarm-") as directory:
        shards.save_sharded(model, directory)
        result = measure_throughput(
            directory,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
            fmt=args.fmt,
        )
    print(f"decoder {args.config!r}: {result['config']}")
    print(format_throughput(result))


if __name__ == "__main__":
    _main()

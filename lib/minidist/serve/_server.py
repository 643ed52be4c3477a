"""One swarm server: a process that holds a span of blocks and answers requests over a socket.

Started by ``swarm.Swarm`` (never by hand). The server

1. loads blocks ``start..end-1`` from the shards (``shards.load_block``: the other blocks are
   never read), optionally stores their Linear weights in ``fmt`` (``quant``), freezes them;
2. answers ``{"op": ..., ...}`` requests one at a time with ``{"ok": value}`` or
   ``{"error": text}``:

   ==============  ===============================================================================
   open            start an inference session: an empty KV cache for blocks ``blocks=(a, b)``
   step            ``hidden`` (B, T_new, d) through blocks a..b-1 with the session's cache
                   (``past_len`` must equal the positions already cached); cache grows by T_new
   close           drop a session and its cache
   forward         stateless: ``hidden`` through blocks a..b-1 (no cache, no autograd)
   backward        stateless: recompute forward with autograd, return the gradients of
                   ``grad_out · output`` w.r.t. ``hidden`` and the LoRA matrices
   info / weights  what the server holds (span, format, bytes, sessions) / its block tensors
   sleep           test-only: do nothing for ``seconds`` (a stuck server)
   shutdown        reply, then exit
   ==============  ===============================================================================

3. exits when the client goes: the socket reports EOF when the client process dies, and
   ``PR_SET_PDEATHSIG`` kills the server if its parent dies while it computes.

A bad request never kills a server: a request over ``max_message_bytes`` is drained (read and
dropped) and answered with an error, so is a payload that is not a valid message
(``_wire.MalformedMessage``), and a reply over the limit is replaced by an error saying so.
The server waits for the next request without a deadline (an idle client is normal), then
gives reading the rest of it and sending the reply ``timeout`` seconds; a client that stops
reading or sending mid-message for that long is dropped (the server exits).

Each server keeps at most ``max_sessions`` open inference sessions (KV caches): ``open`` beyond
that is refused with an error, so a client that forgets to close its sessions (use ``with
client.inference_session() as s:``) cannot fill the server's memory.

LoRA matrices travel with each request (``adapters``; the server never stores them) and are
added to the query/value projections by forward hooks: ``out + lora_delta(x, A, B, scale)``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import traceback

import torch

from minidist import quant
from minidist.launch.worker import _die_with_parent, _release_fork_server
from minidist.models import generate, lora, shards
from minidist.serve import _wire

LORA_TARGETS = ("query", "key", "value", "output")


class SpanServer:
    """Blocks ``start..end-1`` of the checkpoint in ``directory``, frozen, and the sessions' caches."""

    def __init__(
        self, directory: str, start: int, end: int, fmt: str, device: str, max_sessions: int = 64
    ) -> None:
        self.max_sessions = max_sessions
        self.cfg = shards.read_index(directory).config
        self.start, self.end, self.fmt = start, end, fmt
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.blocks = []
        for i in range(start, end):
            block = shards.load_block(directory, i, device=self.device)
            if fmt != "fp32":
                quant.quantize_linear_weights(block, fmt)
            block.requires_grad_(False)  # a server never trains its blocks
            self.blocks.append(block.eval())
        self.sessions: dict[str, dict] = {}

    # --- helpers ---------------------------------------------------------------------------
    def _range(self, blocks: tuple[int, int] | None) -> tuple[int, int]:
        a, b = blocks if blocks is not None else (self.start, self.end)
        if not self.start <= a < b <= self.end:
            raise ValueError(f"blocks {a}..{b - 1} requested, this server holds {self.start}..{self.end - 1}")
        return a, b

    def _run(self, hidden: torch.Tensor, a: int, b: int, caches, past_len: int, adapters) -> torch.Tensor:
        with self._lora_hooks(adapters, a, b):
            return generate.span_step(
                self.blocks[a - self.start : b - self.start], self.cfg, hidden, caches, past_len
            )

    @contextlib.contextmanager
    def _lora_hooks(self, adapters: dict | None, a: int, b: int):
        """Add ``lora_delta(x, A, B, scale)`` to the outputs of the projections named in ``adapters``."""
        handles = []
        try:
            for i in range(a, b):
                for target, (A, B) in (adapters or {}).get(i, {}).items():
                    if target not in LORA_TARGETS:
                        raise ValueError(f"adapter target {target!r} unknown; use {LORA_TARGETS}")
                    layer = getattr(self.blocks[i - self.start].attention, target)
                    scale = adapters["scale"]

                    def hook(module, inputs, out, A=A, B=B, scale=scale):  # noqa: ANN001, ANN202
                        return out + lora.lora_delta(inputs[0], A, B, scale)

                    handles.append(layer.register_forward_hook(hook))
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _adapters_to(self, adapters: dict | None, requires_grad: bool) -> tuple[dict | None, list]:
        """Move the LoRA matrices to our device; with ``requires_grad`` also list them as leaves."""
        if not adapters:
            return None, []
        moved, leaves = {"scale": float(adapters.get("scale", 1.0))}, []
        for key, targets in adapters.items():
            if key == "scale":
                continue
            moved[key] = {}
            for target, pair in targets.items():
                A, B = (t.to(self.device).requires_grad_(requires_grad) for t in pair)
                moved[key][target] = (A, B)
                leaves.append((key, target, A, B))
        return moved, leaves

    # --- requests --------------------------------------------------------------------------
    def handle(self, request: dict):  # noqa: ANN201
        op = request.pop("op")
        handler = getattr(self, f"op_{op}", None)
        if handler is None:
            raise ValueError(f"unknown request {op!r}")
        return handler(**request)

    def op_info(self) -> dict:
        weight_bytes = sum(
            t.numel() * t.element_size()
            for block in self.blocks
            for t in (*block.parameters(), *block.buffers())
        )
        cache_bytes = sum(
            kv_t.numel() * kv_t.element_size()
            for s in self.sessions.values()
            for kv in s["cache"]
            if kv is not None
            for kv_t in kv
        )
        return {
            "span": (self.start, self.end),
            "fmt": self.fmt,
            "device": str(self.device),
            "pid": os.getpid(),
            "weight_bytes": weight_bytes,
            "sessions": len(self.sessions),
            "cache_bytes": cache_bytes,
        }

    def op_weights(self) -> dict:
        return {
            f"{shards.block_prefix(self.start + k)}{name}": t
            for k, block in enumerate(self.blocks)
            for name, t in block.state_dict().items()
        }

    def op_open(self, session: str, blocks=None) -> int:
        a, b = self._range(blocks)
        if session not in self.sessions and len(self.sessions) >= self.max_sessions:
            raise ValueError(
                f"this server already holds {len(self.sessions)} open sessions, its limit (max_sessions) is "
                f"{self.max_sessions}: close finished sessions (`with client.inference_session() as s:` "
                "closes them) or start the swarm with a larger max_sessions"
            )
        self.sessions[session] = {"blocks": (a, b), "cache": generate.KVCache(b - a)}
        return len(self.sessions)

    def op_close(self, session: str) -> bool:
        return self.sessions.pop(session, None) is not None

    @torch.no_grad()
    def op_step(self, session: str, hidden: torch.Tensor, past_len: int, adapters=None) -> torch.Tensor:
        if session not in self.sessions:
            raise ValueError(f"no open session {session!r} on this server: open it first")
        state = self.sessions[session]
        a, b = state["blocks"]
        adapters, _ = self._adapters_to(adapters, requires_grad=False)
        return self._run(hidden.to(self.device), a, b, state["cache"], past_len, adapters)

    @torch.no_grad()
    def op_forward(self, hidden: torch.Tensor, blocks=None, adapters=None) -> torch.Tensor:
        a, b = self._range(blocks)
        adapters, _ = self._adapters_to(adapters, requires_grad=False)
        return self._run(hidden.to(self.device), a, b, [None] * (b - a), 0, adapters)

    def op_backward(self, hidden: torch.Tensor, grad_out: torch.Tensor, blocks=None, adapters=None) -> dict:
        """Recompute the span's forward with autograd (nothing was kept from the forward request:
        the server is stateless for training, as Petals is) and backpropagate ``grad_out``."""
        a, b = self._range(blocks)
        adapters, leaves = self._adapters_to(adapters, requires_grad=True)
        with torch.enable_grad():
            x = hidden.to(self.device).requires_grad_(True)
            out = self._run(x, a, b, [None] * (b - a), 0, adapters)
            inputs = [x] + [t for _, _, A, B in leaves for t in (A, B)]
            grads = torch.autograd.grad(out, inputs, grad_out.to(self.device), allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads)]
        grad_adapters: dict = {}
        for k, (key, target, _, _) in enumerate(leaves):
            grad_adapters.setdefault(key, {})[target] = (grads[1 + 2 * k], grads[2 + 2 * k])
        return {"hidden": grads[0], "adapters": grad_adapters}

    def op_sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def serve(
    sock: socket.socket,
    directory: str,
    start: int,
    end: int,
    fmt: str,
    device: str,
    threads: int,
    max_message_bytes: int = _wire.MAX_MESSAGE_BYTES,
    timeout: float = 30.0,
    max_sessions: int = 64,
) -> None:
    """The server process's main function: load, say ready, answer requests until EOF or shutdown."""
    _die_with_parent()
    _release_fork_server()
    torch.set_num_threads(threads)
    sock.settimeout(None)
    try:
        server = SpanServer(directory, start, end, fmt, device, max_sessions)
        _wire.send_message(sock, {"ok": server.op_info()}, max_message_bytes, time.monotonic() + timeout)
    except BaseException:
        with contextlib.suppress(OSError, ValueError):
            _wire.send_message(sock, {"error": traceback.format_exc()}, max_message_bytes)
        return
    while True:
        try:
            length = _wire.recv_length(sock)  # no deadline: waiting for the client's next request
        except OSError:  # ConnectionError included: the client is gone (EOF), nobody to serve
            return
        deadline = time.monotonic() + timeout
        op = None
        try:
            if length > max_message_bytes:
                _wire.drain(sock, length, deadline)  # the stream is at a message boundary again
                reply = {
                    "error": f"request of {length:,} bytes is over this server's limit of "
                    f"{max_message_bytes:,} bytes (max_message_bytes): send smaller batches or "
                    "shorter sequences, or start the swarm with a larger max_message_bytes"
                }
            else:
                payload = _wire.recv_exact(sock, length, deadline)
                try:
                    request = _wire.decode(payload)
                    op = request.get("op") if isinstance(request, dict) else None
                    reply = {"ok": server.handle(request)} if op != "shutdown" else {"ok": True}
                except Exception:  # a malformed message or a failed request: answer, keep serving
                    reply = {"error": traceback.format_exc()}
            try:
                _wire.send_message(sock, reply, max_message_bytes, deadline)
            except ValueError as error:  # our reply is over the size limit: say so instead
                _wire.send_message(sock, {"error": str(error)}, max_message_bytes, deadline)
        except OSError:  # EOF, a broken pipe, or TimeoutError: the client stopped mid-message
            return
        if op == "shutdown":
            return

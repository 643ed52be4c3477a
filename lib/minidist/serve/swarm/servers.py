"""The swarm's servers: one process per span of blocks, and the one call a client makes to them.

``Swarm`` starts the processes (each runs ``_server.serve``; messages in ``_wire``'s format) and
sends requests with a deadline, ``request(i, op, **fields)``; it knows nothing of routes: those
are ``routing``'s, the sessions and their replay ``failover``'s, and the model ``client``'s.

**Failures.** Every request has a deadline (``timeout``). A server that died shows up as a
closed connection, a stuck one as a missed deadline (it is then killed, so it cannot answer
late); both raise ``ServerFailed(server, reason)``, which the client handles by routing around
the server. ``Swarm`` stops and joins every server on exit, also when the client raised; servers
exit by themselves when the client process dies (EOF on their socket, or ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
import weakref
from dataclasses import dataclass

import torch.multiprocessing as torch_mp

from minidist.models import shards
from minidist.serve import _server, _wire

__all__ = ["FORMATS", "RemoteError", "ServerFailed", "ServerStats", "Swarm"]

FORMATS = ("fp32", "bf16", "int8", "nf4")


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

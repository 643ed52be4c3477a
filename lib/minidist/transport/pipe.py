"""Pipe transport: a full mesh of one-way OS pipes, one per ordered pair of ranks.

``p`` ranks need ``p (p - 1)`` pipes. A message is a 160-byte header followed
by the tensor's raw bytes -- written straight from the tensor's memory and read
straight into the receive buffer (``send_bytes`` / ``recv_bytes_into``), so
nothing is pickled. Every byte still crosses the kernel twice (a copy into the
pipe buffer, a copy out), in pieces of the pipe's buffer (64 KiB by default on
Linux; ``_grow_pipe`` asks for 1 MiB), which is why a pipe is slower than
shared memory and why the time to send a message grows linearly with its size.

Small messages (up to ``INLINE_BYTES``) travel in the same write as their
header: one system call instead of two. Large ones follow their header as
a raw byte stream, written with ``os.write`` from the tensor's memory and read
with ``os.readv`` into the receive buffer.

Like MPI's standard-mode send, a send returns once the data is in the pipe:
small messages are buffered by the kernel, but a large one waits until the
receiver reads it. Two ranks that both ``send`` a large tensor before they
``recv`` deadlock; use ``isend``/``irecv`` for exchanges.

A peer that is gone -- returned, exited, killed -- is noticed without any
timeout: its ends of our pipes close, so a read waiting for it gets end-of-file
and a write to it a broken pipe, both turned into ``PeerError``. That works
only if no other process holds a copy of those ends: the launcher drops its
copies once every rank has started, and a forked rank closes the inherited
ends of the other ranks' pipes (``transport.release_launcher_copies`` and
``transport.foreign_fds``).
"""

from __future__ import annotations

import os
import time
from multiprocessing import Pipe

import numpy as np
import torch

from ..comm import CompletedWork
from ..errors import PeerError
from ..wire import HEADER_INTS
from .base import BaseComm

HEADER_BYTES = HEADER_INTS * 8
INLINE_BYTES = 32 * 1024
CHUNK_BYTES = 64 * 1024 * 1024
PIPE_BUFFER_BYTES = 1 << 20


def allocate_pipes(world_size: int):
    """All ``p (p - 1)`` one-way pipes; rank r gets ``writers[(r, d)]`` and ``readers[(s, r)]``."""
    readers, writers = {}, {}
    for src in range(world_size):
        for dst in range(world_size):
            if src != dst:
                readers[(src, dst)], writers[(src, dst)] = Pipe(duplex=False)
                _grow_pipe(writers[(src, dst)].fileno())
    return {"readers": readers, "writers": writers}


def _grow_pipe(fd: int) -> None:
    """Ask Linux for a 1 MiB pipe buffer instead of 64 KiB: 16x fewer context switches
    per large message. Unprivileged processes may go up to /proc/sys/fs/pipe-max-size."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BUFFER_BYTES)
    except (ImportError, OSError):
        pass  # not Linux, or a lower limit: the default buffer works, just slower


def resources_for_rank(resources, rank: int, world_size: int):
    """Only the pipe ends rank ``rank`` uses (each process holds just its own ends)."""
    return {
        "writers": {d: resources["writers"][(rank, d)] for d in range(world_size) if d != rank},
        "readers": {s: resources["readers"][(s, rank)] for s in range(world_size) if s != rank},
    }


class PipeComm(BaseComm):
    """Point-to-point over OS pipes (see the module docstring)."""

    name = "pipe"

    def __init__(self, rank, world_size, resources, local_rank=None, device="cpu", timeout=None):
        super().__init__(rank, world_size, local_rank, device, timeout)
        self._writers = resources["writers"]
        self._readers = resources["readers"]
        self._inline = {}  # src -> payload bytes that arrived with the header
        self._capacity: dict[int, int] = {}

    def isend(self, tensor, dst, tag=0):
        """Eager when the pipe has room for the whole small message: the write cannot
        block then, so it is done right here instead of in a background thread."""
        conn = self._writers.get(dst) if type(dst) is int else None
        if (
            conn is not None
            and type(tensor) is torch.Tensor
            and not tensor.is_cuda
            and tensor.is_contiguous()
            and tensor.nbytes <= INLINE_BYTES
            and self._send_queues.idle(dst)
            and self._room(conn) >= HEADER_BYTES + tensor.nbytes + 16
        ):
            self.send(tensor, dst, tag)
            return CompletedWork(tensor)
        return super().isend(tensor, dst, tag)

    def _room(self, conn) -> int:
        """Free bytes in the pipe's buffer (Linux: capacity minus unread bytes), else 0."""
        try:
            import array
            import fcntl
            import termios

            fd = conn.fileno()
            capacity = self._capacity.get(fd)
            if capacity is None:
                capacity = self._capacity[fd] = fcntl.fcntl(fd, getattr(fcntl, "F_GETPIPE_SZ", 1032))
            unread = array.array("i", [0])
            fcntl.ioctl(fd, termios.FIONREAD, unread, True)
            return capacity - unread[0]
        except (ImportError, OSError):
            return 0

    def _send_message(self, header, payload, dst):
        conn = self._writers[dst]
        n = payload.numel()
        try:
            if n <= INLINE_BYTES:
                conn.send_bytes(header.tobytes() + payload.numpy().tobytes())
                return
            conn.send_bytes(header.tobytes())
            # The payload follows as a raw byte stream: os.write straight from the
            # tensor's memory (Connection.send_bytes would add framing per piece).
            data, fd, offset = memoryview(payload.numpy()), conn.fileno(), 0
            while offset < n:
                offset += os.write(fd, data[offset : offset + CHUNK_BYTES])
        except (BrokenPipeError, ConnectionResetError) as error:
            raise PeerError(
                f"rank {self.rank} could not send to rank {dst}: its pipe is closed "
                f"(rank {dst} returned, exited or crashed)"
            ) from error

    def _wait_readable(self, src: int) -> None:
        conn = self._readers[src]
        if conn.poll(0):
            return
        start = time.monotonic()
        if not conn.poll(self.timeout):
            raise PeerError(
                f"rank {self.rank} waited {time.monotonic() - start:.1f} s for a message from "
                f"rank {src} (timeout {self.timeout} s): is rank {src} alive and doing the "
                "matching send?"
            )

    def _recv_header(self, src):
        self._wait_readable(src)
        try:
            message = self._readers[src].recv_bytes()
        except EOFError as error:
            raise PeerError(
                f"rank {self.rank} was waiting for a message from rank {src}, but rank {src} "
                "closed its pipe (it returned, exited or crashed)"
            ) from error
        header = np.frombuffer(message[:HEADER_BYTES], dtype=np.int64).copy()
        self._inline[src] = message[HEADER_BYTES:]
        return header

    def _recv_payload(self, out, header, src):
        n = int(header[2])
        inline = self._inline.pop(src)
        if n <= INLINE_BYTES:
            if n:
                out.numpy()[:] = np.frombuffer(inline, dtype=np.uint8)
            return
        # os.readv fills the receive buffer in place (Connection.recv_bytes_into would
        # first collect the whole message in a temporary buffer: one more copy).
        target, fd, offset = memoryview(out.numpy()), self._readers[src].fileno(), 0
        while offset < n:
            self._wait_readable(src)
            got = os.readv(fd, [target[offset : offset + CHUNK_BYTES]])
            if got == 0:
                raise PeerError(f"rank {src} closed its pipe in the middle of a message to rank {self.rank}")
            offset += got

    def close(self):
        super().close()
        for conn in [*self._writers.values(), *self._readers.values()]:
            conn.close()

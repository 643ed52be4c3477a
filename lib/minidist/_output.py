"""Copying workers' stdout/stderr into ours, line by line, prefixed with the rank.

Without it, ``print`` in a worker started from Jupyter goes to the terminal that
runs the kernel, not to the notebook.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any


class OutputForwarder:
    """Copies each worker's stdout/stderr to ours, line by line, prefixed with the rank."""

    def __init__(self) -> None:
        self._streams: dict[int, tuple[int, Any, bytearray, bool]] = {}
        self._wake_r, self._wake_w = os.pipe()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="minidist-output", daemon=True)

    def add(self, rank: int, conn, err: bool) -> None:
        self._streams[conn.fileno()] = (rank, conn, bytearray(), err)

    def start(self) -> None:
        self._thread.start()

    def _emit(self, rank: int, data: bytes, err: bool) -> None:
        stream = sys.stderr if err else sys.stdout
        text = data.decode(errors="replace")
        with contextlib.suppress(Exception):
            stream.write(f"[rank {rank}] {text}")
            stream.flush()

    def _run(self) -> None:
        import selectors

        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ)
        for fd in self._streams:
            selector.register(fd, selectors.EVENT_READ)
        open_fds = set(self._streams)
        while open_fds:
            events = selector.select(timeout=0.5)
            if self._stop and not events:
                break
            for key, _ in events:
                fd = key.fd
                if fd == self._wake_r:
                    os.read(fd, 64)
                    continue
                rank, _conn, buffer, err = self._streams[fd]
                chunk = os.read(fd, 65536)
                if not chunk:
                    selector.unregister(fd)
                    open_fds.discard(fd)
                    continue
                buffer += chunk
                while b"\n" in buffer:
                    line, _, rest = bytes(buffer).partition(b"\n")
                    buffer[:] = rest
                    self._emit(rank, line + b"\n", err)
        for rank, _conn, buffer, err in self._streams.values():
            if buffer:
                self._emit(rank, bytes(buffer) + b"\n", err)
        selector.close()

    def stop(self) -> None:
        """Drain what is left (briefly: a leftover grandchild may hold a pipe open)."""
        self._stop = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        for _rank, conn, _buffer, _err in self._streams.values():
            conn.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

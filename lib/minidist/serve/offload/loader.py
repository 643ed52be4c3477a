"""Prefetch: a thread reads block i + 1 from the shards while block i computes.

    time ─────────────────────────────────────────────────────────────────────►
    prefetch=False   [read 0][run 0][read 1][run 1][read 2][run 2] ...
    prefetch=True    [read 0][run 0   ][run 1   ][run 2   ] ...         (main thread)
                             [read 1] [read 2] [read 3]     ...         (loader thread)

With ``prefetch=True`` a background thread reads block i + 1 while block i computes, so reading
and computing overlap (the same idea as ZeRO-3's prefetch of the next unit). At most two blocks
are resident: the one computing and the one being read. The loader is asked for block i + 1 only
once block i is in hand, so it never runs further ahead -- a queue alone would not bound this:
a loader blocked on a full queue of depth 1 already holds a third block in its hands.

``streamed.StreamedDecoder`` owns a ``_Loader`` and gives it its ``_read_block``; ``budget``
counts the two blocks.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref

import torch
from torch import nn


def _touch_pages(module: nn.Module) -> None:
    """Read one byte of every page of every weight, so the pages are in memory before the compute.

    The tensors are mapped from the shard: reading a page the first time is a page fault that
    brings it in (from the page cache, or from the disk). One byte per page is enough: the kernel
    maps whole pages. This is the "read" that prefetching moves to the loader thread.
    """
    page = 4096
    for t in module.state_dict().values():
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1).view(torch.uint8)
        flat[::page].sum()
        flat[-1:].sum()


class _Loader:
    """A daemon thread that reads blocks on request: ``submit(i)`` then ``result(i)``.

    One request at a time is outstanding (the caller asks for block i + 1 only when it holds
    block i), so at most two blocks exist. Errors travel back with the block index and are
    raised in the caller; the thread keeps serving. Each request carries a serial number, so a
    late answer to a request the caller gave up on (a timeout) is recognised and dropped, never
    taken for a later request's block. ``close()`` stops the thread (idempotent).
    """

    def __init__(self, load: weakref.WeakMethod, timeout: float) -> None:
        self._load = load
        self._timeout = timeout
        self._requests: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._serial = 0
        self._outstanding: int | None = None  # the block index asked for and not yet collected
        self._thread = threading.Thread(target=self._serve, name="minidist-block-loader", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            request = self._requests.get()
            if request is None:
                return
            serial, i = request
            try:
                load = self._load()  # a weak reference: a forgotten model can still be collected
                if load is None:
                    raise RuntimeError("the StreamedDecoder was garbage-collected")
                item = (serial, load(i), None)
                del load
            except BaseException as e:  # carried to the caller, never lost in this thread
                item = (serial, None, e)
            self._results.put(item)
            del item  # else this thread would hold the block until the next request: a third block

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, i: int) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the loader thread has stopped: the StreamedDecoder was closed")
        if self._outstanding is not None:
            raise RuntimeError(f"block {self._outstanding} was requested and not collected")
        self._serial += 1
        self._outstanding = i
        self._requests.put((self._serial, i))

    def result(self, i: int) -> nn.Module:
        """Block ``i`` (waits for it); a failed read raises its ``BlockLoadError`` here."""
        if self._outstanding != i:
            raise RuntimeError(f"block {i} was not requested (outstanding: {self._outstanding})")
        self._outstanding = None
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                serial, block, error = self._results.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError(f"the loader thread stopped before delivering block {i}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"block {i} was not read within {self._timeout:g} s: is the disk that slow? "
                        "pass a larger load_timeout to StreamedDecoder"
                    ) from None
                continue
            if serial != self._serial:
                del block  # the late answer to an abandoned request
                continue
            if error is not None:
                raise error
            return block

    def discard(self) -> None:
        """Collect and drop the outstanding block, if any (after an interrupted pass)."""
        if self._outstanding is not None:
            try:
                self.result(self._outstanding)
            except Exception:
                pass

    def close(self) -> None:
        if self._thread.is_alive():
            self._requests.put(None)
            self._thread.join(timeout=self._timeout)
        self._outstanding = None

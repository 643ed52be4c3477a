"""Handles: what ``isend``/``irecv`` and every asynchronous operation return.

A handle stands for an operation in flight. ``Handle`` is the interface (a ``typing.Protocol``):
``wait()`` blocks until it is done and returns its tensor, ``is_completed()`` does not block,
``add_done_callback(fn)`` calls ``fn(handle)`` when it finishes. ``Waitable`` is the least a
DDP comm hook may return (just ``wait()``).

The library's handles: ``Work`` (an operation finished by a background thread; the async
collectives' ``CollectiveWork`` is one), ``CompletedWork`` (finished before it was returned),
and ``DerivedWork`` (another handle with a step to run after it: decompress, divide, copy back).
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Waitable(Protocol):
    """The least a DDP comm hook may return: ``wait()`` gives the averaged gradient."""

    def wait(self, timeout: float | None = None) -> torch.Tensor | None: ...


@runtime_checkable
class Handle(Protocol):
    """An operation in flight: ``isend``/``irecv``, an async collective, a DDP bucket's allreduce.

    ``wait(timeout)`` blocks until it is done, re-raises its error, and returns its tensor
    (or None); ``is_completed()`` does not block; ``add_done_callback(fn)`` calls
    ``fn(handle)`` when it finishes (at once if it already has).
    """

    def wait(self, timeout: float | None = None) -> torch.Tensor | None: ...

    def is_completed(self) -> bool: ...

    def add_done_callback(self, callback: Callable[[Handle], None]) -> None: ...


_CALLBACK_LOCK = threading.Lock()  # orders add_done_callback against _finish (rarely contended)


class Work:
    """Handle of an ``isend``/``irecv``. ``wait()`` blocks until the operation is
    done and re-raises its error, if any; ``is_completed()`` does not block.
    ``add_done_callback(fn)`` calls ``fn(work)`` when it finishes (at once if it
    already has), in the thread that finished it -- how a trace learns when a
    message really ended rather than when someone got round to waiting for it."""

    _callbacks: list | None = None
    _timeout_hint = ""  # said after "did not complete within ... s"

    def __init__(self, description: str, tensor: torch.Tensor | None = None) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.description = description
        self.tensor = tensor

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        with _CALLBACK_LOCK:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            try:
                callback(self)
            except Exception:  # a broken callback must not end the thread that finished the work
                traceback.print_exc()

    def add_done_callback(self, callback: Callable[[Handle], None]) -> None:
        with _CALLBACK_LOCK:
            if not self.is_completed():
                self._callbacks = [*(self._callbacks or ()), callback]
                return
        callback(self)

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> torch.Tensor | None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.description} did not complete within {timeout} s{self._timeout_hint}")
        if self._error is not None:
            raise self._error
        return self.tensor


class CompletedWork(Work):
    """The handle of an operation that finished before ``isend`` returned
    (e.g. a small message copied straight into a free mailbox slot)."""

    def __init__(self, tensor: torch.Tensor | None = None) -> None:  # no Event: it is cheap
        self.tensor = tensor
        self._error = None

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> torch.Tensor | None:
        return self.tensor


class DerivedWork:
    """A handle whose operation is another handle's (``work``), with something to do after it.

    ``wait()`` waits for ``work`` and returns ``self.finish(result)``, computed once (a
    second ``wait()`` returns the same); ``is_completed()`` and ``add_done_callback`` are
    ``work``'s. A subclass writes ``finish``: decompress, divide, copy back, time it.
    """

    def __init__(self, work: Handle) -> None:
        self.work = work
        self._finished = False
        self._result: torch.Tensor | None = None

    def finish(self, result: torch.Tensor | None) -> torch.Tensor | None:
        return result

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def add_done_callback(self, callback: Callable[[Handle], None]) -> None:
        self.work.add_done_callback(lambda _work: callback(self))

    def wait(self, timeout: float | None = None) -> torch.Tensor | None:
        result = self.work.wait(timeout)
        if not self._finished:
            self._result, self._finished = self.finish(result), True
        return self._result

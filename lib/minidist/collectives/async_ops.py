"""Asynchronous collectives: one communication thread per communicator.

``md.allreduce(comm, t, async_op=True)`` (and broadcast, reduce, allgather,
reduce_scatter) checks its arguments right away, in the caller's thread, and
then hands the collective to this communicator's *communication thread*. The
caller gets a ``CollectiveWork`` handle and keeps computing::

    caller thread   | allreduce(a) ─┐  compute ...  allreduce(b) ─┐  h_a.wait()  h_b.wait()
    comm thread     |               └─[ allreduce a ]─────────────┴─[ allreduce b ]
                                                     (b waits for a: one queue, call order)

Why one thread and one queue: a collective is a sequence of messages that
every rank must produce in the same order. If two collectives ran at once on
two threads, rank 0 could send a piece of ``b`` while rank 1 still expects a
piece of ``a``. Running them one after another, in call order, on every rank,
keeps the ranks in step as long as every rank *issues* its collectives in the
same order -- the same rule as torch.distributed.

* A blocking collective called while async ones are pending goes through the
  same queue and waits for its own turn, so the order is always the call order.
  With nothing pending it runs inline (no thread hand-off, no extra latency).
* The thread starts on the first async call (a daemon), and ``comm.close()``
  stops it after the queued work has run. A view of a communicator
  (``comm.without_shortcuts()``, ``EmulatedLinkComm``) uses the thread of the
  communicator it wraps: their messages share one channel, so they share one queue.
* An error in the thread is kept in the handle and raised by ``wait()``. It
  also breaks the stream: the ranks are no longer in step, so collectives queued
  behind it are not run, and every later collective on this communicator raises
  ``CollectiveStreamError`` naming the first failure -- an error is never lost.
* Issue collectives from one thread per rank (the training loop's); the call order
  of one thread is what the ranks agree on.
* Point-to-point calls on the same communicator while async collectives are in
  flight are the caller's responsibility (they may interleave with the
  collective's messages; use tags or wait first).

This module needs nothing of ``comm`` beyond the ``Communicator`` interface and, for views,
``CommView.inner`` (the communicator that owns the channel): the work itself is a function
the collectives API builds, so it runs on every transport.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from ..comm import Communicator, CommView, Work

#: how long ``comm.close()`` waits for queued collectives to finish before it gives up on them
CLOSE_WAIT_S = 10.0
# Where a communicator keeps its stream; ``comm.stop_collective_stream`` (called by every
# ``close()``) looks for the same name, so the lower layer need not import this one.
_ATTRIBUTE = "_collective_stream"


class CollectiveStreamError(RuntimeError):
    """A collective was not run because an earlier one on the same communicator failed."""


class CollectiveWork(Work):
    """Handle of an asynchronous collective (a ``comm.Work``: the same three methods).

    ``wait(timeout=None)`` blocks until the collective has run and returns its
    result (the in-place tensor, or the new tensor of allgather/reduce_scatter);
    it re-raises the collective's error. ``is_completed()`` never blocks.
    ``add_done_callback(fn)`` calls ``fn(work)`` once it has finished (at once, in
    the caller's thread, if it already has; else in the communication thread):
    how a trace learns when a collective really ended, not when someone waited.
    """

    _timeout_hint = (
        " (still queued or running on the communication thread: is every rank issuing the same collectives?)"
    )

    def _finish(self, result: torch.Tensor | None, error: BaseException | None) -> None:  # type: ignore[override]
        self.tensor = result
        super()._finish(error)

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        return f"<CollectiveWork {self.description}: {state}>"


class CollectiveStream:
    """The communication thread of one communicator and its FIFO of collectives."""

    def __init__(self, comm: Communicator) -> None:
        self.rank = comm.rank
        self.device = torch.device(comm.device)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.pending = 0  # submitted, not finished
        self.failure: tuple[str, BaseException] | None = None  # (description, error) of the first failure
        self.thread: threading.Thread | None = None
        self._count = 0

    # --- the caller's side --------------------------------------------------------
    def submit(self, name: str, func: Callable[[], torch.Tensor | None]) -> CollectiveWork:
        """Queue ``func`` (one collective) and return its handle."""
        with self._lock:
            self._count += 1
            work = CollectiveWork(f"rank {self.rank}: {name} (collective #{self._count} of this stream)")
            self._raise_if_broken(work.description)
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, name=f"minidist-collectives-rank{self.rank}", daemon=True
                )
                self.thread.start()
            self.pending += 1
        self._jobs.put((func, work))
        return work

    def run(self, name: str, func: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        """A blocking collective: inline when nothing is queued, else in its turn."""
        if threading.current_thread() is self.thread:  # called from inside a queued collective
            return func()
        with self._lock:
            idle = self.pending == 0
            if idle:
                self._raise_if_broken(f"rank {self.rank}: {name}")
        if idle:
            return func()
        return self.submit(name, func).wait()

    def _raise_if_broken(self, what: str) -> None:
        if self.failure is not None:
            first, error = self.failure
            raise CollectiveStreamError(
                f"{what} was not run: {first} failed before it ({type(error).__name__}: {error}); "
                "after a failed collective the ranks are out of step -- fix the first error"
            ) from error

    # --- the communication thread --------------------------------------------------
    def _run(self) -> None:
        if self.device.type == "cuda" and self.device.index is not None:  # the current GPU is per thread
            torch.cuda.set_device(self.device)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            func, work = job
            result, error = None, None
            try:
                with self._lock:
                    self._raise_if_broken(work.description)
                result = func()
            except BaseException as caught:  # kept for wait(); never lost
                error = caught
                with self._lock:
                    if self.failure is None:
                        self.failure = (work.description, caught)
            with self._lock:
                self.pending -= 1
            work._finish(result, error)

    def stop(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Let the queued collectives run, then end the thread (called by ``comm.close()``)."""
        thread = self.thread
        if thread is None:
            return
        self._jobs.put(None)
        if thread is not threading.current_thread():
            thread.join(wait_s)


def _owner(comm: Communicator):
    """The communicator that owns the channel: a view (``comm.CommView``: ``without_shortcuts()``,
    ``SubComm``, ``EmulatedLinkComm``) uses the channel of the communicator it wraps, ``inner``."""
    while isinstance(comm, CommView):
        comm = comm.inner
    return comm


def stream_of(comm: Communicator) -> CollectiveStream:
    """The stream of ``comm``'s channel, created on first use (its thread starts on first submit).

    A view shares the stream of the communicator it wraps: collectives issued on
    ``comm`` and on ``comm.without_shortcuts()`` are still run one at a time, in
    call order, because their messages travel through the same mailboxes.
    """
    comm = _owner(comm)
    stream = getattr(comm, _ATTRIBUTE, None)
    if stream is None:
        stream = CollectiveStream(comm)
        setattr(comm, _ATTRIBUTE, stream)
    return stream


def run_collective(
    comm: Communicator, name: Callable[[], str], func: Callable[[], torch.Tensor | None], async_op: bool
):
    """What every public collective does once its arguments are checked:
    ``async_op=True`` -> queue ``func`` and return a ``CollectiveWork``;
    otherwise run it (behind any pending async ones) and return its result.
    ``name()`` describes the call for errors (built only when needed: the blocking
    path of a communicator never used asynchronously pays nothing)."""
    if async_op:
        return stream_of(comm).submit(name(), func)
    stream = getattr(_owner(comm), _ATTRIBUTE, None)
    if stream is None:  # never used asynchronously: the plain blocking path
        return func()
    return stream.run(name(), func)

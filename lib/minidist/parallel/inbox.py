"""Receive from whichever peer speaks first.

``comm.recv(t, src)`` needs to know ``src``. A server that answers many workers
must instead react to whoever sends next -- MPI's ``MPI_ANY_SOURCE``. We build it
from blocking receives: one daemon thread per peer waits for that peer's next
message and puts it into one queue, which the server reads in arrival order::

    worker 1 --> [thread 1] --\\
    worker 2 --> [thread 2] ----> queue --> server loop: src, message = inbox.get()
    worker 3 --> [thread 3] --/

``read(comm, src)`` says how to read one whole message from ``src`` (it may be
several tensors); a message it returns as None ends that peer's thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable

from ..comm import Communicator


class Inbox:
    def __init__(
        self, comm: Communicator, sources: Iterable[int], read: Callable[[Communicator, int], object]
    ):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._listen, args=(comm, src, read), name=f"inbox-{src}", daemon=True)
            for src in sources
        ]
        for thread in self._threads:
            thread.start()

    def _listen(self, comm: Communicator, src: int, read) -> None:
        while True:
            try:
                message = read(comm, src)
            except BaseException as error:  # hand it to the server loop, which re-raises it
                self._queue.put((src, error))
                return
            self._queue.put((src, message))
            if message is None:
                return

    def get(self, timeout: float | None = None) -> tuple[int, object]:
        """The next (source, message); re-raises a listener's error; None means the source is done."""
        try:
            src, message = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no message from any peer within {timeout} s") from None
        if isinstance(message, BaseException):
            raise RuntimeError(f"receiving from rank {src} failed: {message}") from message
        return src, message

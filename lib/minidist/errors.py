"""Exceptions raised by minidist.

Every error names the rank it concerns and says what to do, because in a
multi-process program the hard part of debugging is knowing *who* failed.
"""

from __future__ import annotations


class WorkerError(RuntimeError):
    """A worker rank raised, exited early or was killed.

    Attributes:
        rank: the rank that failed first (the root cause, when it can be told).
        exc_type: name of the remote exception class ("" when the rank died
            without raising, e.g. ``os._exit`` or a signal).
        remote_traceback: the traceback text from the worker process.
        exitcode: the worker's exit code when it died (negative: killed by signal).
        other_failures: ``{rank: one-line description}`` of ranks that failed too,
            usually as a consequence (a peer waiting on the dead rank).
    """

    def __init__(
        self,
        rank: int,
        message: str,
        *,
        exc_type: str = "",
        remote_traceback: str = "",
        exitcode: int | None = None,
        other_failures: dict[int, str] | None = None,
    ) -> None:
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode
        self.other_failures = dict(other_failures or {})
        self.summary = message
        text = f"rank {rank} failed: {message}"
        if remote_traceback:
            text += f"\n\n--- remote traceback of rank {rank} ---\n{remote_traceback.rstrip()}"
        if self.other_failures:
            text += "\n\n--- other ranks ---"
            for other, what in sorted(self.other_failures.items()):
                text += f"\nrank {other}: {what}"
        super().__init__(text)


class LaunchTimeout(TimeoutError):
    """Workers were still running when ``launch``'s timeout expired.

    Attributes:
        ranks: the ranks that had not finished.
        stacks: ``{rank: Python stack text}`` captured just before they were killed.
        timeout: the timeout in seconds.
    """

    def __init__(self, ranks: list[int], stacks: dict[int, str], timeout: float) -> None:
        self.ranks = list(ranks)
        self.stacks = dict(stacks)
        self.timeout = timeout
        text = (
            f"ranks {self.ranks} were still running after {timeout:g} s and were killed. "
            "A common cause is a deadlock: two ranks both waiting in recv, or a rank that "
            "skipped a collective the others entered. Where each rank was stuck:"
        )
        for rank in self.ranks:
            stack = self.stacks.get(rank, "").rstrip() or "(no stack captured)"
            text += f"\n\n--- rank {rank} ---\n{stack}"
        super().__init__(text)


class PeerError(RuntimeError):
    """The rank at the other end of a point-to-point operation is gone."""


class MessageMismatch(ValueError):
    """A received message does not match the receive buffer (shape, dtype or kind)."""

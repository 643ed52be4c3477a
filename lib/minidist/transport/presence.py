"""Who is still there: a shared table of the ranks' processes.

A rank that waits for a message spins on a counter in shared memory. If the
peer that should bump it has exited -- its function returned, it raised, or it
was killed -- nothing ever will, and without this table the waiter would wait
until the launcher's timeout. (Pipes do not need it: a pipe whose writer is
gone reports end-of-file.)

The launcher allocates one row per rank in shared memory::

    row r:  [ pid of rank r | state: 0 not started, 1 running, 2 closed ]

Each rank writes its own row when it connects and again when it closes its
communicator; a waiter reads the row of the peer it waits for, now and then
(only in the slow, sleeping phase of a wait, so the fast path pays nothing).
A peer is *gone* when its row says closed, or when its process no longer
exists (killed: it had no chance to write "closed").
"""

from __future__ import annotations

import os
import sys

import torch

NOT_STARTED, RUNNING, CLOSED = 0, 1, 2


def allocate_presence(world_size: int) -> torch.Tensor:
    """Launcher side: the shared (world_size, 2) int64 table, all "not started"."""
    return torch.zeros(world_size, 2, dtype=torch.int64).share_memory_()


def _process_gone(pid: int) -> bool:
    """True when process ``pid`` has exited (a zombie, exited but not yet reaped, counts)."""
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # it exists, and belongs to someone else
    if sys.platform.startswith("linux"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            return fields[0] == b"Z"  # zombie: dead, waiting for its parent to reap it
        except (OSError, IndexError):
            return True  # /proc/pid vanished between the two checks
    return False


class PeerPresence:
    """This rank's view of the shared table (see the module docstring)."""

    def __init__(self, table: torch.Tensor, rank: int) -> None:
        self.table = table
        self.rank = rank

    def arrive(self, pid: int | None = None) -> None:
        """Record this process (or process ``pid``) as rank ``rank``, running."""
        self.table[self.rank, 0] = os.getpid() if pid is None else pid
        self.table[self.rank, 1] = RUNNING

    def leave(self) -> None:
        """Record that rank ``rank`` will send and receive nothing more."""
        self.table[self.rank, 1] = CLOSED

    def absence(self, peer: int) -> str | None:
        """Why ``peer`` will never answer (a phrase to put after "rank N"), or None if it may."""
        pid, state = (int(v) for v in self.table[peer].tolist())
        if state == CLOSED:
            return "has closed its communicator (its function returned or raised)"
        if state == RUNNING and pid != os.getpid() and _process_gone(pid):
            return f"has exited or was killed (its process {pid} is gone)"
        return None

"""Shared-memory transport: one mailbox per ordered pair of ranks.

The launcher allocates, for every pair (src -> dst), a block of shared memory
that both processes map. Sending is a memcpy into the block and one integer
store; receiving is one integer load and a memcpy out. No pickling, no system
call, no kernel copy on the data path -- which is why this transport beats
sockets by a wide margin on one machine.

The mailboxes' layout, their allocation and the memory-ordering argument: ``shm_layout.py``.

Waiting: a tight spin first (lowest latency when each rank has its own core),
then ``time.sleep(0)`` (yields the GIL and the CPU), then short sleeps, so that
more ranks than cores still make progress. While sleeping, the waiter looks
now and then at the peer's row in the presence table (``presence.py``): a peer
that has closed its communicator or whose process is gone raises ``PeerError``
instead of a wait that never ends.

This module is the teaching path: ``MailboxComm`` moves every message through
``BaseComm``'s generic protocol (header check, statistics, queues).
``shm_fastpath.ShmComm``, what ``transport="shm"`` runs, adds a shortcut for
messages that fit in one slot, and ``shm_workspace`` the block that all ranks share.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ..errors import PeerError
from ..wire import HEADER_INTS
from .base import BaseComm
from .presence import PeerPresence
from .shm_layout import (
    DIGEST_INT,
    LENGTH_INT,
    PRESENCE_CHECK_EVERY,
    TAG_INT,
    TORCH_COPY_ABOVE,
    _Mailbox,
    header_digest,
)
from .shm_workspace import PIECE_BYTES, SLOT_BYTES, SharedWorkspace


class MailboxComm(BaseComm):
    """Point-to-point over shared-memory mailboxes (see the module docstring)."""

    name = "shm"

    def __init__(self, rank, world_size, resources, local_rank=None, device="cpu", timeout=None):
        super().__init__(rank, world_size, local_rank, device, timeout)
        self.chunk = resources["chunk"]
        self.slots = resources["slots"]
        boxes = resources["boxes"]
        self._out = {
            d: _Mailbox(boxes[(rank, d)], self.chunk, self.slots) for d in range(world_size) if d != rank
        }
        self._in = {
            s: _Mailbox(boxes[(s, rank)], self.chunk, self.slots) for s in range(world_size) if s != rank
        }
        block = resources.get("workspace")
        self._workspace = (
            None
            if block is None
            else SharedWorkspace(
                block,
                world_size,
                resources.get("workspace_slot", SLOT_BYTES),
                resources.get("workspace_piece", PIECE_BYTES),
            )
        )
        table = resources.get("presence")
        self._presence = None if table is None else PeerPresence(table, rank)
        if self._presence is not None:
            self._presence.arrive()
        # spin long only if every rank can have a core of its own
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self._spin = 5000 if world_size <= cores else 200  # ~0.25 ms, then yield

    @property
    def shared_workspace(self) -> SharedWorkspace | None:
        """The block every rank maps (for ``collectives.shm_allreduce``)."""
        return self._workspace

    def peek_tag(self, src: int) -> int | None:
        """The tag of the next message from ``src`` not yet received, or None if there is none.

        Lets a rank waiting somewhere else (e.g. in the workspace allreduce) see
        that ``src`` is in a different operation.
        """
        box = self._in.get(src)
        if box is None or box.sent.value <= box.local:
            return None
        return int(box.headers[box.local % self.slots, TAG_INT])

    def _threads_busy(self) -> bool:
        for queues in (self._send_queues, self._recv_queues):
            for peer_queue in queues.values():
                if peer_queue.pending:
                    return True
        return False

    def wait_at_least(
        self, counter, value: int, peer: int, what: str, check: Callable[[], None] | None = None
    ) -> None:
        """Wait until ``counter.value >= value`` (spin, then yield, then sleep).

        A spinning thread holds the GIL: while an isend/irecv is running in one of
        our background threads, spin only briefly and then yield with sleep(0),
        or that thread would wait up to the interpreter's 5 ms switch interval
        before it may copy its next chunk.

        In the sleeping phase, every ``PRESENCE_CHECK_EVERY`` seconds, ``peer``'s
        presence is checked (``PeerError`` if it is gone) and ``check()`` is
        called, if given (it raises to end the wait).
        """
        spin = self._spin if not self._threads_busy() else 20
        while counter.value < value:
            spin -= 1
            if spin <= 0:
                break
        else:
            return
        start = time.monotonic()
        deadline = self._deadline()
        next_look = start + 0.002
        pause = 0.0
        while counter.value < value:
            time.sleep(pause)
            if counter.value >= value:
                # done while we slept: return before check(), which would otherwise look at
                # the peers' next messages and could take them for a disagreement
                return
            now = time.monotonic()
            if now - start > 0.002:  # nothing for 2 ms: stop burning the CPU
                pause = min(1e-3, max(pause * 2, 2e-5))
            if now >= next_look:
                next_look = now + PRESENCE_CHECK_EVERY
                self._raise_if_gone(counter, value, peer, what, now - start)
                if check is not None:
                    check()
            if now > deadline:
                raise PeerError(
                    f"rank {self.rank} waited {now - start:.1f} s for {what} rank {peer} "
                    f"(timeout {self.timeout} s): is rank {peer} alive and doing the matching call?"
                )

    def _raise_if_gone(self, counter, value: int, peer: int, what: str, waited: float) -> None:
        absence = None if self._presence is None else self._presence.absence(peer)
        if absence is not None and counter.value < value:  # read again: it may have just arrived
            raise PeerError(
                f"rank {self.rank} was waiting for {what} rank {peer}, but rank {peer} {absence}; "
                f"waited {waited:.2f} s. Every rank must make the matching calls before it returns."
            )

    def _send_message(self, header, payload, dst):
        box = self._out[dst]
        n = payload.numel()
        use_torch = n >= TORCH_COPY_ABOVE  # torch's copy_ releases the GIL; numpy is quicker when small
        data = payload if use_torch else payload.numpy()
        chunk, slots = self.chunk, self.slots
        digest = header_digest(header)
        sent = box.local
        for offset in range(0, max(n, 1), chunk):
            self.wait_at_least(box.acked, sent - slots + 1, dst, "a free slot in the mailbox to")
            slot = sent % slots
            length = min(chunk, n - offset)
            box.headers[slot, :HEADER_INTS] = header
            box.headers[slot, LENGTH_INT] = length
            box.headers[slot, DIGEST_INT] = digest
            box.last_written[slot] = None
            if use_torch:
                box.data_t[slot, :length].copy_(data[offset : offset + length])
            elif length:
                box.data[slot, :length] = data[offset : offset + length]
            sent += 1
            box.sent.value = sent  # publish: the receiver may now read this slot
        box.local = sent

    def _recv_header(self, src):
        box = self._in[src]
        self.wait_at_least(box.sent, box.local + 1, src, "a message from")
        return box.headers[box.local % self.slots, :HEADER_INTS].copy()

    def _recv_payload(self, out, header, src):
        box = self._in[src]
        n = int(header[2])
        use_torch = n >= TORCH_COPY_ABOVE
        target = out if use_torch else out.numpy()
        chunk, slots = self.chunk, self.slots
        acked = box.local
        for offset in range(0, max(n, 1), chunk):
            self.wait_at_least(box.sent, acked + 1, src, "the rest of a message from")
            slot = acked % slots
            length = min(chunk, n - offset)
            if use_torch:
                target[offset : offset + length].copy_(box.data_t[slot, :length])
            elif length:
                target[offset : offset + length] = box.data[slot, :length]
            acked += 1
            box.acked.value = acked  # release the slot to the sender
        box.local = acked

    def close(self):
        super().close()
        if self._presence is not None:
            self._presence.leave()  # a peer still waiting for us now gets a PeerError
        self._out.clear()
        self._in.clear()

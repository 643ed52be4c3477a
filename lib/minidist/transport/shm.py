"""Shared-memory transport: one mailbox per ordered pair of ranks.

The launcher allocates, for every pair (src -> dst), a block of shared memory
that both processes map. Sending is a memcpy into the block and one integer
store; receiving is one integer load and a memcpy out. No pickling, no system
call, no kernel copy on the data path -- which is why this transport beats
sockets by a wide margin on one machine.

Layout of one mailbox (``slots`` slots of ``chunk`` bytes each)::

    +-----------+-----------+------------------------+-------------------------+
    | sent (8B) | acked (8B)| slot headers           | slot data               |
    | own cache | own cache | slots x 32 int64       | slots x chunk bytes     |
    | line      | line      | (message header, len)  |                         |
    +-----------+-----------+------------------------+-------------------------+

``sent`` is written only by the sender, ``acked`` only by the receiver, so no
lock is needed: a single-producer single-consumer ring buffer. Chunk ``k`` of
the stream lives in slot ``k % slots``. The sender may fill a slot when
``sent - acked < slots``; the receiver may read one when ``sent > acked``.
A message bigger than a chunk is streamed through the ring, so the sender
fills slot 1 while the receiver empties slot 0 (a pipeline of memcpys).

Ordering: the data is written *before* ``sent`` is bumped, and read *after*
``sent`` is seen. x86-64 (TSO) never reorders stores with stores or loads with
loads, which is all this protocol needs. ARM (Apple Silicon, Graviton, ...)
may reorder both, and Python offers no memory fences, so on such a CPU a
receiver could see the new ``sent`` before the data: ``allocate_mailboxes``
refuses to start there and says to use ``transport="pipe"``.

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

import ctypes
import hashlib
import os
import platform
import time
from collections.abc import Callable

import numpy as np
import torch

from ..errors import PeerError
from ..wire import HEADER_INTS
from . import shm_workspace
from .base import BaseComm
from .presence import PeerPresence, allocate_presence
from .shm_workspace import PIECE_BYTES, SLOT_BYTES, SharedWorkspace, allocate_workspace

CTRL_BYTES = 256  # sent at byte 0, acked at byte 128: separate cache lines
SLOT_HEADER_INTS = 32
DEFAULT_CHUNK = int(os.environ.get("MINIDIST_SHM_CHUNK", 1 << 21))  # 2 MiB
DEFAULT_SLOTS = int(os.environ.get("MINIDIST_SHM_SLOTS", 4))
TORCH_COPY_ABOVE = 1 << 16
HEADER_BYTES = HEADER_INTS * 8
TAG_INT = 4  # where encode_header puts the tag
LENGTH_INT, DIGEST_INT = HEADER_INTS, HEADER_INTS + 1  # slot header: 20 ints, length, digest
#: CPUs whose memory model keeps stores in order (total store order), as the mailboxes need
STORE_ORDERED_MACHINES = ("x86_64", "amd64", "i386", "i686", "x86")
PRESENCE_CHECK_EVERY = 0.01  # seconds between looks at a silent peer's presence row


def header_digest(header: np.ndarray) -> int:
    """A 64-bit fingerprint of a message header (same in every process)."""
    return int.from_bytes(hashlib.blake2b(header.tobytes(), digest_size=8).digest(), "little", signed=True)


def require_store_order() -> None:
    """Refuse to run the mailboxes on a CPU that may reorder stores (see the module docstring)."""
    machine = platform.machine()
    if machine.lower() not in STORE_ORDERED_MACHINES:
        raise ValueError(
            f"transport='shm' needs an x86-64 CPU, whose stores become visible in program order; "
            f"this machine is {machine!r} (ARM, e.g. Apple Silicon, may reorder them, and a rank "
            "could read a message before its bytes arrive). Use transport='pipe' (or 'torch')."
        )


def mailbox_bytes(chunk: int = DEFAULT_CHUNK, slots: int = DEFAULT_SLOTS) -> int:
    return CTRL_BYTES + slots * SLOT_HEADER_INTS * 8 + slots * chunk


def allocate_mailboxes(
    world_size: int,
    chunk: int = DEFAULT_CHUNK,
    slots: int = DEFAULT_SLOTS,
    workspace_slot: int | None = None,
    workspace_piece: int | None = None,
):
    """Create the shared blocks for every ordered pair, the workspace and the presence table.

    Called by the launcher. ``UntypedStorage._new_shared`` maps a shared-memory
    file without touching its pages, so memory is committed only for pairs that
    actually talk. With torch's default ``file_descriptor`` sharing strategy the
    file has no name in /dev/shm: nothing can leak, even if every process is killed.
    """
    require_store_order()
    # read now, not at import: a test may set smaller pieces to cross many piece boundaries
    workspace_slot = workspace_slot or shm_workspace.SLOT_BYTES
    workspace_piece = workspace_piece or shm_workspace.PIECE_BYTES
    size = mailbox_bytes(chunk, slots)
    boxes = {}
    for src in range(world_size):
        for dst in range(world_size):
            if src != dst:
                storage = torch.UntypedStorage._new_shared(size)
                boxes[(src, dst)] = torch.empty(0, dtype=torch.uint8).set_(storage)
    return {
        "boxes": boxes,
        "chunk": chunk,
        "slots": slots,
        "workspace": allocate_workspace(world_size, workspace_slot, workspace_piece),
        "workspace_slot": workspace_slot,
        "workspace_piece": workspace_piece,
        "presence": allocate_presence(world_size),
    }


class _Mailbox:
    """Views of one shared block, plus this side's private copy of its counter."""

    def __init__(self, block: torch.Tensor, chunk: int, slots: int) -> None:
        self.block = block  # keeps the mapping alive for the raw addresses below
        raw = block.numpy()
        base = block.data_ptr()
        self.sent = ctypes.c_int64.from_address(base)  # .value: a plain 8-byte load/store
        self.acked = ctypes.c_int64.from_address(base + 128)
        hdr_end = CTRL_BYTES + slots * SLOT_HEADER_INTS * 8
        self.headers = raw[CTRL_BYTES:hdr_end].view(np.int64).reshape(slots, SLOT_HEADER_INTS)
        self.data = raw[hdr_end:].reshape(slots, chunk)
        self.data_t = block[hdr_end:].view(slots, chunk)
        self.header_addr = [base + CTRL_BYTES + i * SLOT_HEADER_INTS * 8 for i in range(slots)]
        self.data_addr = [base + hdr_end + i * chunk for i in range(slots)]
        self.digest = [ctypes.c_int64.from_address(a + DIGEST_INT * 8) for a in self.header_addr]
        self.last_written: list[bytes | None] = [None] * slots  # sender side: skip rewriting
        self.local = 0  # chunks this side has sent (outbox) or consumed (inbox)


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

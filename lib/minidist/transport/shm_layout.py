"""The shared-memory mailboxes: their layout, their allocation, and why no lock is needed.

The launcher allocates, for every pair (src -> dst), a block of shared memory that both
processes map; ``shm.MailboxComm`` sends and receives through it.

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
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform

import numpy as np
import torch

from ..wire import HEADER_INTS
from . import shm_workspace
from .presence import allocate_presence
from .shm_workspace import allocate_workspace

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

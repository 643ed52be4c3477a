"""The shared workspace: one block of memory that every rank of the shm transport maps.

Mailboxes (``shm.py``) connect two ranks. The workspace connects all of them,
which is what the shared-memory allreduce (``collectives/shm_allreduce.py``)
needs: every rank writes its vector into its own slot, and every rank can read
every slot. This module defines the block's layout -- the one place that does --
and gives each process typed views of it::

    +----------------+-------------------------------+----------------------------------+
    | flags          | meta: 2 buffers x p ranks     | data: 2 buffers x p ranks        |
    | p x 64 bytes   | x 256 bytes                   | x slot_bytes (4096-aligned)      |
    | barrier epochs | signature, op, 20-int header  | buffer 0: slot 0 | slot 1 | ... |
    +----------------+-------------------------------+----------------------------------+

* ``flags[r]`` -- rank r's barrier epoch, alone in its cache line; only rank r writes it.
* ``meta[b][r]`` -- what rank r put into buffer b: ``signature`` (a checksum of the
  operation, shape, dtype and op, computed by ``collectives.api``), the op's index,
  and the 20-integer message header that describes its tensor (for error messages).
* ``slots[b][r]`` -- rank r's data in buffer b. Two buffers alternate between
  operations, so a fast rank may fill the next one while a slow one still reads.

Per-process state (the barrier epoch, which buffer is next, cached views) lives
on this object, not in shared memory: every rank keeps its own copy in step.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

FLAG_BYTES = 64  # one cache line per rank's flag: no false sharing between writers
META_BYTES = 256  # per rank per buffer
META_INTS = META_BYTES // 8
SIGNATURE, OP_INDEX, HEADER_START = 0, 1, 2  # int64 positions inside one meta record
PAGE = 4096
#: bytes of one rank's slot in one buffer (the workspace holds 2 x world_size of them)
SLOT_BYTES = int(os.environ.get("MINIDIST_SHM_WORKSPACE_SLOT", 8 << 20))


def _offsets(world_size: int, slot_bytes: int) -> tuple[int, int, int]:
    """(offset of the meta records, offset of the data, total bytes)."""
    meta = FLAG_BYTES * world_size
    data = -(-(meta + 2 * world_size * META_BYTES) // PAGE) * PAGE
    return meta, data, data + 2 * world_size * slot_bytes


def allocate_workspace(world_size: int, slot_bytes: int = SLOT_BYTES) -> torch.Tensor:
    """Launcher side: the shared block, as a flat uint8 tensor.

    Like the mailboxes, it is mapped without touching its pages: memory is
    committed only for the part the allreduces actually use.
    """
    if slot_bytes % PAGE:
        raise ValueError(f"slot_bytes must be a multiple of {PAGE}, got {slot_bytes}")
    total = _offsets(world_size, slot_bytes)[2]
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(total))


class SharedWorkspace:
    """One process's views of the workspace (see the module docstring)."""

    def __init__(self, block: torch.Tensor, world_size: int, slot_bytes: int) -> None:
        meta, data, total = _offsets(world_size, slot_bytes)
        if block.numel() < total:
            raise ValueError(
                f"a workspace for {world_size} ranks with {slot_bytes}-byte slots needs {total} "
                f"bytes, got {block.numel()}: allocate it with allocate_workspace()"
            )
        self.block = block  # keeps the mapping alive for the raw addresses below
        self.world_size = world_size
        self.slot_bytes = slot_bytes
        p, base, raw = world_size, block.data_ptr(), block.numpy()
        self.flags = [ctypes.c_int64.from_address(base + FLAG_BYTES * r) for r in range(p)]

        def record(b: int, r: int) -> int:
            return meta + (b * p + r) * META_BYTES

        self.meta = [[raw[record(b, r) :][:META_BYTES].view(np.int64) for r in range(p)] for b in (0, 1)]
        self.signature = [
            [ctypes.c_int64.from_address(base + record(b, r) + 8 * SIGNATURE) for r in range(p)]
            for b in (0, 1)
        ]
        self.slots = [
            [block[data + (b * p + r) * slot_bytes :][:slot_bytes] for r in range(p)] for b in (0, 1)
        ]
        self.slot_ptr = [[view.data_ptr() for view in buffer] for buffer in self.slots]
        self.epoch = 0  # barriers this rank has entered
        self.parity = 0  # the buffer the next operation uses
        self.cache: dict = {}  # views and scratch that the algorithms keep between calls

    def next_buffer(self) -> int:
        """The buffer for the next operation (0, 1, 0, 1, ... -- the same on every rank)."""
        b = self.parity
        self.parity ^= 1
        return b

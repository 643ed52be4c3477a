"""The shared workspace: one block of memory that every rank of the shm transport maps.

Mailboxes (``shm.py``) connect two ranks. The workspace connects all of them,
which is what the shared-memory allreduce (``collectives/shm_allreduce.py``)
needs: every rank writes into its own area, and every rank can read every
area. This module defines the block's layout -- the one place that does --
and gives each process typed views of it::

    +--------+-----------------+--------------------------+---------------------------------+
    | flags  | meta: 2 buffers | slots: 2 buffers x p     | areas: STAGES stages x p ranks  |
    | p x 64 | x p x 256 bytes | x slot_bytes (small)     | x piece_bytes (large, pipelined)|
    +--------+-----------------+--------------------------+---------------------------------+

* ``flags[r]`` -- rank r's barrier epoch, alone in its cache line; only rank r writes it.
* ``meta[b][r]`` -- what rank r put into buffer b: ``signature`` (a checksum of the
  operation, shape, dtype and op, computed by ``collectives.api``), the op's index,
  and the 20-integer message header that describes its tensor (for error messages).
* ``slots[b][r]`` -- rank r's copy of a *small* vector in buffer b. Two buffers
  alternate between operations, so a fast rank may fill the next one while a slow
  one still reads.
* ``areas[s][r]`` -- rank r's area in pipeline stage s, for *large* vectors, which
  go through in pieces of ``piece_bytes``: piece k uses stage k mod STAGES. Three
  stages let a rank publish piece k+1 while its peers still read the results of
  piece k-1 -- so one barrier per piece suffices (see ``shm_allreduce``).

Per-process state (the barrier epoch, which buffer and stage are next, cached
views) lives on this object, not in shared memory: every rank keeps its own copy
in step.
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
#: bytes of one rank's small-vector slot in one buffer (vectors up to this size take one barrier)
SLOT_BYTES = int(os.environ.get("MINIDIST_SHM_WORKSPACE_SLOT", 64 << 10))
#: bytes of a large vector handled per barrier. Small enough that the p areas of three
#: stages stay in the CPU's cache (measured on 2 cores: 512 KiB-1 MiB is best).
PIECE_BYTES = int(os.environ.get("MINIDIST_SHM_PIECE", 1 << 20))
STAGES = 3


def _offsets(world_size: int, slot_bytes: int, piece_bytes: int) -> tuple[int, int, int, int]:
    """(offset of the meta records, of the slots, of the areas, total bytes)."""
    meta = FLAG_BYTES * world_size
    slots = -(-(meta + 2 * world_size * META_BYTES) // PAGE) * PAGE
    areas = slots + 2 * world_size * slot_bytes
    return meta, slots, areas, areas + STAGES * world_size * piece_bytes


def allocate_workspace(
    world_size: int, slot_bytes: int = SLOT_BYTES, piece_bytes: int = PIECE_BYTES
) -> torch.Tensor:
    """Launcher side: the shared block, as a flat uint8 tensor.

    Like the mailboxes, it is mapped without touching its pages: memory is
    committed only for the part the allreduces actually use.
    """
    for name, value in (("slot_bytes", slot_bytes), ("piece_bytes", piece_bytes)):
        if value <= 0 or value % PAGE:
            raise ValueError(f"{name} must be a positive multiple of {PAGE}, got {value}")
    total = _offsets(world_size, slot_bytes, piece_bytes)[3]
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(total))


class SharedWorkspace:
    """One process's views of the workspace (see the module docstring)."""

    def __init__(
        self, block: torch.Tensor, world_size: int, slot_bytes: int, piece_bytes: int = PIECE_BYTES
    ) -> None:
        meta, slots, areas, total = _offsets(world_size, slot_bytes, piece_bytes)
        if block.numel() < total:
            raise ValueError(
                f"a workspace for {world_size} ranks with {slot_bytes}-byte slots and {piece_bytes}-byte "
                f"pieces needs {total} bytes, got {block.numel()}: allocate it with allocate_workspace()"
            )
        self.block = block  # keeps the mapping alive for the raw addresses below
        self.world_size = world_size
        self.slot_bytes = slot_bytes
        self.piece_bytes = piece_bytes
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
            [block[slots + (b * p + r) * slot_bytes :][:slot_bytes] for r in range(p)] for b in (0, 1)
        ]
        self.slot_ptr = [[view.data_ptr() for view in buffer] for buffer in self.slots]
        self.areas = [
            [block[areas + (s * p + r) * piece_bytes :][:piece_bytes] for r in range(p)]
            for s in range(STAGES)
        ]
        self.epoch = 0  # barriers this rank has entered
        self.parity = 0  # the buffer the next operation uses
        self.stage = 0  # the stage the next large piece uses
        self.cache: dict = {}  # views and scratch that the algorithms keep between calls

    def next_buffer(self) -> int:
        """The buffer for the next operation (0, 1, 0, 1, ... -- the same on every rank)."""
        b = self.parity
        self.parity ^= 1
        return b

    def next_stage(self) -> int:
        """The pipeline stage for the next large piece (0, 1, 2, 0, ... -- the same on every rank)."""
        s = self.stage
        self.stage = (s + 1) % STAGES
        return s

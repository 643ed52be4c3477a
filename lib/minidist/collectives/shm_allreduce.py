"""The shared-memory allreduce: the fast path on one machine.

Point-to-point algorithms move every byte twice per hop (into a mailbox, out
of it). When all ranks can map the same memory there is a shorter way. The
launcher gives every ``ShmComm`` one shared *workspace* with a slot per rank::

    flags  | digests (x2) | buffer 0: slot 0 | slot 1 | ... | buffer 1: slot 0 | slot 1 | ...

Small vectors (one barrier):
  1. each rank copies its vector into its slot of the current buffer;
  2. barrier;
  3. each rank adds up all slots itself -- for a few KiB, computing the whole
     sum twice is cheaper than another round of synchronisation.

Large vectors, in pieces of one slot (two barriers per piece):
  1. each rank copies its piece into its slot;
  2. barrier;
  3. rank r reduces the r-th 1/p of the piece across all slots, in place in
     slot 0 (a reduce-scatter: every rank does 1/p of the arithmetic);
  4. barrier;
  5. each rank copies the whole reduced piece out of slot 0 (an allgather).

Barrier: rank r writes an increasing epoch number into its own flag and waits
until every flag has reached it -- no locks, no atomics, each flag has a single
writer. Two buffers alternate between operations, so a rank may start copying
the next piece while a slower one is still reading this one; it cannot get two
operations ahead, because that needs everyone at the barrier in between.

Each rank also writes a digest of its tensor's shape and dtype next to its
slot; after the first barrier everyone compares them, so ranks that pass
different tensors get a clear error instead of a wrong sum.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from ..comm import KIND_DATA, describe_header, encode_header
from ..errors import MessageMismatch
from ..transport.shm import header_digest
from .ops import chunk_bounds, combine_, finish_

SMALL_BYTES = 64 * 1024
# Large vectors go through the workspace in pieces of this size: small enough that a
# piece, its p copies and the result stay in the CPU's cache between the copy-in, the
# reduction and the copy-out (2-3x faster than pieces the size of a whole slot).
PIECE_BYTES = int(os.environ.get("MINIDIST_SHM_PIECE", 1 << 20))
META_BYTES = 256  # per rank per buffer: digest + the 20-integer header


def workspace_layout(world_size: int, total_bytes: int) -> tuple[int, int, int]:
    """(offset of the digests, offset of the data, bytes per slot) in a workspace."""
    meta = 64 * world_size
    data = -(-(meta + 2 * world_size * META_BYTES) // 4096) * 4096
    slot = (total_bytes - data) // (2 * world_size) // 4096 * 4096
    return meta, data, slot


class _State:
    """This rank's views of the workspace and its barrier epoch (kept on the comm)."""

    def __init__(self, comm) -> None:
        workspace = comm.workspace
        p = comm.world_size
        base = workspace.data_ptr()
        meta, data, slot = workspace_layout(p, workspace.numel())
        self.flags = [ctypes.c_int64.from_address(base + 64 * r) for r in range(p)]
        raw = workspace.numpy()
        self.meta = [
            [raw[meta + (b * p + r) * META_BYTES :][:META_BYTES].view(np.int64) for r in range(p)]
            for b in (0, 1)
        ]
        self.slots = [[workspace[data + (b * p + r) * slot :][:slot] for r in range(p)] for b in (0, 1)]
        self.digest = [
            [ctypes.c_int64.from_address(base + meta + (b * p + r) * META_BYTES) for r in range(p)]
            for b in (0, 1)
        ]
        self.slot_ptr = [[view.data_ptr() for view in buffer] for buffer in self.slots]
        self.numpy_views: dict = {}  # (buffer, dtype, numel) -> [slot 0 .. slot p-1, scratch]
        self.written = [None, None]  # the header this rank last wrote into each buffer's meta
        self.slot_bytes = slot
        self.epoch = 0
        self.parity = 0
        self.typed: dict = {}
        self.headers: dict = {}

    def typed_slot(self, b: int, r: int, dtype: torch.dtype) -> torch.Tensor:
        view = self.typed.get((b, r, dtype))
        if view is None:
            view = self.typed[(b, r, dtype)] = self.slots[b][r].view(dtype)
        return view


def _state(comm) -> _State:
    state = getattr(comm, "_shm_allreduce_state", None)
    if state is None:
        if getattr(comm, "workspace", None) is None:
            raise ValueError(
                "algorithm='shm' needs a shared-memory workspace: launch with transport='shm' "
                f"(this communicator is {type(comm).__name__})"
            )
        state = comm._shm_allreduce_state = _State(comm)
    return state


def _barrier(comm, state: _State) -> None:
    state.epoch += 1
    epoch = state.epoch
    state.flags[comm.rank].value = epoch
    for peer, flag in enumerate(state.flags):
        if flag.value < epoch:
            comm._wait_at_least(flag, epoch, peer, "the shm allreduce barrier: waiting for")


def _publish_meta(comm, state: _State, b: int, tensor: torch.Tensor) -> None:
    key = (tensor.dtype, tensor.shape)
    cached = state.headers.get(key)
    if cached is None:
        header = encode_header(KIND_DATA, tensor)
        cached = state.headers[key] = (header_digest(header), header)
    if state.written[b] is not cached:  # the full header only when it changes
        state.meta[b][comm.rank][1:21] = cached[1]
        state.written[b] = cached
    state.digest[b][comm.rank].value = cached[0]


def _check_meta(comm, state: _State, b: int) -> None:
    digests = state.digest[b]
    mine = digests[comm.rank].value
    if all(d.value == mine for d in digests):
        return
    described = {r: describe_header(state.meta[b][r][1:21]) for r in range(comm.world_size)}
    others = [r for r in range(comm.world_size) if state.meta[b][r][0] != mine]
    raise MessageMismatch(
        f"allreduce: rank {comm.rank} passed {described[comm.rank]}, but rank(s) {others} passed "
        + "; ".join(f"rank {r}: {described[r]}" for r in others)
        + ". Every rank must pass a tensor of the same shape and dtype."
    )


_NUMPY_DTYPES = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
}
_UFUNCS = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}


def small_allreduce(comm, tensor: torch.Tensor, op: str) -> bool:
    """The latency path for a small contiguous CPU tensor of a dtype numpy knows:
    numpy's ufuncs and ctypes' memmove cost a fraction of a microsecond where a
    torch call costs one or two. Returns False when it does not apply."""
    np_dtype = _NUMPY_DTYPES.get(tensor.dtype)
    nbytes = tensor.nbytes
    if np_dtype is None or nbytes > SMALL_BYTES or tensor.is_cuda or not tensor.is_contiguous():
        return False
    state = _state(comm)
    if nbytes > state.slot_bytes:
        return False
    p, rank = comm.world_size, comm.rank
    b = state.parity
    state.parity ^= 1
    ctypes.memmove(state.slot_ptr[b][rank], tensor.data_ptr(), nbytes)
    _publish_meta(comm, state, b, tensor)
    _barrier(comm, state)
    _check_meta(comm, state, b)
    numel = tensor.numel()
    views = state.numpy_views.get((b, np_dtype, numel))
    if views is None:
        views = [state.slots[b][r].numpy()[:nbytes].view(np_dtype) for r in range(p)]
        views.append(np.empty(numel, dtype=np_dtype))  # private scratch for the result
        state.numpy_views[(b, np_dtype, numel)] = views
    ufunc, scratch = _UFUNCS[op], views[-1]
    ufunc(views[0], views[1], out=scratch)
    for view in views[2:p]:
        ufunc(scratch, view, out=scratch)
    if op == "avg":
        if np.issubdtype(np_dtype, np.floating):
            np.true_divide(scratch, p, out=scratch)
        else:
            np.floor_divide(scratch, p, out=scratch)
    ctypes.memmove(tensor.data_ptr(), scratch.ctypes.data, nbytes)
    return True


def shm_allreduce_(comm, tensor: torch.Tensor, flat: torch.Tensor, op: str) -> None:
    """Allreduce ``flat`` (the contiguous flat view of ``tensor``) in place."""
    state = _state(comm)
    p, rank = comm.world_size, comm.rank
    nbytes = flat.numel() * flat.element_size()
    if nbytes <= min(SMALL_BYTES, state.slot_bytes):
        b = state.parity
        state.parity ^= 1
        numel = flat.numel()
        ctypes.memmove(state.slots[b][rank].data_ptr(), flat.data_ptr(), nbytes)
        _publish_meta(comm, state, b, tensor)
        _barrier(comm, state)
        _check_meta(comm, state, b)
        views = [state.typed_slot(b, r, flat.dtype)[:numel] for r in range(p)]
        if op in ("sum", "avg") and p == 2:
            torch.add(views[0], views[1], out=flat)
        else:
            flat.copy_(views[0])
            for view in views[1:]:
                combine_(flat, view, op)
        finish_(flat, op, p)
        return
    per_piece = min(state.slot_bytes, PIECE_BYTES) // flat.element_size()
    for start in range(0, flat.numel(), per_piece):
        piece = flat[start : start + per_piece]
        numel = piece.numel()
        b = state.parity
        state.parity ^= 1
        mine = state.typed_slot(b, rank, flat.dtype)[:numel]
        mine.copy_(piece)
        _publish_meta(comm, state, b, tensor)
        _barrier(comm, state)
        _check_meta(comm, state, b)
        lo, hi = chunk_bounds(numel, p)[rank]
        acc = state.typed_slot(b, 0, flat.dtype)[lo:hi]
        for r in range(1, p):
            combine_(acc, state.typed_slot(b, r, flat.dtype)[lo:hi], op)
        finish_(acc, op, p)
        _barrier(comm, state)
        piece.copy_(state.typed_slot(b, 0, flat.dtype)[:numel])

"""The shared-memory allreduce: the speed path on one machine.

Point-to-point algorithms move every byte twice per hop (into a mailbox, out
of it). When all ranks can map the same memory there is a shorter way. The
shm transport gives every rank the same *workspace*
(``comm.shared_workspace``; its layout is defined in
``transport/shm_workspace.py``): a flag, a meta record and a data slot per rank,
in two buffers that alternate between operations.

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

Agreement: this module validates nothing itself. ``collectives.api.allreduce``
checks the arguments and computes the call's signature (a checksum of shape,
dtype, op and algorithm, the same tag the point-to-point algorithms put on
their messages). Each rank writes it into its meta record before the first
barrier and compares everyone's after it, so ranks that disagree get a
``MessageMismatch`` naming them instead of a wrong result. While waiting at the
barrier, a rank also looks at its mailboxes: a peer that runs the allreduce
with a point-to-point algorithm instead sends it a message whose tag says so.
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np
import torch

from ..comm import KIND_DATA, describe_header, encode_header
from ..errors import MessageMismatch
from ..transport.shm_workspace import HEADER_START, OP_INDEX, SharedWorkspace
from .ops import OPS, Flat, chunk_bounds, combine_, finish_
from .signature import signature_tag

SMALL_BYTES = 64 * 1024
# Large vectors go through the workspace in pieces of this size: small enough that a
# piece, its p copies and the result stay in the CPU's cache between the copy-in, the
# reduction and the copy-out (2-3x faster than pieces the size of a whole slot).
PIECE_BYTES = int(os.environ.get("MINIDIST_SHM_PIECE", 1 << 20))
MESSAGE_ALGORITHMS = ("star", "tree", "ring", "butterfly")

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


class _State:
    """What this rank keeps between calls: views of the workspace and scratch buffers."""

    def __init__(self, workspace: SharedWorkspace) -> None:
        self.workspace = workspace
        self.numpy_views: dict = {}  # (buffer, dtype, numel) -> [slot 0 .. slot p-1, scratch]
        self.typed: dict = {}
        self.written: list = [None, None]  # the signature whose meta this rank last wrote, per buffer

    def typed_slot(self, b: int, r: int, dtype: torch.dtype) -> torch.Tensor:
        view = self.typed.get((b, r, dtype))
        if view is None:
            view = self.typed[(b, r, dtype)] = self.workspace.slots[b][r].view(dtype)
        return view


def _state(workspace: SharedWorkspace) -> _State:
    state = workspace.cache.get("shm_allreduce")
    if state is None:
        state = workspace.cache["shm_allreduce"] = _State(workspace)
    return state


def _look_for_message_algorithms(comm, tensor: torch.Tensor, op: str) -> None:
    """Called while waiting at the barrier: is a peer running a point-to-point
    allreduce of the same tensor instead? Its first message to us would say so."""
    peek = getattr(comm, "peek_tag", None)
    if peek is None:
        return
    theirs = {signature_tag("allreduce", tensor, op, a): a for a in MESSAGE_ALGORITHMS}
    for peer in range(comm.world_size):
        tag = peek(peer) if peer != comm.rank else None
        if tag in theirs:
            raise MessageMismatch(
                f"allreduce: the ranks do not agree: rank {comm.rank} runs algorithm 'shm', but "
                f"rank {peer} sent it a message of allreduce with algorithm {theirs[tag]!r}. "
                "Every rank must pass the same algorithm."
            )


def _barrier(comm, state: _State, tensor: torch.Tensor, op: str) -> None:
    workspace = state.workspace
    workspace.epoch += 1
    epoch = workspace.epoch
    workspace.flags[comm.rank].value = epoch
    for peer, flag in enumerate(workspace.flags):
        if flag.value < epoch:  # the check is built only now: nothing to pay when nobody waits
            check = functools.partial(_look_for_message_algorithms, comm, tensor, op)
            comm.wait_at_least(flag, epoch, peer, "the shm allreduce barrier: waiting for", check)


def _publish(comm, state: _State, b: int, tensor: torch.Tensor, op: str, signature: int) -> None:
    """Write this call's signature (and, when it changed, what it stands for) into the meta record."""
    workspace = state.workspace
    if state.written[b] != signature:
        record = workspace.meta[b][comm.rank]
        record[OP_INDEX] = OPS.index(op)
        record[HEADER_START : HEADER_START + 20] = encode_header(KIND_DATA, tensor)
        state.written[b] = signature
    workspace.signature[b][comm.rank].value = signature


def _check_agreement(comm, state: _State, b: int) -> None:
    signatures = state.workspace.signature[b]
    mine = signatures[comm.rank].value
    for signature in signatures:
        if signature.value != mine:
            break
    else:
        return
    meta = state.workspace.meta[b]

    def described(r: int) -> str:
        op = OPS[int(meta[r][OP_INDEX])]
        return f"{describe_header(meta[r][HEADER_START : HEADER_START + 20])} with op {op!r}"

    others = [r for r in range(comm.world_size) if signatures[r].value != mine]
    raise MessageMismatch(
        f"allreduce: the ranks do not agree: rank {comm.rank} passed {described(comm.rank)}, but "
        + "; ".join(f"rank {r} passed {described(r)}" for r in others)
        + ". Every rank must pass a tensor of the same shape and dtype, with the same op and algorithm."
    )


def shm_allreduce(comm, workspace: SharedWorkspace, tensor: torch.Tensor, op: str, signature: int) -> None:
    """Allreduce ``tensor`` in place through ``workspace`` (arguments already validated by
    ``collectives.api``; ``signature`` is the call's checksum, compared across ranks)."""
    state = _state(workspace)
    if _small_numpy_allreduce(comm, state, tensor, op, signature):
        return
    staged = tensor.is_cuda
    work = tensor.cpu() if staged else tensor
    flat = Flat(work)
    _workspace_allreduce(comm, state, tensor, flat.flat, op, signature)
    flat.commit()
    if staged:
        tensor.copy_(work)


def _small_numpy_allreduce(comm, state: _State, tensor: torch.Tensor, op: str, signature: int) -> bool:
    """The latency path for a small contiguous CPU tensor of a dtype numpy knows:
    numpy's ufuncs and ctypes' memmove cost a fraction of a microsecond where a
    torch call costs one or two. Returns False when it does not apply."""
    np_dtype = _NUMPY_DTYPES.get(tensor.dtype)
    nbytes = tensor.nbytes
    workspace = state.workspace
    if (
        np_dtype is None
        or nbytes > SMALL_BYTES
        or nbytes > workspace.slot_bytes
        or tensor.is_cuda
        or not tensor.is_contiguous()
    ):
        return False
    p, rank = comm.world_size, comm.rank
    b = workspace.next_buffer()
    ctypes.memmove(workspace.slot_ptr[b][rank], tensor.data_ptr(), nbytes)
    _publish(comm, state, b, tensor, op, signature)
    _barrier(comm, state, tensor, op)
    _check_agreement(comm, state, b)
    numel = tensor.numel()
    views = state.numpy_views.get((b, np_dtype, numel))
    if views is None:
        views = [workspace.slots[b][r].numpy()[:nbytes].view(np_dtype) for r in range(p)]
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


def _workspace_allreduce(
    comm, state: _State, tensor: torch.Tensor, flat: torch.Tensor, op: str, signature: int
) -> None:
    """Allreduce ``flat`` (the contiguous flat view of ``tensor``) in place, with torch."""
    workspace = state.workspace
    p, rank = comm.world_size, comm.rank
    nbytes = flat.numel() * flat.element_size()
    if nbytes <= min(SMALL_BYTES, workspace.slot_bytes):
        b = workspace.next_buffer()
        numel = flat.numel()
        ctypes.memmove(workspace.slot_ptr[b][rank], flat.data_ptr(), nbytes)
        _publish(comm, state, b, tensor, op, signature)
        _barrier(comm, state, tensor, op)
        _check_agreement(comm, state, b)
        views = [state.typed_slot(b, r, flat.dtype)[:numel] for r in range(p)]
        if op in ("sum", "avg") and p == 2:
            torch.add(views[0], views[1], out=flat)
        else:
            flat.copy_(views[0])
            for view in views[1:]:
                combine_(flat, view, op)
        finish_(flat, op, p)
        return
    per_piece = min(workspace.slot_bytes, PIECE_BYTES) // flat.element_size()
    for start in range(0, flat.numel(), per_piece):
        piece = flat[start : start + per_piece]
        numel = piece.numel()
        b = workspace.next_buffer()
        mine = state.typed_slot(b, rank, flat.dtype)[:numel]
        mine.copy_(piece)
        _publish(comm, state, b, tensor, op, signature)
        _barrier(comm, state, tensor, op)
        _check_agreement(comm, state, b)
        lo, hi = chunk_bounds(numel, p)[rank]
        acc = state.typed_slot(b, 0, flat.dtype)[lo:hi]
        for r in range(1, p):
            combine_(acc, state.typed_slot(b, r, flat.dtype)[lo:hi], op)
        finish_(acc, op, p)
        _barrier(comm, state, tensor, op)
        piece.copy_(state.typed_slot(b, 0, flat.dtype)[:numel])

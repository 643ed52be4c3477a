"""The shared-memory allreduce: the speed path on one machine.

Point-to-point algorithms move every byte twice per hop (into a mailbox, out
of it). When all ranks can map the same memory there is a shorter way. The
shm transport gives every rank the same *workspace*
(``comm.shared_workspace``; its layout is defined in
``transport/shm_workspace.py``): a flag and a meta record per rank, small data
slots in two buffers that alternate between operations, and areas for the
pieces of large vectors.

Small vectors (one barrier):
  1. each rank copies its vector into its slot of the current buffer;
  2. barrier;
  3. each rank adds up all slots itself -- for a few KiB, computing the whole
     sum twice is cheaper than another round of synchronisation.

Large vectors, in pieces of ``piece_bytes`` (one barrier per piece, pipelined):
  rank r owns slice r of every piece. It copies the *other* slices of its piece
  into its area of the workspace; after the barrier it adds up slice r -- its
  own tensor's slice and the others' published copies -- writes the sum into its
  tensor and into its area, where the others collect it after the next barrier
  (a reduce-scatter, then an allgather, through the cache). Three stages of areas
  let piece k+1 be published while piece k-1 is still being collected, so the
  barrier of piece k+1 also tells everyone that piece k is reduced. Per byte,
  each rank copies (p-1)/p in and (p-1)/p out and reduces 1/p: half the copying
  of "everyone copies everything in, then everything out".

Barrier and agreement (``shm_sync.py``): a flag per rank, no locks; each call's signature
compared across ranks, so ranks that disagree get a ``MessageMismatch``, not a wrong result.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from ..comm import Communicator
from ..errors import MessageMismatch
from ..transport.shm_workspace import SharedWorkspace
from .ops import Flat, combine_, finish_
from .shm_sync import _barrier, _check_agreement, _publish, _State, _state

SMALL_BYTES = 64 * 1024

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


def shm_allreduce(
    comm: Communicator, workspace: SharedWorkspace, tensor: torch.Tensor, op: str, signature: int
) -> None:
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


def _small_numpy_allreduce(
    comm: Communicator, state: _State, tensor: torch.Tensor, op: str, signature: int
) -> bool:
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
    comm: Communicator, state: _State, tensor: torch.Tensor, flat: torch.Tensor, op: str, signature: int
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
    _pipelined_allreduce(comm, state, tensor, flat, op, signature)


def slice_bounds(numel: int, parts: int, element_size: int) -> list[tuple[int, int]]:
    """Split a piece of ``numel`` elements into ``parts`` slices whose starts are 64-byte
    aligned (whole cache lines: two ranks never write the same line); the last may be
    shorter and some may be empty when ``numel`` is small.

    >>> slice_bounds(100, 2, 4)
    [(0, 64), (64, 100)]
    """
    line = max(1, 64 // element_size)
    per = -(-numel // parts)  # ceil(numel / parts) ...
    per = -(-per // line) * line  # ... rounded up to whole cache lines
    return [(min(i * per, numel), min((i + 1) * per, numel)) for i in range(parts)]


class _PiecePlan:
    """For one stage, dtype and piece length: the slice bounds and the views of the
    areas that this rank writes and reads (built once, reused by every piece)."""

    def __init__(self, workspace: SharedWorkspace, stage: int, rank: int, dtype, numel: int) -> None:
        p = workspace.world_size
        areas = [workspace.areas[stage][r].view(dtype) for r in range(p)]
        self.bounds = slice_bounds(numel, p, areas[0].element_size())
        self.lo, self.hi = lo, hi = self.bounds[rank]
        # publish: the parts of the piece before and after this rank's own slice
        self.publish = [(a, b, areas[rank][a:b]) for a, b in ((0, lo), (hi, numel)) if a < b]
        self.sources = [None if r == rank else areas[r][lo:hi] for r in range(p)]
        self.result = areas[rank][lo:hi]
        self.collect = [(a, b, areas[r][a:b]) for r, (a, b) in enumerate(self.bounds) if r != rank and a < b]


def _plan(state: _State, stage: int, rank: int, dtype, numel: int) -> _PiecePlan:
    plan = state.plans.get((stage, dtype, numel))
    if plan is None:
        if len(state.plans) > 64:  # last pieces of many different lengths: forget the old ones
            state.plans.clear()
        plan = state.plans[(stage, dtype, numel)] = _PiecePlan(state.workspace, stage, rank, dtype, numel)
    return plan


def _pipelined_allreduce(
    comm: Communicator, state: _State, tensor: torch.Tensor, flat: torch.Tensor, op: str, signature: int
) -> None:
    """Allreduce a large ``flat`` in place, piece by piece, one barrier per piece.

    Piece k (``piece_bytes`` of the vector) is cut into p slices; rank r owns slice r
    of every piece. With ``A[s][r]`` rank r's area in stage s (the three stages take
    turns, piece after piece, across calls too)::

        publish(k)   rank r copies its slices j != r of piece k into A[s][r]   (p-1)/p bytes
        barrier k    every rank has published piece k (and finished piece k-1)
        reduce(k)    rank r: slice r of its own tensor (op) slice r of A[s][j], j != r,
                     into A[s][r] (its own slice there was free), then into its tensor
        collect(k-1) rank r copies slice j of A[s-1][j] (reduced by rank j before
                     barrier k) into its tensor, for j != r                     (p-1)/p bytes
        publish(k+1) into stage s+1 = s-2: its last readers finished before barrier k

        rank 0:  pub 0 | B0 | red 0 pub 1 | B1 | red 1 col 0 pub 2 | B2 | ... | Bn | col n-1
        rank 1:  pub 0 | B0 | red 0 pub 1 | B1 | red 1 col 0 pub 2 | B2 | ... | Bn | col n-1

    Per rank and byte of the vector: (p-1)/p copied in, (p-1)/p copied out and 1/p
    reduced from p sources (then copied into the tensor) -- the data a ring moves,
    without the messages -- and n / piece_bytes + 1 barriers. A piece's areas stay
    in the cache between its publication, reduction and collection.
    """
    workspace = state.workspace
    p, rank, dtype = comm.world_size, comm.rank, flat.dtype
    numel = flat.numel()
    per_piece = workspace.piece_bytes // flat.element_size()
    b = workspace.next_buffer()  # for the signature: meta records alternate like small calls
    _publish(comm, state, b, tensor, op, signature)
    entry_stage = workspace.stage
    stage = workspace.next_stage()
    plan = _plan(state, stage, rank, dtype, min(per_piece, numel))
    for lo, hi, area in plan.publish:
        area.copy_(flat[lo:hi])
    previous = None  # (start, plan) of the piece waiting to be collected
    for start in range(0, numel, per_piece):
        _barrier(comm, state, tensor, op)
        if previous is None:
            try:
                _check_agreement(comm, state, b)
            except MessageMismatch:
                # a peer may have taken the small path, which uses no stage: stay in step with it
                workspace.stage = entry_stage
                raise
        if plan.lo < plan.hi:  # reduce this rank's slice, in rank order (the same bits on all ranks)
            mine = flat[start + plan.lo : start + plan.hi]
            result, sources = plan.result, plan.sources
            first, second = (sources[0] if rank else mine), (sources[1] if rank != 1 else mine)
            # ranks 0 and 1 accumulate in their own tensor, whose lines the first operation
            # reads anyway (measured ~8% faster than accumulating in the area and copying back)
            target = mine if rank < 2 else result
            if op == "sum" or op == "avg":
                torch.add(first, second, out=target)
            elif op == "max":
                torch.maximum(first, second, out=target)
            else:
                torch.minimum(first, second, out=target)
            for r in range(2, p):
                combine_(target, mine if r == rank else sources[r], op)
            finish_(target, op, p)
            (result if target is mine else mine).copy_(target)
        if previous is not None:
            _collect(flat, *previous)
        previous = (start, plan)
        following = start + per_piece
        if following < numel:
            stage = workspace.next_stage()
            plan = _plan(state, stage, rank, dtype, min(per_piece, numel - following))
            for lo, hi, area in plan.publish:
                area.copy_(flat[following + lo : following + hi])
    _barrier(comm, state, tensor, op)  # every slice of the last piece is reduced
    _collect(flat, *previous)


def _collect(flat: torch.Tensor, start: int, plan: _PiecePlan) -> None:
    """Copy the slices of a piece that the other ranks reduced into this rank's tensor."""
    for lo, hi, area in plan.collect:
        flat[start + lo : start + hi].copy_(area)

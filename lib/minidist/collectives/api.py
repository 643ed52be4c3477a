"""The public collectives: validation, algorithm choice, and the in-place contract.

Every function takes the communicator first and works for any shape, any
numel (0 and fewer elements than ranks included) and any layout (a
non-contiguous tensor is handled through a contiguous copy). They are written
only against ``comm.send/recv/isend/irecv``, so they run on every transport.

This module is the one place where a call is validated: the arguments (``checks.py``),
agreement between the ranks through a *signature* (``signature.py``): a checksum
of the operation, shape, dtype, op, root and algorithm that every message of
the collective carries as its tag, so a disagreement raises ``MessageMismatch``
naming the ranks, at the first message. The algorithms (``rooted``, ``ring``,
``butterfly``, ``all_to_all``) only move and combine data.

One speed path: on a communicator with a ``shared_workspace`` (the shm
transport), ``allreduce`` runs ``shm_allreduce``, which sends no messages at all;
it receives the signature computed here and compares it across the ranks through
the workspace. ``comm.without_shortcuts()`` gives a communicator without a
workspace, on which ``allreduce`` takes the point-to-point algorithms.

Every collective but barrier takes ``async_op=True``: the arguments are still
checked here, in the caller's thread (a bad op or shape raises at once), and the
work itself goes to the communicator's communication thread (``async_ops``).
"""

from __future__ import annotations

import functools

import torch

from ..comm import Communicator
from ..errors import MessageMismatch
from . import cost_model
from .all_to_all import all_to_all_equal, all_to_all_split
from .async_ops import CollectiveWork, run_collective
from .butterfly import butterfly_allreduce_
from .checks import _agree_on_root, _check, _check_root, _check_split, _describe, _explained
from .ops import Flat, check_op, chunk_bounds, finish_
from .ring import ring_allgather_, ring_reduce_scatter_
from .rooted import star_broadcast, star_reduce, tree_broadcast, tree_reduce
from .shm_allreduce import shm_allreduce
from .signature import signature_tag

ALLREDUCE_ALGORITHMS = ("auto", "star", "tree", "ring", "butterfly", "shm")
ROOTED_ALGORITHMS = ("auto", "star", "tree")


def broadcast(
    comm: Communicator, tensor: torch.Tensor, src: int = 0, algorithm: str = "auto", async_op: bool = False
) -> torch.Tensor | CollectiveWork:
    """Copy ``src``'s tensor into every rank's ``tensor`` (in place).

    star: the root sends p-1 messages; tree: ceil(log2 p) rounds (see ``rooted``);
    ``auto`` is tree. Both start with one round of empty messages that checks the
    ranks agree (``_agree_on_root``). ``async_op=True``: returns a ``CollectiveWork``
    at once (see ``async_ops``); its ``wait()`` returns ``tensor``.
    """
    _check(comm, tensor, "broadcast")
    _check_root(comm, src, "src")
    if algorithm not in ROOTED_ALGORITHMS:
        raise ValueError(f"unknown broadcast algorithm {algorithm!r}; choose one of {ROOTED_ALGORITHMS}")
    algorithm = "star" if algorithm == "star" else "tree"
    body = functools.partial(_broadcast, comm, tensor, src, algorithm)
    return run_collective(comm, lambda: f"broadcast(src={src}, {_describe(tensor)})", body, async_op)


def _broadcast(comm: Communicator, tensor: torch.Tensor, src: int, algorithm: str) -> torch.Tensor:
    if comm.world_size == 1:
        return tensor
    flat = Flat(tensor)
    try:
        tag = signature_tag("broadcast", tensor, src, algorithm)
        _agree_on_root(comm, tag)
        (star_broadcast if algorithm == "star" else tree_broadcast)(comm, flat.flat, src, tag)
    except MessageMismatch as error:
        raise _explained("broadcast", error) from error
    return flat.commit()


def reduce(
    comm: Communicator,
    tensor: torch.Tensor,
    dst: int = 0,
    op: str = "sum",
    algorithm: str = "auto",
    async_op: bool = False,
) -> torch.Tensor | CollectiveWork:
    """Combine every rank's tensor with ``op`` into ``dst``'s tensor (in place on ``dst``;
    the other ranks' tensors are left unchanged). Like ``broadcast``, it starts with
    one round of empty messages that checks the ranks agree. ``async_op=True``:
    returns a ``CollectiveWork`` whose ``wait()`` returns ``tensor``."""
    _check(comm, tensor, "reduce")
    _check_root(comm, dst, "dst")
    check_op(op, tensor)
    if algorithm not in ROOTED_ALGORITHMS:
        raise ValueError(f"unknown reduce algorithm {algorithm!r}; choose one of {ROOTED_ALGORITHMS}")
    algorithm = "star" if algorithm == "star" else "tree"
    body = functools.partial(_reduce, comm, tensor, dst, op, algorithm)
    return run_collective(comm, lambda: f"reduce(dst={dst}, op={op!r}, {_describe(tensor)})", body, async_op)


def _reduce(comm: Communicator, tensor: torch.Tensor, dst: int, op: str, algorithm: str) -> torch.Tensor:
    if comm.world_size == 1:
        return tensor
    flat = Flat(tensor)
    try:
        tag = signature_tag("reduce", tensor, dst, op, algorithm)
        _agree_on_root(comm, tag)
        (star_reduce if algorithm == "star" else tree_reduce)(comm, flat.flat, dst, op, tag)
    except MessageMismatch as error:
        raise _explained("reduce", error) from error
    if comm.rank == dst:
        finish_(flat.flat, op, comm.world_size)
        flat.commit()
    return tensor


def allreduce(
    comm: Communicator, tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto", async_op: bool = False
) -> torch.Tensor | CollectiveWork:
    """Every rank's ``tensor`` becomes the combination (``op``) of all ranks' tensors, in place.

    Algorithms (p ranks, n bytes; bytes are sent per rank):

    ==========  ===========================  ====================  ===========================
    algorithm   how                          rounds (latencies)    bytes sent
    ==========  ===========================  ====================  ===========================
    star        reduce to 0, broadcast       2 (root: 2(p-1))      n (root: (p-1) n)
    tree        binomial reduce + broadcast  2 ceil(log2 p)        up to 2 log2(p) n
    ring        reduce-scatter + allgather   2 (p-1)               2 (p-1)/p n
    butterfly   recursive halving+doubling   2 log2 p (+2)         2 (p-1)/p n (+2n folded)
    shm         shared workspace (shm only)  1-2 barriers/piece    none (memcpy)
    ==========  ===========================  ====================  ===========================

    ``auto`` picks ``shm`` when the communicator has a ``shared_workspace`` (the shm
    transport), otherwise the algorithm the alpha-beta cost model predicts to be
    fastest (see ``cost_model``). The root of star and tree is always rank 0, so
    the data messages themselves carry the signature check; no extra round.

    ``async_op=True`` returns a ``CollectiveWork`` at once; the allreduce runs on
    the communicator's communication thread (``async_ops``) and ``wait()``
    returns ``tensor``. Do not read or write ``tensor`` before ``wait()``.
    """
    _check(comm, tensor, "allreduce")
    check_op(op, tensor)
    if algorithm not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"unknown allreduce algorithm {algorithm!r}; choose one of {ALLREDUCE_ALGORITHMS}")
    workspace = comm.shared_workspace
    if algorithm == "auto":
        algorithm = choose_allreduce(comm, tensor.nbytes)
    elif algorithm == "shm" and workspace is None:
        raise ValueError(
            f"algorithm='shm' works only with transport='shm' (this is {type(comm).__name__}, "
            "which has no shared workspace); use 'ring', 'butterfly', 'tree' or 'star'"
        )
    body = functools.partial(_allreduce, comm, tensor, op, algorithm, workspace)
    name = lambda: f"allreduce(op={op!r}, {algorithm}, {_describe(tensor)})"  # noqa: E731
    return run_collective(comm, name, body, async_op)


def _allreduce(comm: Communicator, tensor: torch.Tensor, op: str, algorithm: str, workspace) -> torch.Tensor:
    p = comm.world_size
    if p == 1:
        return tensor
    tag = signature_tag("allreduce", tensor, op, algorithm)
    if algorithm == "shm":  # the speed path: it checks the signature itself, across the workspace
        shm_allreduce(comm, workspace, tensor, op, tag)
        return tensor
    flat = Flat(tensor)
    vector = flat.flat
    try:
        if algorithm == "star":
            star_reduce(comm, vector, 0, op, tag)
            if comm.rank == 0:
                finish_(vector, op, p)
            star_broadcast(comm, vector, 0, tag)
        elif algorithm == "tree":
            tree_reduce(comm, vector, 0, op, tag)
            if comm.rank == 0:
                finish_(vector, op, p)
            tree_broadcast(comm, vector, 0, tag)
        elif algorithm == "ring":
            bounds = chunk_bounds(vector.numel(), p)
            ring_reduce_scatter_(comm, vector, bounds, op, tag)
            lo, hi = bounds[comm.rank]
            finish_(vector[lo:hi], op, p)
            ring_allgather_(comm, vector, bounds, tag)
        else:
            butterfly_allreduce_(comm, vector, op, tag)
            finish_(vector, op, p)
    except MessageMismatch as error:
        raise _explained("allreduce", error) from error
    return flat.commit()


def choose_allreduce(comm: Communicator, nbytes: int) -> str:
    """What ``algorithm="auto"`` runs for ``nbytes`` on this communicator."""
    if comm.shared_workspace is not None:
        return "shm"
    return cost_model.fastest_allreduce(comm.world_size, nbytes, cost_model.DEFAULTS.get(comm.name))


def allgather(
    comm: Communicator, tensor: torch.Tensor, algorithm: str = "auto", async_op: bool = False
) -> torch.Tensor | CollectiveWork:
    """Return a new tensor of shape (world_size, *tensor.shape) whose row r is rank r's tensor.

    Ring: p-1 steps, each rank sends (p-1) * n bytes in all. ``async_op=True``:
    returns a ``CollectiveWork`` whose ``wait()`` returns the new tensor.
    """
    _check(comm, tensor, "allgather")
    if algorithm not in ("auto", "ring"):
        raise ValueError(f"unknown allgather algorithm {algorithm!r}; choose 'ring'")
    body = functools.partial(_allgather, comm, tensor)
    return run_collective(comm, lambda: f"allgather({_describe(tensor)})", body, async_op)


def _allgather(comm: Communicator, tensor: torch.Tensor) -> torch.Tensor:
    p = comm.world_size
    out = torch.empty((p, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    out[comm.rank].copy_(tensor)
    n = tensor.numel()
    try:
        tag = signature_tag("allgather", tensor)
        ring_allgather_(comm, out.view(-1), [(r * n, (r + 1) * n) for r in range(p)], tag)
    except MessageMismatch as error:
        raise _explained("allgather", error) from error
    return out


def reduce_scatter(
    comm: Communicator, tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto", async_op: bool = False
) -> torch.Tensor | CollectiveWork:
    """Return block ``rank`` (along dim 0) of the combination of every rank's tensor.

    ``tensor.shape[0]`` must be divisible by world_size; the result has shape
    (tensor.shape[0] // world_size, *tensor.shape[1:]). The input is not modified
    (with ``async_op=True``, do not modify it before ``wait()``, which returns the result).
    Ring: p-1 steps, each rank sends (p-1)/p * n bytes.
    """
    _check(comm, tensor, "reduce_scatter")
    check_op(op, tensor)
    if algorithm not in ("auto", "ring"):
        raise ValueError(f"unknown reduce_scatter algorithm {algorithm!r}; choose 'ring'")
    p = comm.world_size
    if tensor.dim() == 0 or tensor.shape[0] % p:
        raise ValueError(
            f"reduce_scatter splits dim 0 into {p} equal blocks, but the tensor has shape "
            f"{tuple(tensor.shape)}: pad dim 0 to a multiple of world_size={p}"
        )
    body = functools.partial(_reduce_scatter, comm, tensor, op)
    return run_collective(comm, lambda: f"reduce_scatter(op={op!r}, {_describe(tensor)})", body, async_op)


def _reduce_scatter(comm: Communicator, tensor: torch.Tensor, op: str) -> torch.Tensor:
    p = comm.world_size
    rows = tensor.shape[0] // p
    work = tensor.detach().contiguous().clone().view(-1)
    block = work.numel() // p
    bounds = [(r * block, (r + 1) * block) for r in range(p)]
    try:
        ring_reduce_scatter_(comm, work, bounds, op, signature_tag("reduce_scatter", tensor, op))
    except MessageMismatch as error:
        raise _explained("reduce_scatter", error) from error
    lo, hi = bounds[comm.rank]
    return finish_(work[lo:hi].clone(), op, p).view(rows, *tensor.shape[1:])


def all_to_all(
    comm: Communicator,
    tensor: torch.Tensor | list[torch.Tensor],
    recv_sizes: list[int] | None = None,
    async_op: bool = False,
) -> torch.Tensor | list[torch.Tensor] | CollectiveWork:
    """Send piece j to rank j; piece i of the result came from rank i (module ``all_to_all``).

    * ``tensor`` of shape (world_size, *chunk): row j goes to rank j; returns a new
      tensor of the same shape whose row i is rank i's row ``rank``.
    * a list of world_size tensors (any first dimension each; the same trailing shape
      and dtype everywhere): tensor j goes to rank j; returns a list of new tensors,
      entry i from rank i. The receivers learn the sizes from one exchange of counts
      (p-1 messages of 8 bytes) unless ``recv_sizes`` gives them (entry i: the first
      dimension rank i sends here; then no exchange).

    Pairwise exchange: p-1 messages per rank (p-1 more for the counts), bytes sent =
    everything but the own piece, (p-1)/p of the input for the equal form; the input
    is not modified. ``async_op=True``: returns a ``CollectiveWork`` whose ``wait()``
    returns the result.
    """
    if isinstance(tensor, (list, tuple)):
        sizes = _check_split(comm, tensor, recv_sizes)
        body = functools.partial(_all_to_all_split, comm, list(tensor), sizes)
        name = lambda: f"all_to_all(list of {len(tensor)}, {_describe(tensor[comm.rank])})"  # noqa: E731
        return run_collective(comm, name, body, async_op)
    _check(comm, tensor, "all_to_all")
    p = comm.world_size
    if tensor.dim() == 0 or tensor.shape[0] != p:
        raise ValueError(
            f"all_to_all sends row j of a (world_size, *chunk) tensor to rank j, but the tensor has "
            f"shape {tuple(tensor.shape)} and world_size={p}: reshape it to ({p}, ...), or pass a list "
            "of world_size tensors for uneven pieces"
        )
    if recv_sizes is not None:
        raise ValueError(
            "recv_sizes is for the list form (uneven pieces); the (world_size, ...) form needs none"
        )
    body = functools.partial(_all_to_all, comm, tensor)
    return run_collective(comm, lambda: f"all_to_all({_describe(tensor)})", body, async_op)


def _all_to_all(comm: Communicator, tensor: torch.Tensor) -> torch.Tensor:
    try:
        return all_to_all_equal(comm, tensor, signature_tag("all_to_all", tensor))
    except MessageMismatch as error:
        raise _explained("all_to_all", error) from error


def _all_to_all_split(comm: Communicator, tensors: list[torch.Tensor], recv_sizes) -> list[torch.Tensor]:
    mine = tensors[comm.rank]
    # the ranks must agree on the trailing shape, the dtype and whether the sizes are exchanged
    like = torch.empty((0, *mine.shape[1:]), dtype=mine.dtype, device="meta")
    tag = signature_tag("all_to_all_split", like, "given" if recv_sizes is not None else "exchanged")
    try:
        return all_to_all_split(comm, tensors, recv_sizes, tag)
    except MessageMismatch as error:
        raise _explained("all_to_all", error, SPLIT_ADVICE) from error


SPLIT_ADVICE = (
    "Every rank must pass the same form (a list of world_size tensors) with the same trailing "
    "shape and dtype, and all pass recv_sizes or none; recv_sizes[i] must be the rows rank i sends."
)


def barrier(comm: Communicator) -> None:
    """Return when every rank has called barrier (a dissemination barrier, ceil(log2 p) rounds).

    Like a blocking collective, it waits for this rank's pending async collectives first."""
    run_collective(comm, lambda: "barrier", comm.barrier, async_op=False)

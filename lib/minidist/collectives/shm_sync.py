"""The shared-memory allreduce's synchronisation: the barrier, and the check that all ranks agree.

``shm_allreduce.py`` (the data path) calls these around every buffer or piece it publishes.

Barrier: rank r writes an increasing epoch number into its own flag and waits
until every flag has reached it -- no locks, no atomics, each flag has a single
writer. Two buffers (small vectors) and three stages (pieces of large ones)
alternate, so a rank may start writing the next operation while a slower one is
still reading this one; it cannot get further ahead, because that needs everyone
at the barrier in between.

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

import functools

import torch

from ..comm import Communicator
from ..errors import MessageMismatch
from ..transport.shm_workspace import HEADER_START, OP_INDEX, SharedWorkspace
from ..wire import KIND_DATA, describe_header, encode_header
from .ops import OPS
from .signature import signature_tag

MESSAGE_ALGORITHMS = ("star", "tree", "ring", "butterfly")


class _State:
    """What this rank keeps between calls: views of the workspace and scratch buffers."""

    def __init__(self, workspace: SharedWorkspace) -> None:
        self.workspace = workspace
        self.numpy_views: dict = {}  # (buffer, dtype, numel) -> [slot 0 .. slot p-1, scratch]
        self.typed: dict = {}
        self.plans: dict = {}  # (stage, dtype, piece numel) -> _PiecePlan
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


def _look_for_message_algorithms(
    comm: Communicator, tensor: torch.Tensor, op: str, flags=None, epoch: int = 0
) -> None:
    """Called while waiting at the barrier: is a peer running a point-to-point
    allreduce of the same tensor instead? Its first message to us would say so.

    Such a message may also belong to the *next* call (a fast peer that has passed
    this barrier and started a plain allreduce of the same tensor), so it counts as a
    disagreement only while some peer has still not reached this barrier (``flags``
    below ``epoch``, read after the message): a peer stuck in another algorithm never does.
    """
    peek = getattr(comm, "peek_tag", None)
    if peek is None:
        return
    theirs = {signature_tag("allreduce", tensor, op, a): a for a in MESSAGE_ALGORITHMS}
    for peer in range(comm.world_size):
        tag = peek(peer) if peer != comm.rank else None
        if tag in theirs and (flags is None or any(flag.value < epoch for flag in flags)):
            raise MessageMismatch(
                f"allreduce: the ranks do not agree: rank {comm.rank} runs algorithm 'shm', but "
                f"rank {peer} sent it a message of allreduce with algorithm {theirs[tag]!r}. "
                "Every rank must pass the same algorithm."
            )


def _barrier(comm: Communicator, state: _State, tensor: torch.Tensor, op: str) -> None:
    workspace = state.workspace
    workspace.epoch += 1
    epoch = workspace.epoch
    workspace.flags[comm.rank].value = epoch
    for peer, flag in enumerate(workspace.flags):
        if flag.value < epoch:  # the check is built only now: nothing to pay when nobody waits
            check = functools.partial(_look_for_message_algorithms, comm, tensor, op, workspace.flags, epoch)
            comm.wait_at_least(flag, epoch, peer, "the shm allreduce barrier: waiting for", check)


def _publish(
    comm: Communicator, state: _State, b: int, tensor: torch.Tensor, op: str, signature: int
) -> None:
    """Write this call's signature (and, when it changed, what it stands for) into the meta record."""
    workspace = state.workspace
    if state.written[b] != signature:
        record = workspace.meta[b][comm.rank]
        record[OP_INDEX] = OPS.index(op)
        record[HEADER_START : HEADER_START + 20] = encode_header(KIND_DATA, tensor)
        state.written[b] = signature
    workspace.signature[b][comm.rank].value = signature


def _check_agreement(comm: Communicator, state: _State, b: int) -> None:
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

"""Lecture 01, Try it 3: an allreduce in which every rank sends its tensor to every other rank."""

import torch

import minidist as md


def direct_allreduce(comm: md.Communicator, x: torch.Tensor) -> None:
    """In place: afterwards every rank's `x` is x_0 + x_1 + ... + x_{p-1}, added in rank order.

    Every rank sends its `x` to each of the p - 1 others and adds up all p tensors itself.
    Messages: every rank sends p - 1 and receives p - 1 (p (p - 1) in all, travelling at once).
    """
    # hints: isend to every other rank first (a handle each), then receive and add in rank
    # order into a new tensor, then wait for the sends, then copy the sum into x
    raise NotImplementedError(
        "TODO(Try it 3): isend x to every other rank, then receive and add in rank order"
    )

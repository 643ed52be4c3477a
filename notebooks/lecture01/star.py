"""Lecture 01, Try it 2: an allreduce through rank 0 (gather and add, then send the sum back)."""

import torch

import minidist as md


def star_allreduce(comm: md.Communicator, x: torch.Tensor) -> None:
    """In place: afterwards every rank's `x` is x_0 + x_1 + ... + x_{p-1}, added in rank order.

    Rank 0 receives every other rank's tensor and adds it to its own, then sends the sum to each.
    Messages: rank 0 receives p - 1 and sends p - 1; every other rank sends 1 and receives 1.
    """
    raise NotImplementedError(
        "TODO(Try it 2): rank 0 receives and adds in rank order, then sends the sum back"
    )

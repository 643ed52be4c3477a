"""How long an allreduce takes on an emulated link, read from the messages the ranks sent (trusted side).

The measured test of task 6 (``fast_allreduce``) times the student's allreduce without a
clock: the grader replays the message transcripts of all ranks (``transcript.py`` has already
checked that every message carries real data its sender had and that every rank received what
its result needs) through the course's link model, the one ``minidist.transport.emulated``
implements and lecture 2 (section 4) predicts with:

* every rank has one outgoing link; a message of ``m`` bytes occupies it for
  ``alpha + m / bandwidth`` and messages leave one after another, in the order they were sent;
* a message is delivered when its link has carried it; receiving costs nothing, and a rank
  can send and receive at once;
* a rank's receive completes at the later of the moment it asks and the delivery; what it
  sends after that leaves no earlier. Compute is free (the model has no ``gamma``).

Every rank starts at 0; the allreduce ends when the last rank has received its last message
and its link has carried its last one. The time depends only on the messages (sizes, peers and
their order in each rank's transcript), never on the grading machine's load, so two gradings
give the same number. Sends are not told apart from ``isend``s (a transcript does not say): a
blocking ``send`` is timed as if it returned at once, which only ever favours the student.

The yardstick at each size is the best of three textbook allreduces under the same model, by
formula: the ring, the butterfly (recursive halving and doubling, Rabenseifner) and recursive
doubling of the whole vector, both folding the ranks beyond the largest power of two in and out.
"""

from __future__ import annotations

import math

import torch

from minidist.transport.emulated import ETHERNET_10G

from .transcript import Message

#: the grader's link: 10 Gbit/s Ethernet (seconds per message, bytes per second)
ALPHA, BANDWIDTH = ETHERNET_10G
#: the sizes (bytes of float32 per rank) of the measured test: latency-bound to bandwidth-bound
SIZES = (256, 4096, 32768, 131072, 1048576)


def emulated_seconds(ranks: list[list[Message]], alpha: float = ALPHA, bandwidth: float = BANDWIDTH) -> float:
    """The emulated time of one collective from every rank's messages (``transcript.replay``'s result).

    A receive is paired with the send it received (``Message.index``: the k-th receive from a
    peer with a tag is that peer's k-th send to this rank with that tag), as the replay did.
    """
    p = len(ranks)
    now = [0.0] * p  # when each rank reaches its next event
    link = [0.0] * p  # when each rank's outgoing link has carried everything so far
    delivered: dict[tuple[int, int, int], list[float]] = {}  # (src, dst, tag) -> delivery times
    position = [0] * p
    while any(position[r] < len(ranks[r]) for r in range(p)):
        progress = False
        for r, messages in enumerate(ranks):
            while position[r] < len(messages):
                message = messages[position[r]]
                if message.op == "send":
                    nbytes = message.numel * torch.empty(0, dtype=message.dtype).element_size()
                    link[r] = max(link[r], now[r]) + alpha + nbytes / bandwidth
                    delivered.setdefault((r, message.peer, message.tag), []).append(link[r])
                else:
                    times = delivered.get((message.peer, r, message.tag), [])
                    if message.index >= len(times):
                        break  # its sender has not got that far yet
                    now[r] = max(now[r], times[message.index])
                position[r] += 1
                progress = True
        if not progress:  # the replay has already failed such transcripts; never reached
            raise AssertionError("the transcripts contradict each other")
    return max(max(now), max(link)) if p else 0.0


def textbook_seconds(
    p: int, nbytes: int, alpha: float = ALPHA, bandwidth: float = BANDWIDTH
) -> dict[str, float]:
    """The three textbook allreduces of ``nbytes`` per rank on ``p`` ranks, under the link model."""
    if p == 1:
        return {"ring": 0.0, "butterfly": 0.0, "recursive doubling": 0.0}
    beta = 1 / bandwidth
    q = 1 << (p.bit_length() - 1)
    fold = 0 if q == p else 2  # one whole vector in before, one out after
    rounds = int(math.log2(q))
    return {
        "ring": 2 * (p - 1) * (alpha + nbytes / p * beta),
        "butterfly": (2 * rounds + fold) * alpha + (2 * (q - 1) / q + fold) * nbytes * beta,
        "recursive doubling": (rounds + fold) * (alpha + nbytes * beta),
    }


def best_seconds(p: int, nbytes: int) -> tuple[str, float]:
    """The fastest textbook allreduce and its time."""
    times = textbook_seconds(p, nbytes)
    name = min(times, key=times.__getitem__)
    return name, times[name]

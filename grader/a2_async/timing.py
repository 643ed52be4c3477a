"""How long a parameter-server worker takes on an emulated clock, read from what the server received.

The measured test of task 4 (``prefetching_worker``) runs one student worker against the
trusted server. The server logs every request in the order it arrived (``workers.reference_server``:
worker, PULL or PUSH, rows, version); with one worker that is the order the worker sent them.
The replay (``reference.prefetch_check``) has already tied every push to the pull it was computed
from and checked its values. This module turns the request order into time, on a model that
depends on nothing but that order and the batches:

* the worker has one outgoing link: a request of ``m`` bytes occupies it for
  ``ALPHA + m / BANDWIDTH`` and requests leave one after another, in the order sent; the server
  answers a pull at once, over its own link (``ALPHA`` + the rows' bytes / ``BANDWIDTH``);
* the worker computes the gradients of batch ``k`` for ``PAIR_SECONDS`` per pair (emulated
  compute: a stated speed, not this machine's), from the moment the answer to its ``k``-th pull
  has arrived and its previous computation is done; the ``k``-th push leaves when that is done;
* a pull leaves as soon as the request before it has been handed to the link (sending never
  blocks the worker).

The yardstick is what no schedule can beat: ``max(total compute, total time the worker's link is
busy)``, the link's time counted for the requests the contract needs (each pull asking for the
batch's rows once), so that sending more than needed can only cost. A worker that pulls, waits,
computes and pushes pays the round trip of every pull on top of its compute; one that asks for
the next batch's rows before computing the current one hides it.
"""

from __future__ import annotations

from minidist.transport.emulated import ETHERNET_10G

#: the emulated worker: a 10 Gbit/s link and a compute speed per pair of the batch
ALPHA, BANDWIDTH = ETHERNET_10G
PAIR_SECONDS = 10e-6  # seconds of gradient computation per pair
INT64, FLOAT32 = 8, 4


def request_bytes(kind: str, rows: int, width: int) -> int:
    """Bytes of a request: the int64 header (kind, version, rows), and a push's float32 gradients.
    ``send_rows`` adds its own one-element length message: one more ``ALPHA`` each."""
    header = (2 + rows) * INT64
    return header + (rows * width * FLOAT32 if kind == "push" else 0)


def cost(kind: str, rows: int, width: int) -> float:
    """Seconds a request occupies the worker's link (``send_rows``: a length, then the rows)."""
    messages = 4 if kind == "push" else 2  # a push is a header and the gradients
    return messages * ALPHA + request_bytes(kind, rows, width) / BANDWIDTH


def emulated_seconds(
    requests: list[tuple[str, int]], pairs: list[int], needed: list[int], width: int
) -> tuple[float, float]:
    """``(time, lower bound)`` of one worker's run: ``requests`` its ``(kind, rows)`` in the order the
    server received them ("pull", "push" or "done"), ``pairs`` the pairs of each of its batches,
    ``needed`` the distinct rows each touches."""
    link = cpu = 0.0  # when the worker's link is free; when its processor is
    answers: list[float] = []  # when the answer to each pull has arrived
    pushes = 0
    for kind, rows in requests:
        if kind == "push":
            cpu = max(cpu, answers[pushes]) + PAIR_SECONDS * pairs[pushes]
            pushes += 1
        link = max(link, cpu) + cost(kind, rows, width)
        if kind == "pull":  # the answer: the rows (length + rows), then the version
            answers.append(link + 3 * ALPHA + (rows * width * FLOAT32 + 2 * INT64) / BANDWIDTH)
    busy = sum(
        cost("pull", n, width) + cost("push", 2 * m, width) for n, m in zip(needed, pairs, strict=True)
    )
    return max(link, cpu), max(busy + cost("done", 0, width), PAIR_SECONDS * sum(pairs))

"""Assignment 2: an asynchronous parameter server, and Hogwild, for GloVe.

Lecture 4 trains GloVe without waiting for anyone. You write the four pieces:

=====  ========================  =========================================================
task   function                  what it does
=====  ========================  =========================================================
1      ``staleness_aware_lr``    the learning rate of a gradient that is ``staleness`` old
2      ``run_server``            rank 0: answer pulls, apply every push at once (AdaGrad)
3      ``ps_worker``             ranks 1..W: pull rows, compute gradients, push them
4      ``hogwild_worker``        every rank: AdaGrad steps on one shared table, no locks
=====  ========================  =========================================================

**The table** is GloVe's (``minidist.glove.model``): ``2V`` rows of ``dim + 1`` floats, row
``i`` word ``i``'s vector and bias, row ``V + j`` context ``j``'s. A batch of pairs touches
the rows ``torch.cat([batch.rows, batch.cols])``, nothing else. AdaGrad keeps, per row, the
sum of squared gradients ``gradsq`` (it starts at 1).

**The parameter server** (tasks 2 and 3). Rank 0 is the server: it owns ``table`` and
``gradsq``; ranks ``1 .. W`` are workers (``W = comm.world_size - 1``). The server counts
the pushes it has applied: its *version* (0 at the start). The protocol, exactly -- the
grader pairs your server with its own workers, and your workers with its own server::

    worker -> server, every request:  send_rows(comm, header, 0)   header: int64 tensor
        PULL  header = [PULL, 0, *rows]       the server answers, to that worker:
                                                  send_rows(comm, table[rows], src)   float32
                                                  comm.send(torch.tensor([version]), src)  int64, 1 element
        PUSH  header = [PUSH, v, *rows]       then send_rows(comm, grads, 0): float32, one
                                              gradient row per row of the header; v is the
                                              version the worker's pull returned. No answer.
        DONE  header = [DONE, 0]              this worker sends nothing more. No answer.

``read_request`` (given, below) reads one request on the server side. A push computed from
version ``v`` and applied when the server is at version ``s`` has **staleness** ``s - v``:
the number of other pushes applied since the worker pulled. The server applies it with
``staleness_aware_lr(lr, s - v)`` and then is at version ``s + 1``.

**Hogwild** (task 4): every rank runs the single-process loop on its part of the pairs,
reading and writing one table in shared memory, without any lock or message.

Which pairs, in which order (tasks 3 and 4, so that results can be compared exactly):
worker ``k`` of ``n`` takes the contiguous part ``order.subset(split(len(order), n, k))``
and, ``config.epochs`` times, its batches ``batch_slices(0, len(mine), config.batch_size)``
in order. Parameter-server workers are numbered ``k = comm.rank - 1``, Hogwild ranks
``k = comm.rank``.

Run the public tests from this folder (``grep -n "TODO(task" async_ps.py``: what is left)::

    python -m pytest -q test_a2_async.py
"""

from __future__ import annotations

import torch

from minidist import Communicator

# the building blocks of your code (noqa: the released file does not use them yet)
from minidist.glove.model import GloveConfig, Pairs, adagrad_update, batch_step, pair_gradients  # noqa: F401
from minidist.glove.trainers.common import batch_slices, split  # noqa: F401
from minidist.parallel.inbox import Inbox  # noqa: F401
from minidist.parallel.messages import recv_rows, send_rows  # noqa: F401

__all__ = [
    "DONE",
    "PULL",
    "PUSH",
    "hogwild_worker",
    "ps_worker",
    "read_request",
    "run_server",
    "staleness_aware_lr",
]

PULL, PUSH, DONE = 0, 1, 2


# --- given helpers: use them, you do not need to change them ----------------------------
def read_request(comm: Communicator, src: int, width: int) -> tuple | None:
    """Read one whole request of worker ``src`` (server side); None when the worker is DONE.

    Returns ``(kind, version, rows, grads)``: ``kind`` is PULL or PUSH, ``rows`` an int64
    tensor, ``grads`` the ``(len(rows), width)`` float32 gradients of a PUSH (None for a PULL).
    ``width`` is ``dim + 1``, the length of a table row. Made to be the ``read`` of an
    ``Inbox``: ``Inbox(comm, workers, lambda comm, src: read_request(comm, src, width))``.
    """
    header = recv_rows(comm, src, torch.int64)
    kind = int(header[0])
    if kind == DONE:
        return None
    grads = recv_rows(comm, src, torch.float32, (width,)) if kind == PUSH else None
    return kind, int(header[1]), header[2:], grads


# --- task 1 ------------------------------------------------------------------------------
def staleness_aware_lr(lr: float, staleness: int) -> float:
    """The learning rate for a gradient that is ``staleness`` versions old.

    Zhang et al. (2016), "Staleness-aware async-SGD": divide the learning rate by the
    staleness, so that a gradient computed from an old table moves it less. A fresh
    gradient (staleness 0) and one a single push old (staleness 1) get the full rate::

        staleness_aware_lr(0.1, 0) == 0.1     staleness_aware_lr(0.1, 4) == 0.025
    """
    # TODO(task 1): lr / max(1, staleness)
    ### BEGIN SOLUTION TODO(task 1): write staleness_aware_lr
    return lr / max(1, staleness)
    ### END SOLUTION


# --- task 2 ------------------------------------------------------------------------------
def run_server(
    comm: Communicator, table: torch.Tensor, gradsq: torch.Tensor, config: GloveConfig
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The asynchronous parameter server (rank 0), until every worker said DONE.

    Workers are ranks ``1 .. comm.world_size - 1``; they speak in any order, so read their
    requests through an ``Inbox``, which hands you ``(src, message)`` in arrival order:

    * PULL: answer ``src`` at once with ``table[rows]`` and the current version;
    * PUSH: apply it at once, ``adagrad_update(table, gradsq, rows, grads, lr)`` with
      ``lr = staleness_aware_lr(config.lr, version - pulled_version)``; record that
      staleness; the version goes up by one;
    * DONE (``read_request`` returns None): that worker is finished.

    ``table`` and ``gradsq`` are updated in place. Returns ``(table, gradsq, staleness)``,
    ``staleness`` the list of the staleness of every push, in the order they were applied.
    """
    # TODO(task 2): the server loop. Hints:
    # - width = table.shape[1]; inbox = Inbox(comm, workers, lambda comm, src: read_request(comm, src, width))
    # - keep a set of the workers still active; loop while it is not empty:
    #       src, message = inbox.get(timeout=comm.timeout)
    #   (a worker that died or returned makes get() raise -- the shm and pipe transports notice a
    #   closed peer and the Inbox re-raises its listener's error -- instead of hanging)
    # - answer a pull with send_rows(...) and then comm.send(torch.tensor([version]), src):
    #   the worker is waiting for exactly these two messages, in this order.
    # - never answer a push: the worker has already moved on.
    ### BEGIN SOLUTION TODO(task 2): write run_server
    width = table.shape[1]
    workers = range(1, comm.world_size)
    active = set(workers)
    inbox = Inbox(comm, workers, lambda comm, src: read_request(comm, src, width))
    version, staleness = 0, []
    while active:
        src, message = inbox.get(timeout=comm.timeout)
        if message is None:
            active.discard(src)
            continue
        kind, pulled, rows, grads = message
        if kind == PULL:
            send_rows(comm, table[rows], src)
            comm.send(torch.tensor([version]), src)
        else:
            staleness.append(version - pulled)
            adagrad_update(table, gradsq, rows, grads, staleness_aware_lr(config.lr, version - pulled))
            version += 1
    return table, gradsq, staleness
    ### END SOLUTION


# --- task 3 ------------------------------------------------------------------------------
def ps_worker(comm: Communicator, order: Pairs, config: GloveConfig) -> list[float]:
    """A parameter-server worker (ranks ``1 .. W``): train on my part of ``order``, then DONE.

    For each of my batches, ``config.epochs`` times (see the module docstring for which):

    1. pull the rows the batch needs, ``rows = torch.cat([batch.rows, batch.cols])``;
       the answer is their values and the version they come from;
    2. ``grads, loss = pair_gradients(values, batch.log_x, batch.f_x)``, ``values`` in the
       order of ``rows`` (``grads[k]`` belongs to ``rows[k]``);
    3. push ``rows``, ``grads`` and the version of step 1.

    Returns one number per epoch: the sum of the ``loss`` of my batches in that epoch.
    """
    # TODO(task 3): the worker loop. Hints:
    # - W = comm.world_size - 1, me = comm.rank - 1; mine = order.subset(split(len(order), W, me))
    # - a header is a tensor: torch.cat([torch.tensor([PUSH, version]), rows]) (both int64)
    # - receive the answer to a pull with recv_rows(comm, 0, torch.float32, (width,)), then the
    #   version into torch.empty(1, dtype=torch.int64) with comm.recv
    # - optional: pull each row once (torch.unique(rows, return_inverse=True)), index the
    #   answer with the inverse; push the rows and grads of the batch as they are, not merged.
    # - after the last batch, send the DONE header; without it the server fails with
    #   "receiving from rank k failed" as soon as your worker returns.
    ### BEGIN SOLUTION TODO(task 3): write ps_worker
    workers, me, width = comm.world_size - 1, comm.rank - 1, config.dim + 1
    mine = order.subset(split(len(order), workers, me))
    losses = []
    for _epoch in range(config.epochs):
        total = 0.0
        for b in batch_slices(0, len(mine), config.batch_size):
            batch = mine.subset(b)
            rows = torch.cat([batch.rows, batch.cols])
            needed, inverse = torch.unique(rows, return_inverse=True)
            send_rows(comm, torch.cat([torch.tensor([PULL, 0]), needed]), 0)
            values = recv_rows(comm, 0, torch.float32, (width,))
            version = torch.empty(1, dtype=torch.int64)
            comm.recv(version, 0)
            grads, loss = pair_gradients(values[inverse], batch.log_x, batch.f_x)
            send_rows(comm, torch.cat([torch.tensor([PUSH, int(version)]), rows]), 0)
            send_rows(comm, grads, 0)
            total += float(loss)
        losses.append(total)
    send_rows(comm, torch.tensor([DONE, 0]), 0)
    return losses
    ### END SOLUTION


# --- task 4 ------------------------------------------------------------------------------
def hogwild_worker(
    comm: Communicator, order: Pairs, table: torch.Tensor, gradsq: torch.Tensor, config: GloveConfig
) -> list[float]:
    """Hogwild (Niu et al., 2011): AdaGrad steps on my part of ``order``, on shared tensors.

    ``table`` and ``gradsq`` are the *same memory* in every rank. Run the single-process loop
    on my part (``k = comm.rank`` of ``comm.world_size``; module docstring), updating them in
    place with ``batch_step(table, gradsq, batch, config.lr)``: no lock, no message. Two ranks
    may update the same row at once and lose an update; with sparse updates SGD converges
    anyway. Returns one number per epoch: the sum of what ``batch_step`` returned.
    """
    # TODO(task 4): a few lines. Hint: mine = order.subset(split(len(order), comm.world_size, comm.rank))
    ### BEGIN SOLUTION TODO(task 4): write hogwild_worker
    mine = order.subset(split(len(order), comm.world_size, comm.rank))
    return [
        sum(
            batch_step(table, gradsq, mine.subset(b), config.lr)
            for b in batch_slices(0, len(mine), config.batch_size)
        )
        for _epoch in range(config.epochs)
    ]
    ### END SOLUTION

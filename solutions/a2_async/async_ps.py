"""Assignment 2: an asynchronous parameter server, and Hogwild, for GloVe.

Lecture 4 trains GloVe without waiting for anyone. You write the three pieces:

=====  ==========================================  ===============================================
task   functions                                   what they do
=====  ==========================================  ===============================================
1      ``staleness_aware_lr``, ``run_server``      rank 0: answer pulls, apply every push at once
                                                   (AdaGrad) at a rate that depends on its staleness
2      ``ps_worker``                               ranks 1..W: pull rows, compute gradients, push
3      ``hogwild_worker``                          every rank: AdaGrad steps on one shared table
4      ``prefetching_worker``                      task 2's worker, made not to wait (measured)
=====  ==========================================  ===============================================

**The table** is GloVe's (``minidist.glove.model``): ``2V`` rows of ``dim + 1`` floats, row
``i`` word ``i``'s vector and bias, row ``V + j`` context ``j``'s. A batch of pairs touches
the rows ``torch.cat([batch.rows, batch.cols])``, nothing else. AdaGrad keeps, per row, the
sum of squared gradients ``gradsq`` (it starts at 1).

**The parameter server** (tasks 1 and 2). Rank 0 is the server: it owns ``table`` and
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

**Hogwild** (task 3): every rank runs the single-process loop on its part of the pairs,
reading and writing one table in shared memory, without any lock or message.

Which pairs, in which order (tasks 2 and 3, so that results can be compared exactly):
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
    "prefetching_worker",
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


# --- task 1: the server --------------------------------------------------------------------------
def staleness_aware_lr(lr: float, staleness: int) -> float:
    """The learning rate for a gradient that is ``staleness`` versions old.

    Zhang et al. (2016), "Staleness-aware async-SGD": divide the learning rate by the
    staleness, so that a gradient computed from an old table moves it less. A fresh
    gradient (staleness 0) and one a single push old (staleness 1) get the full rate::

        staleness_aware_lr(0.1, 0) == 0.1     staleness_aware_lr(0.1, 4) == 0.025
    """
    # TODO(task 1): the rule of the docstring, for every staleness the server can see.
    ### BEGIN SOLUTION TODO(task 1): write staleness_aware_lr
    return lr / max(1, staleness)
    ### END SOLUTION


def run_server(
    comm: Communicator, table: torch.Tensor, gradsq: torch.Tensor, config: GloveConfig
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The asynchronous parameter server (rank 0), until every worker said DONE.

    Workers are ranks ``1 .. comm.world_size - 1`` and speak in any order: handle each request
    as it arrives (an ``Inbox`` hands them to you in arrival order), following the protocol of
    the module docstring exactly -- a pull is answered at once, a push is applied at once and
    never answered, with ``adagrad_update`` at ``staleness_aware_lr(config.lr, staleness)``. A
    worker that dies or returns early must make the server fail, not hang.

    ``table`` and ``gradsq`` are updated in place. Returns ``(table, gradsq, staleness)``,
    ``staleness`` the list of the staleness of every push, in the order they were applied.
    Read: lecture 4, sections 1 to 3.
    """
    # TODO(task 1): the server loop (see the docstring). Questions first:
    # - what does the server need to remember between requests, and what is a version?
    # - how does the loop know it is finished, and what makes it fail instead of waiting forever?
    ### BEGIN SOLUTION TODO(task 1): write run_server
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


# --- task 2: the workers --------------------------------------------------------------
def ps_worker(comm: Communicator, order: Pairs, config: GloveConfig) -> list[float]:
    """A parameter-server worker (ranks ``1 .. W``): train on my part of ``order``, then DONE.

    For each of my batches, ``config.epochs`` times (the module docstring says which): pull the
    rows the batch touches, compute their gradients from the values pulled
    (``pair_gradients``, the single-process loss), push them with the version the pull
    returned. Then say DONE. Returns one number per epoch: the sum of the ``loss`` of my
    batches in that epoch.

    Cost: every row a batch touches crosses the network twice, once each way (lecture 4,
    section 1); a row that appears twice in a batch need not be pulled twice.
    """
    # TODO(task 2): the worker loop (see the docstring). Questions first:
    # - which messages, in which order, does the server expect for each batch (module docstring)?
    # - what must a pushed gradient row line up with, and what does the version you push mean?
    ### BEGIN SOLUTION TODO(task 2): write ps_worker
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


# --- task 3: Hogwild -----------------------------------------------------------------
def hogwild_worker(
    comm: Communicator, order: Pairs, table: torch.Tensor, gradsq: torch.Tensor, config: GloveConfig
) -> list[float]:
    """Hogwild (Niu et al., 2011): AdaGrad steps on my part of ``order``, on shared tensors.

    ``table`` and ``gradsq`` are the *same memory* in every rank. Run the single-process loop
    on my part (``k = comm.rank`` of ``comm.world_size``; module docstring), updating them in
    place with ``batch_step``: no lock, no message. Two ranks may update the same row at once
    and lose an update; with sparse updates SGD converges anyway (lecture 4, section 5).
    Returns one number per epoch: the sum of what ``batch_step`` returned.
    """
    # TODO(task 3): Hogwild (see the docstring).
    ### BEGIN SOLUTION TODO(task 3): write hogwild_worker
    mine = order.subset(split(len(order), comm.world_size, comm.rank))
    return [
        sum(
            batch_step(table, gradsq, mine.subset(b), config.lr)
            for b in batch_slices(0, len(mine), config.batch_size)
        )
        for _epoch in range(config.epochs)
    ]
    ### END SOLUTION


# --- task 4: a worker that does not wait (measured) ---------------------------------------
def prefetching_worker(comm: Communicator, order: Pairs, config: GloveConfig) -> list[float]:
    """``ps_worker``'s contract -- same protocol, same batches in the same order, one pull per
    batch whose answer the batch's push is computed from, DONE at the end, the same return value
    -- on a worker that does not sit idle while its pulls travel.

    Measured, not prescribed. The grader runs one such worker with its own server and times the
    requests the server received, in their order, on an emulated clock (lecture 4, sections 2
    and 6): one outgoing link per rank at 15 us per message plus 1.25 GB/s, 10 us of compute per
    pair of a batch, the server answering at once. It divides the time by what no worker can
    beat, ``max(total compute, total time the worker's link is busy)``. Full points at 1.1x or
    less, half at 1.4x, a quarter at 2.5x; ``ps_worker`` as the library writes it (pull, wait,
    compute, push) reaches 1.86x. The server's table must end within 5% of one process's
    loss: a gradient computed from a table that misses your own last pushes is stale.
    """
    # TODO(task 4): a worker that hides the time its pulls take (see the docstring). Questions:
    # - what can the worker already ask for while it computes, and what may it not know yet?
    # - how stale does that make a push, and what does the server do with a stale push?
    ### BEGIN SOLUTION TODO(task 4): write prefetching_worker
    workers, me, width = comm.world_size - 1, comm.rank - 1, config.dim + 1
    mine = order.subset(split(len(order), workers, me))
    slices = list(batch_slices(0, len(mine), config.batch_size))
    batches = [mine.subset(b) for _epoch in range(config.epochs) for b in slices]

    def pull(batch: Pairs) -> tuple[torch.Tensor, torch.Tensor]:
        """Ask for the rows of ``batch`` (each once); the answer is read later."""
        rows = torch.cat([batch.rows, batch.cols])
        needed, inverse = torch.unique(rows, return_inverse=True)
        send_rows(comm, torch.cat([torch.tensor([PULL, 0]), needed]), 0)
        return rows, inverse

    losses = [0.0] * config.epochs
    pending = pull(batches[0]) if batches else None
    for k, batch in enumerate(batches):
        rows, inverse = pending
        values = recv_rows(comm, 0, torch.float32, (width,))
        version = torch.empty(1, dtype=torch.int64)
        comm.recv(version, 0)
        if k + 1 < len(batches):
            pending = pull(batches[k + 1])  # travels while this batch computes
        grads, loss = pair_gradients(values[inverse], batch.log_x, batch.f_x)
        header = torch.cat([torch.tensor([PUSH, version.item()]), rows])
        send_rows(comm, header, 0)
        send_rows(comm, grads, 0)
        losses[k * config.epochs // len(batches)] += float(loss)
    send_rows(comm, torch.tensor([DONE, 0]), 0)  # no more requests
    return losses
    ### END SOLUTION

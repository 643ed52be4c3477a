"""A parameter-server worker: pull the rows of my part of a batch, compute, push.

The worker holds no table: each step it asks every server for the rows its batch touches,
computes their gradients (the single-process loss, ``glove.model.pair_gradients``) and pushes
them back. The protocol: the package docstring; the messages: ``protocol.py``; the other side:
``server.py``.
"""

from __future__ import annotations

import time

import torch

from ....comm import Communicator
from ....parallel.messages import recv_rows, send_rows
from ...model import Pairs, pair_gradients
from ..common import Clock, batch_slices, split, step_bar
from .protocol import DONE, PULL, PUSH, ParamServerPlan, WorkerReport


def _worker(comm: Communicator, order: Pairs, plan: ParamServerPlan) -> WorkerReport:
    """A worker's loop: pull the rows of my part of a global batch, compute, push.

    In sync mode the step is set by the servers' version: a worker that falls behind
    (its push dropped) skips ahead to the step the servers are at, and computes only
    on values every server gave it at the version of the step it computes for.
    """
    config, servers, workers, mode = plan.config, plan.servers, plan.workers, plan.mode
    me, width = comm.rank - servers, config.dim + 1
    global_batches = list(batch_slices(0, len(order), config.batch_size))
    total_steps = config.epochs * len(global_batches)
    losses: dict[int, float] = {}  # epoch -> summed loss of the batches I computed
    times: dict[int, float] = {}
    pairs_pushed, step = 0, 0
    clock = Clock()
    bar = step_bar(total_steps, f"parameter server ({mode})", plan.progress and me == 0)
    while step < total_steps:
        bar.update(step - bar.n)  # may jump: steps the others closed without me
        epoch, batch = divmod(step, len(global_batches))
        first, last = global_batches[batch].start, global_batches[batch].stop
        # The parts rotate: with backup workers, the part that is dropped is not always the same.
        mine = order.subset(slice(first, last)).subset(split(last - first, workers, (me + step) % workers))
        rows = torch.cat([mine.rows, mine.cols])
        needed, inverse = torch.unique(rows, return_inverse=True)
        owner = needed % servers
        min_version = step if mode == "sync" else 0  # sync: the servers answer once they are at my step
        for s in range(servers):  # ask every server first, then collect: the servers work in parallel
            send_rows(comm, torch.cat([torch.tensor([PULL, min_version]), needed[owner == s]]), s)
        values, versions = torch.empty(len(needed), width), []
        for s in range(servers):
            values[owner == s] = recv_rows(comm, s, torch.float32, (width,))
            version = torch.empty(1, dtype=torch.int64)
            comm.recv(version, s)
            versions.append(int(version))
        if mode == "sync" and max(versions) >= total_steps:
            break  # the others finished every step without me (backup workers)
        if mode == "sync" and max(versions) > step:
            # I fell behind, or the servers are between two steps (see the module
            # docstring): these values make no step's gradient. Ask for the newest step.
            step = max(versions)
            continue
        if me == plan.slow_worker:
            time.sleep(plan.slow_delay)  # an injected straggler: a slower machine computes for longer
        grads, batch_loss = pair_gradients(values[inverse], mine.log_x, mine.f_x)
        losses[epoch] = losses.get(epoch, 0.0) + float(batch_loss)
        pairs_pushed += len(mine)
        row_owner = rows % servers
        for s in range(servers):
            if s > 0 and me == plan.slow_worker:
                time.sleep(plan.slow_link_delay)  # a slow link to the other servers: they hear from me late
            here = row_owner == s
            pushed_at = step if mode == "sync" else versions[s]  # sync: every server answered at ``step``
            send_rows(comm, torch.cat([torch.tensor([PUSH, pushed_at]), rows[here]]), s)
            send_rows(comm, grads[here], s)
        times[epoch] = clock()
        step += 1
    bar.update(total_steps - bar.n)  # every step is done, by me or by the others
    bar.close()
    for s in range(servers):
        send_rows(comm, torch.tensor([DONE, 0]), s)
    return WorkerReport(times, losses, pairs_pushed, clock(), comm.stats)

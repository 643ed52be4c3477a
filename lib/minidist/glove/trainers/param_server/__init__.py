"""Trainer 4: parameter server -- servers own the table, workers only compute.

Ranks ``0 .. S-1`` are servers, ranks ``S .. S+W-1`` workers. Table row x lives on
server ``x % S`` with its AdaGrad state. A worker step::

    worker                                  servers (each its rows)
      rows = rows touched by my batch  ---- pull(rows, at least version v) --->
                                       <--- rows' values, version v' ----------
      grads = pair_gradients(values)
      push(rows, grads, "computed at v'") -----------------------------------> apply

``mode="sync"``: a server applies the pushes of step v together, once a *quorum*
of workers has pushed, and answers pulls for version v + 1 only after that. With
``backup=0`` the quorum is all W workers and the result equals the single-process
trainer (each worker a part of each global batch, as in data parallel). With
``backup=b`` the quorum is W - b: the first W - b gradients to arrive make the
step and late ones are dropped (Chen et al., 2016), so one slow worker no longer
holds everyone back.

*One quorum for all servers.* "The first W - b to arrive" is a race, and with S > 1
servers each would run its own: server 0 could close step v with workers {1, 2} and
server 1 with {1, 3} -- a step no single process takes (half of worker 3's gradient,
half of worker 2's). So server 0 decides and the others follow::

    server 0:  first W - b pushes of step v are from {1, 2}  ->  apply them
               --- decided(v, {1, 2}) ---> servers 1 .. S-1
    server s:  waits for decided(v, ...) and for pushes of step v from workers 1 and 2,
               applies exactly those, drops worker 3's (early or late)

A worker takes part in step v only if *every* server answered its pull at version
v: values of two versions (server 0 has closed v, server 1 has not applied it yet),
or of a step past the one whose batch part it asked for (it fell behind), make a
gradient no step contains, so it pulls again for the newest version instead.

``mode="async"``: pushes are applied as they arrive and pulls answered at once. A
gradient computed at version v' and applied at version v has *staleness* v - v';
the server records it per update. With ``staleness_aware=True`` it is applied with
learning rate ``lr / max(1, staleness)`` (Zhang et al., 2016, "Staleness-aware
async-SGD").

Messages: a worker's request is an int64 row list ``[kind, version, *rows]``; a
push is followed by its gradient rows (``send_rows``). Server 0's decision is
``[DECIDED, version, *worker ranks]`` and its end ``[DONE, 0]``. Servers read from
all their peers at once through an ``Inbox`` (one listener thread per peer).

This package: ``protocol.py`` (the messages, the plan, the reports), ``server.py`` (a
server's loop), ``worker.py`` (a worker's loop), and here which rank is which
(``param_server_rank``) and ``train_param_server``, which launches them and assembles the result.
"""

from __future__ import annotations

import torch

from ....comm import Communicator
from ....launch import launch
from ...model import DEFAULT_CONFIG, GloveConfig, Pairs
from ..common import Clock, TrainResult, total_bytes, training_order
from .protocol import MODES, ParamServerPlan, ServerReport, WorkerReport
from .server import Server
from .worker import _worker

__all__ = [
    "MODES",
    "ParamServerPlan",
    "ServerReport",
    "WorkerReport",
    "param_server_rank",
    "train_param_server",
]


def param_server_rank(comm: Communicator, order: Pairs, plan: ParamServerPlan) -> ServerReport | WorkerReport:
    """Rank ``comm.rank`` of a parameter-server run: a server below ``plan.servers``, else a worker."""
    comm.barrier()
    if comm.rank < plan.servers:
        server = Server(comm, order.vocab_size, plan)
        clock = Clock()
        server.serve()
        return server.report(clock())
    return _worker(comm, order, plan)


def train_param_server(
    pairs: Pairs,
    config: GloveConfig = DEFAULT_CONFIG,
    *,
    workers: int = 2,
    servers: int = 1,
    mode: str = "async",
    backup: int = 0,
    staleness_aware: bool = False,
    slow_worker: int | None = None,
    slow_delay: float = 0.0,
    slow_link_delay: float = 0.0,
    transport: str = "pipe",
    timeout: float = 600.0,
    progress: bool = False,
) -> TrainResult:
    """A parameter server with ``servers`` server and ``workers`` worker processes.

    ``slow_worker`` (0-based among workers) sleeps ``slow_delay`` seconds every step
    before computing, and ``slow_link_delay`` seconds before each push to servers 1, 2, ...
    (a slow link: server 0 may hear from it in time, the others late).
    The result's ``extra`` holds ``staleness`` (one value per applied push, all servers),
    ``dropped`` (pushes a sync server discarded: too late, or not in server 0's quorum), ``servers``, and
    ``quorums``: per server, per sync step, the workers (0-based) whose gradients it applied.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if servers < 1 or workers < 1:
        raise ValueError(f"need at least one server and one worker, got servers={servers}, workers={workers}")
    if not 0 <= backup < workers:
        raise ValueError(f"backup must be between 0 and workers - 1 = {workers - 1}, got {backup}")
    if backup and mode != "sync":
        raise ValueError("backup workers only make sense with mode='sync'")
    plan = ParamServerPlan(
        config=config,
        servers=servers,
        workers=workers,
        mode=mode,
        backup=backup,
        staleness_aware=staleness_aware,
        slow_worker=slow_worker,
        slow_delay=slow_delay,
        slow_link_delay=slow_link_delay,
        progress=progress,
    )
    order = training_order(pairs, config).share_memory_()
    outs = launch(
        param_server_rank,
        servers + workers,
        args=(order, plan),
        transport=transport,
        timeout=timeout,
        threads_per_worker=1,
    )
    server_reports: list[ServerReport] = outs[:servers]
    worker_reports: list[WorkerReport] = outs[servers:]
    table = torch.empty(2 * pairs.vocab_size, config.dim + 1)
    gradsq = torch.empty_like(table)
    for report in server_reports:
        table[report.owned], gradsq[report.owned] = report.table, report.gradsq
    # An epoch ends when its last batch is done; its loss sums what every worker computed.
    history = [
        (
            max(w.epoch_seconds[e] for w in worker_reports if e in w.epoch_seconds),
            sum(w.epoch_loss[e] for w in worker_reports if e in w.epoch_loss) / len(order),
        )
        for e in range(config.epochs)
    ]
    details = [mode] + ["staleness-aware"] * staleness_aware + [f"{backup} backup"] * bool(backup)
    return TrainResult(
        f"parameter server ({', '.join(details)})",
        table,
        gradsq,
        history,
        sum(r.applied_rows for r in server_reports) // 2,  # every pair pushes two rows
        max(w.seconds for w in worker_reports),
        workers,
        total_bytes([r.stats for r in outs]),
        extra={
            "staleness": [s for r in server_reports for s in r.staleness],
            "dropped": sum(r.dropped for r in server_reports),
            "servers": servers,
            "quorums": [r.quorums for r in server_reports],
        },
    )

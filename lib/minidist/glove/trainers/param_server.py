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
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ...comm import CommStats, Communicator
from ...launch import launch
from ...parallel.inbox import Inbox
from ...parallel.messages import recv_rows, send_rows
from ..model import (
    DEFAULT_CONFIG,
    GloveConfig,
    Pairs,
    adagrad_update,
    init_gradsq,
    init_table,
    pair_gradients,
)
from .common import Clock, TrainResult, batch_slices, split, step_bar, total_bytes, training_order

PULL, PUSH, DONE, DECIDED = 0, 1, 2, 3
MODES = ("sync", "async")


@dataclass(frozen=True)
class ParamServerPlan:
    """What every process of one parameter-server run is told (``md.launch`` pickles it to each rank)."""

    config: GloveConfig
    servers: int
    workers: int
    mode: str = "async"
    backup: int = 0  # sync only: a step closes with the first ``workers - backup`` pushes
    staleness_aware: bool = False  # async only: lr / staleness
    slow_worker: int | None = (
        None  # 0-based among workers; sleeps ``slow_delay`` s before each step's compute
    )
    slow_delay: float = 0.0
    slow_link_delay: float = 0.0  # the slow worker also waits this long before each push to servers 1, 2, ...
    progress: bool = False  # worker 0 shows a progress bar

    @property
    def quorum(self) -> int:
        """Pushes that close a synchronous step."""
        return self.workers - self.backup


@dataclass(frozen=True)
class ServerReport:
    """What a server returns: its rows of the table, and what it saw while serving."""

    owned: torch.Tensor  # the table rows this server held (``x % servers == rank``)
    table: torch.Tensor  # their final values
    gradsq: torch.Tensor  # and AdaGrad's G for them
    staleness: list[int]  # one per applied push
    dropped: int  # pushes discarded as too late (sync with backup workers)
    applied_rows: int  # gradient rows applied
    quorums: list[tuple[int, ...]]  # sync: per step, the workers (0-based) whose pushes it applied
    seconds: float
    stats: CommStats


@dataclass(frozen=True)
class WorkerReport:
    """What a worker returns: per epoch, when it finished and the loss of the batches it computed."""

    epoch_seconds: dict[int, float]  # epoch -> seconds when this worker finished its last batch of it
    epoch_loss: dict[int, float]  # epoch -> summed loss of the batches it computed
    pairs_pushed: int
    seconds: float
    stats: CommStats


def _read_request(comm: Communicator, src: int, width: int):
    """One message from a worker or from server 0: (kind, version, rows, grads or None); None for DONE.

    For DECIDED, ``rows`` holds the ranks of the workers whose pushes make the step.
    """
    request = recv_rows(comm, src, torch.int64)
    kind = int(request[0])
    if kind == DONE:
        return None
    grads = recv_rows(comm, src, torch.float32, (width,)) if kind == PUSH else None
    return kind, int(request[1]), request[2:], grads


class Server:
    """One parameter server: rows ``x`` with ``x % servers == rank`` (see the module docstring)."""

    def __init__(self, comm: Communicator, vocab_size: int, plan: ParamServerPlan):
        self.comm, self.plan, self.config, self.servers = comm, plan, plan.config, plan.servers
        full_table = init_table(vocab_size, self.config.dim, self.config.seed)  # every server starts alike
        self.owned = torch.arange(comm.rank, 2 * vocab_size, plan.servers)
        self.table = full_table[self.owned].clone()
        self.gradsq = init_gradsq(vocab_size, self.config.dim)[self.owned].clone()
        self.version = 0
        self.workers = list(range(plan.servers, plan.servers + plan.workers))
        self.active: set[int] = set()  # peers still sending; filled when serving starts
        # Sync with several servers: server 0 decides each step's quorum, the others follow it.
        agree = plan.mode == "sync" and plan.servers > 1
        self.decides, self.follows = agree and comm.rank == 0, agree and comm.rank > 0
        self.decided: dict[int, tuple[int, ...]] = {}  # follower: version -> ranks server 0 chose
        self.collected: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # sync: worker -> this step's push
        self.waiting: dict[int, tuple[int, torch.Tensor]] = {}  # sync: worker -> pull not yet answered
        self.staleness: list[int] = []
        self.quorums: list[tuple[int, ...]] = []
        self.dropped = self.applied_rows = 0

    def serve(self) -> None:
        width = self.config.dim + 1
        peers = self.workers + [0] * self.follows  # a follower also listens to server 0
        self.active = set(peers)
        inbox = Inbox(self.comm, peers, lambda comm, src: _read_request(comm, src, width))
        while self.active:
            src, message = inbox.get(timeout=self.comm.timeout)
            if message is None:
                self.active.discard(src)
            else:
                kind, version, rows, grads = message
                if kind == PULL:
                    self._pull(src, version, rows)
                elif kind == PUSH:
                    self._push(src, version, rows, grads)
                else:
                    self.decided[version] = tuple(rows.tolist())
            if self.plan.mode == "sync":
                self._maybe_step()
        if self.decides:  # every step is decided: the followers may stop once their workers have
            for follower in range(1, self.servers):
                send_rows(self.comm, torch.tensor([DONE, 0]), follower)
        if self.decided or self.collected:
            raise RuntimeError(
                f"server {self.comm.rank} stopped at version {self.version} with steps "
                f"{sorted(self.decided)} decided but not applied (pushes from "
                f"{sorted(self.collected)} waiting): a protocol bug, please report it"
            )

    def _step(self, quorum: tuple[int, ...]) -> None:
        """Close step ``self.version`` with the pushes of the workers in ``quorum``, drop the rest."""
        parts = [self.collected.pop(w) for w in sorted(quorum)]  # worker order: deterministic
        self.dropped += len(self.collected)  # pushed in time, but not chosen (followers only)
        self.collected.clear()
        rows, grads = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        adagrad_update(self.table, self.gradsq, rows, grads, self.config.lr)
        self.staleness += [0] * len(parts)
        self.applied_rows += len(rows)
        self.quorums.append(tuple(w - self.servers for w in sorted(quorum)))
        self.version += 1

    def report(self, seconds: float) -> ServerReport:
        return ServerReport(
            self.owned,
            self.table,
            self.gradsq,
            self.staleness,
            self.dropped,
            self.applied_rows,
            self.quorums,
            seconds,
            self.comm.stats,
        )

    def _answer(self, src, rows):
        send_rows(self.comm, self.table[rows // self.servers], src)
        self.comm.send(torch.tensor([self.version]), src)

    def _pull(self, src, min_version, rows):
        if self.plan.mode == "async" or self.version >= min_version:
            self._answer(src, rows)
        else:
            self.waiting[src] = (min_version, rows)

    def _push(self, src, version, rows, grads):
        local = rows // self.servers
        if self.plan.mode == "async":
            staleness = self.version - version
            self.staleness.append(staleness)
            lr = self.config.lr / max(1, staleness) if self.plan.staleness_aware else self.config.lr
            adagrad_update(self.table, self.gradsq, local, grads, lr)
            self.applied_rows += len(rows)
            self.version += 1
        elif version == self.version:
            self.collected[src] = (local, grads)
        elif version < self.version:  # a straggler's gradient for a step that is already done
            self.dropped += 1
        else:
            raise RuntimeError(
                f"server {self.comm.rank} at version {self.version} got a push for version {version} "
                f"from rank {src}: workers push only what a server answered, a protocol bug"
            )

    def _maybe_step(self):
        if self.follows:
            # Apply the steps server 0 decided, as soon as their chosen pushes are here.
            while self.version in self.decided and self.collected.keys() >= set(self.decided[self.version]):
                self._step(self.decided.pop(self.version))
        else:
            # Workers that can still push for this step: the active ones, and those that
            # pushed and then finished (without the latter a step could close early).
            can_push = len(self.active | self.collected.keys())
            if self.collected and len(self.collected) >= min(self.plan.quorum, can_push):
                quorum = tuple(sorted(self.collected))
                if self.decides:  # tell the followers first: they can apply it while we answer pulls
                    for follower in range(1, self.servers):
                        send_rows(self.comm, torch.tensor([DECIDED, self.version, *quorum]), follower)
                self._step(quorum)
        for src, (min_version, rows) in list(self.waiting.items()):
            if self.version >= min_version:
                del self.waiting[src]
                self._answer(src, rows)


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

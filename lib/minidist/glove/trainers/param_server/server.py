"""One parameter server: it owns rows ``x % servers == rank`` of the table and their AdaGrad state.

Sync mode closes a step once a quorum of workers has pushed (server 0 decides the quorum, the
others follow); async mode applies pushes as they arrive, recording their staleness. The
protocol: the package docstring; the messages: ``protocol.py``; the other side: ``worker.py``.
"""

from __future__ import annotations

import torch

from ....comm import Communicator
from ....parallel.inbox import Inbox
from ....parallel.messages import send_rows
from ...model import adagrad_update, init_gradsq, init_table
from .protocol import DECIDED, DONE, PULL, PUSH, ParamServerPlan, ServerReport, _read_request


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

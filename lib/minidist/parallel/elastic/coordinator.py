"""The quorum coordinator: who takes part in this step, and whose gradients count.

It lives in the launcher process, inside the loop that waits for the ranks (``launcher.py``),
and sees only small messages on each rank's *control* pipe (a socket pair) -- never a tensor.
A round has two phases::

    "ask"     every live rank sends ("ask", total_steps); when *all* live ranks have asked, the
              coordinator forms the quorum: the members (every live rank), the step, the joiners
              (replacements not yet recovered) and a donor (the lowest healthy slot), and
              answers each member -- with fresh pipes to the members it has no pipe with yet;
    "report"  each member reports what it holds; when every member still alive has reported,
              the coordinator commits:
                training round: contributors = the slots whose gradient *every* live reporter
                  received (its own included) -> every survivor applies the same average;
                recovery round: the joiners that received the state become healthy.

A rank that dies is simply no longer waited for (``on_death``); a replacement is one more live
rank, so the next quorum waits for it to ask. A death needs no timeout: a dead rank's process
ends, which the launcher sees at once.

A rank that is alive but stuck is seen only with ``step_timeout`` (Policy): the members' receives
then give up on a peer after ``step_timeout`` s (its gradient is not held), so the others report;
a member still silent ``step_timeout`` s after every other member of the phase has spoken is
``overdue``, and the launcher kills it -- from there on it is a death like any other. So is a
member that spoke but whose gradient some survivor gave up on (slow, not stuck): its late message
would still be in the pipes. A hang is thus detected in about 2 x ``step_timeout``. A process
that never asks (stuck while starting) is not a member of any phase: ``start_timeout`` kills it
once it has been alive that long without asking.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import time
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection

from ...transport.pipe import _grow_pipe


class ElasticError(RuntimeError):
    """The elastic run cannot go on (a quorum below ``min_size``, no healthy peer left)."""


@dataclass
class Member:
    """One incarnation of a slot (slot = rank number; incarnation 0 = started at launch)."""

    slot: int
    incarnation: int
    control: Connection
    healthy: bool  # holds the current model and optimizer state (False: a replacement)
    alive: bool = True  # False once it died or returned
    asked: bool = False
    registered: bool = False  # has asked at least once (a starting replacement has not)
    report: object = None
    peers: set = field(default_factory=set)  # (slot, incarnation) it has pipes with
    started: float = field(default_factory=time.monotonic)  # when its process was started


def send_with_fds(control: Connection, message: object, fds: list[int]) -> None:
    """Send a message, then file descriptors (SCM_RIGHTS: the receiver gets its own copies)."""
    control.send(message)
    if fds:
        with socket.fromfd(control.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            socket.send_fds(sock, [b"F"], fds)


def recv_fds(control: Connection, count: int) -> list[int]:
    """Receive ``count`` file descriptors sent by ``send_with_fds``."""
    with socket.fromfd(control.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        _, fds, _, _ = socket.recv_fds(sock, 1, count)
    if len(fds) != count:
        raise ElasticError(f"expected {count} pipe descriptors from the coordinator, got {len(fds)}")
    return list(fds)


class Coordinator:
    """The state machine of the quorum (see the module docstring). ``min_size``: see Policy."""

    def __init__(
        self,
        min_size: int,
        wait_for_replacements: bool = True,
        step_timeout: float | None = None,
        start_timeout: float | None = None,
    ) -> None:
        self.min_size = min_size
        self.wait_for_replacements = wait_for_replacements
        self.step_timeout = step_timeout
        self.start_timeout = start_timeout
        self.last_spoke = time.monotonic()  # when the phase began or a member last spoke in it
        self.too_slow: set[int] = set()  # slots that spoke but whose gradient was given up on
        self.members: dict[int, Member] = {}  # slot -> its latest incarnation
        self.step = 0  # steps committed so far
        self.total_steps: int | None = None
        self.history: list[list[int]] = []  # contributors of each committed step
        self.phase = "ask"
        self.kind = ""
        self.round: list[tuple[int, int]] = []  # (slot, incarnation) of this round's members
        self.rounds = 0

    def add(self, member: Member) -> None:
        self.members[member.slot] = member

    @property
    def done(self) -> bool:
        return self.total_steps is not None and self.step >= self.total_steps

    def live(self) -> list[Member]:
        return [m for m in self.members.values() if m.alive]

    def on_death(self, slot: int) -> None:
        self.members[slot].alive = False

    def on_message(self, slot: int, message: tuple) -> None:
        member = self.members[slot]
        if message[0] == "ask":
            total = message[1]
            if self.total_steps is not None and total != self.total_steps:
                raise ElasticError(f"slot {slot} trains {total} steps, the others {self.total_steps}")
            self.total_steps = total
            member.asked = member.registered = True
            self.last_spoke = time.monotonic()
        elif message[0] == "report":
            member.report = message[1]
            self.last_spoke = time.monotonic()
        else:
            raise ElasticError(f"slot {slot} sent an unknown control message {message!r}")

    def progress(self) -> None:
        """Form the quorum or commit the round, if everyone it waits for has spoken."""
        live = self.live()
        ready = [m for m in live if m.registered or m.healthy]
        if not self.wait_for_replacements and len(ready) >= self.min_size:
            live = ready  # go on without the replacements still starting up
        if self.phase == "ask" and live and all(m.asked for m in live):
            self._form_quorum(live)
        elif self.phase == "report":
            in_round = [m for m in live if (m.slot, m.incarnation) in self.round]
            if all(m.report is not None for m in in_round):
                self._commit(in_round)

    def overdue(self) -> list[int]:
        """Slots to kill as stuck (see the module docstring); [] without the timeouts."""
        late = []
        if self.start_timeout is not None:  # never asked, alive longer than start_timeout
            now = time.monotonic()
            late = [m.slot for m in self.live() if not m.registered and now - m.started > self.start_timeout]
        return sorted({*late, *self._silent()})

    def _silent(self) -> list[int]:
        """Members stuck in a phase (``step_timeout``); [] without it."""
        if self.step_timeout is None:
            return []
        slow, self.too_slow = sorted(self.too_slow), set()
        if time.monotonic() - self.last_spoke < self.step_timeout:
            return slow
        if self.phase == "ask":  # a process still starting (it never asked) is not waited out
            waited = [m for m in self.live() if m.registered]
            silent = [m for m in waited if not m.asked]
        else:
            waited = [m for m in self.live() if (m.slot, m.incarnation) in self.round]
            silent = [m for m in waited if m.report is None]
            if self.kind == "recover" and any(not m.healthy for m in silent):
                silent = [m for m in silent if not m.healthy]  # the donor may be blocked writing to it
        if silent and len(silent) < len(waited):
            return sorted({*slow, *(m.slot for m in silent)})
        return slow

    # --- the two decisions ---------------------------------------------------------------
    def _form_quorum(self, live: list[Member]) -> None:
        for m in live:
            m.asked = False
        if self.done:  # a replacement that asks after the last step: nothing left to do
            for m in live:
                self._send(m, {"kind": "done", "step": self.step}, [])
            return
        healthy = sorted(m.slot for m in live if m.healthy)
        if len(live) < self.min_size:
            raise ElasticError(
                f"only {len(live)} ranks are alive at step {self.step}, below Policy(min_size="
                f"{self.min_size}); allow more max_restarts or a smaller min_size"
            )
        if not healthy:
            raise ElasticError(
                f"no healthy rank is left at step {self.step} to recover the replacements from"
            )
        members = sorted(m.slot for m in live)
        joiners = sorted(m.slot for m in live if not m.healthy)
        self.kind = "recover" if joiners else "train"
        self.round = [(m.slot, m.incarnation) for m in live]
        self.rounds += 1
        new_pipes = self._connect(live)
        for m in live:
            m.report = None
            peers = [peer for peer, _ in new_pipes[m.slot]]
            fds = [fd for _, pair in new_pipes[m.slot] for fd in pair]
            message = {"kind": self.kind, "step": self.step, "members": members, "joiners": joiners}
            self._send(m, {**message, "donor": healthy[0], "new_peers": peers}, fds)
        for conn in self._pipe_ends:
            conn.close()  # the members hold their copies; EOF works only if we drop ours
        self.phase = "report"
        self.last_spoke = time.monotonic()

    def _connect(self, live: list[Member]) -> dict[int, list]:
        """Fresh pipes for each pair of members that has none yet (a replacement and the rest)."""
        new_pipes: dict[int, list] = {m.slot: [] for m in live}
        self._pipe_ends = []
        for a, b in itertools.combinations(sorted(live, key=lambda m: m.slot), 2):
            if (b.slot, b.incarnation) in a.peers:
                continue
            read_ab, write_ab = Pipe(duplex=False)  # a -> b
            read_ba, write_ba = Pipe(duplex=False)  # b -> a
            for writer in (write_ab, write_ba):
                _grow_pipe(writer.fileno())
            new_pipes[a.slot].append((b.slot, (read_ba.fileno(), write_ab.fileno())))
            new_pipes[b.slot].append((a.slot, (read_ab.fileno(), write_ba.fileno())))
            a.peers.add((b.slot, b.incarnation))
            b.peers.add((a.slot, a.incarnation))
            self._pipe_ends += [read_ab, write_ab, read_ba, write_ba]
        return new_pipes

    def _commit(self, in_round: list[Member]) -> None:
        self.phase = "ask"
        self.last_spoke = time.monotonic()
        if not in_round:
            return  # every member died: the next quorum (of replacements) finds no donor
        if self.kind == "train":
            held = [set(m.report) for m in in_round]
            contributors = sorted(set.intersection(*held))
            self.too_slow |= {m.slot for m in in_round if m.slot not in contributors}
            self.history.append(contributors)
            self.step += 1
            for m in in_round:
                self._send(m, ("commit", contributors), [])
        else:
            recovered = sorted(m.slot for m in in_round if not m.healthy and m.report is True)
            for m in in_round:
                m.healthy = m.healthy or m.slot in recovered
                self._send(m, ("commit", recovered), [])

    @staticmethod
    def _send(member: Member, message: object, fds: list[int]) -> None:
        with contextlib.suppress(OSError):  # it just died: its sentinel will tell the launcher
            send_with_fds(member.control, message, fds)

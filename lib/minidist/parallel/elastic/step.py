"""The fault-tolerant step, on each rank: ask for the quorum, exchange gradients, apply the commit.

One training round (k members; g_r is member r's flat gradient, n its number of elements)::

    ask the coordinator      -> quorum: members, step            (1 small control message each way)
    forward + backward       -> g_me
    isend g_me to each member, recv g_r from each member         ((k - 1) n elements out, as many in)
        a dead member: recv ends with end-of-file (PeerError) -> we just do not hold g_r
    report the slots we hold -> commit: the contributors C (held by every survivor)
    g = (g_c1 + g_c2 + ... ) / |C|, summed in slot order c1 < c2 < ...   (``average_in_order``)
    optimizer.step()

Because every survivor adds the same tensors in the same order, the survivors stay bit-for-bit
equal, and a one-process replay that adds the same gradients in the same order gets the same
bits too: the test (tests/lib/parallel/test_elastic.py) checks exactly that.

A recovery round (the quorum has joiners, i.e. replacements): the donor -- the lowest healthy
slot -- sends each joiner one message with the model's and the optimizer's state, the step and
the history (``torch.save`` bytes, preceded by their length), point to point over the pipes the
coordinator has just handed out; each joiner reports whether it got it all. No training happens
in a recovery round: the next round is a training round at full size. Random number generator
states are not sent: a model with dropout, or batches drawn from a global generator, makes a
replacement differ from the replay; seed from (slot, step), as the tests do.

All communication of an elastic worker goes through ``FaultTolerant``: a replacement starts
with no pipes to its peers until its first quorum hands them out, so a plain ``md.allreduce``
before it would find none.

``on_point(point, step)``, if given, is called at named points -- "before_allreduce",
"mid_allreduce" (after the first gradient send), "after_allreduce", "donor_mid_send" (after the
length, before the state), "joiner_recovering" -- so a test can SIGKILL a rank exactly there.
Two more: "after_ask" (asked, the quorum not yet answered) and "after_report" (the commit received).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

import torch

from ...comm import Communicator
from ...errors import PeerError
from .coordinator import ElasticError, recv_fds

_CONTEXT: dict | None = None  # set in each elastic worker by launcher._Entry: control pipe, slot, incarnation


def identity() -> tuple[int, int]:
    """(slot, incarnation) of this process: incarnation 0 was started by the launch, 1 is the
    first replacement of that slot, and so on."""
    if _CONTEXT is None:
        raise RuntimeError("not in an elastic launch: use md.launch(..., elastic=elastic.Policy(...))")
    return _CONTEXT["slot"], _CONTEXT["incarnation"]


def average_in_order(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """(g_0 + g_1 + ... + g_{k-1}) / k, added left to right: the one order every rank uses."""
    total = grads[0].clone()
    for g in grads[1:]:
        total += g
    return total / len(grads)


def exchange(
    comm: Communicator,
    flat: torch.Tensor,
    members: list[int],
    me: int,
    step: int,
    on_point: Callable[[str, int], None] | None = None,
) -> dict[int, torch.Tensor]:
    """Send ``flat`` (our gradient) to every other member and receive theirs: ``{slot: gradient}``.

    A dead member is skipped (its receive ends with PeerError: we just do not hold its gradient).
    Every receive is posted before the first send: a gradient larger than a pipe's buffer
    (1 MiB) is then drained by the peer's receive while we write it, where blocking sends on
    both sides first would deadlock (each waits for the other to read). Bytes out: (k - 1) x
    ``flat``'s bytes, k = len(members). ``on_point("mid_allreduce", step)`` after the first send.
    """
    others = [m for m in members if m != me]
    held = {me: flat}
    receives = []
    for peer in others:
        buffer = torch.empty_like(flat)
        try:
            receives.append((peer, buffer, comm.irecv(buffer, peer, tag=step + 1)))
        except PeerError:
            pass
    works = []
    for i, peer in enumerate(others):
        try:
            works.append(comm.isend(flat, peer, tag=step + 1))
            if i == 0:
                works.pop().wait()
                if on_point is not None:
                    on_point("mid_allreduce", step)
        except PeerError:
            pass
    for peer, buffer, work in receives:
        try:
            work.wait()
            held[peer] = buffer
        except PeerError:
            pass
    for work in works:
        try:
            work.wait()
        except PeerError:
            pass
    return held


_library_exchange = exchange  # FaultTolerant's keyword ``exchange`` shadows the name there


class FaultTolerant:
    """Data-parallel training that goes on when ranks die and takes replacements in.

    Build the model identically on every rank (same seed). ``history[s]`` lists the slots whose
    gradients were averaged at step s. ``comm`` must be the communicator of an elastic launch.
    ``optimizer``: anything with ``step()``, ``state_dict()`` and ``load_state_dict()`` (a
    torch.optim optimizer, or your own); we zero the gradients through the model.

    Two seams, for exercises: ``exchange(comm, flat, members, me, step) -> {slot: gradient}``
    (default: this module's ``exchange``) and ``average(gradients in slot order) -> flat``
    (default ``average_in_order``).
    """

    def __init__(
        self,
        comm: Communicator,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        on_point: Callable[[str, int], None] | None = None,
        *,
        exchange: Callable[..., dict[int, torch.Tensor]] | None = None,
        average: Callable[[Sequence[torch.Tensor]], torch.Tensor] | None = None,
    ) -> None:
        if _CONTEXT is None:
            raise RuntimeError(
                "FaultTolerant needs an elastic launch: md.launch(worker, world_size, "
                "transport='pipe', elastic=elastic.Policy(min_size=..., max_restarts=...))"
            )
        self.comm, self.model, self.optimizer = comm, model, optimizer
        self.total_steps = total_steps
        self.on_point = on_point or (lambda point, step: None)
        self.exchange = exchange or _library_exchange  # the seams (assignment a9)
        self.average = average or average_in_order  # average(grads in slot order) -> flat
        self.slot, self.incarnation = identity()
        self._control: Connection = _CONTEXT["control"]
        self.step = 0
        self.history: list[list[int]] = []
        self.recoveries = 0  # recovery rounds this rank took part in
        self.recovered_bytes = 0  # bytes of state this rank received as a joiner

    def _ask(self) -> dict:
        self._control.send(("ask", self.total_steps))
        self.on_point("after_ask", self.step)
        quorum = self._control.recv()
        peers = quorum.get("new_peers", [])
        if peers:  # pipes to a replacement (or, for a replacement, to everyone)
            fds = recv_fds(self._control, 2 * len(peers))
            for i, peer in enumerate(peers):
                self._install_pipe(peer, fds[2 * i], fds[2 * i + 1])
        return quorum

    def _install_pipe(self, peer: int, read_fd: int, write_fd: int) -> None:
        """Replace our pipes with ``peer`` (those of its dead predecessor) by fresh ones."""
        comm = self.comm
        for table in (comm._readers, comm._writers):
            old = table.pop(peer, None)
            if old is not None:
                old.close()
        comm._readers[peer] = Connection(read_fd, readable=True, writable=False)
        comm._writers[peer] = Connection(write_fd, readable=False, writable=True)
        comm._inline.pop(peer, None)

    def _report(self, what: object) -> object:
        self._control.send(("report", what))
        kind, value = self._control.recv()
        return value

    def train_step(self, closure: Callable[[int], torch.Tensor]) -> float | None:
        """One step: ``closure(step)`` returns this rank's loss (we call backward). Returns the
        loss, or None if the run had already ended (a replacement that came too late)."""
        while True:
            quorum = self._ask()
            if quorum["kind"] == "done":
                self.step = quorum["step"]
                return None
            if quorum["kind"] == "recover":
                self._recover(quorum)
                continue
            break
        step = quorum["step"]
        if step != self.step:
            raise RuntimeError(f"slot {self.slot} is at step {self.step} but the quorum at step {step}")
        self.model.zero_grad(set_to_none=False)
        loss = closure(step)
        loss.backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        unused = [n for n, p in self.model.named_parameters() if p.requires_grad and p.grad is None]
        if unused:  # its gradient would be missing here and present elsewhere: lengths would differ
            raise ElasticError(
                f"slot {self.slot}, step {step}: parameters {unused[:3]} got no gradient; every rank "
                "must send every trainable parameter's gradient: use them in the loss, or set "
                "requires_grad=False on those that no rank trains"
            )
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.on_point("before_allreduce", step)
        held = self._exchange(flat, quorum["members"], step)
        self.on_point("after_allreduce", step)
        contributors = self._report(sorted(held))
        self.on_point("after_report", step)
        if not contributors:  # possible only when every receive timed out (Policy.step_timeout)
            raise ElasticError(f"slot {self.slot}, step {step}: the coordinator committed no contributors")
        average = self.average([held[c] for c in contributors])
        offset = 0
        for p in params:
            p.grad.copy_(average[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.optimizer.step()
        self.history.append(list(contributors))
        self.step += 1
        return float(loss.detach())

    def _exchange(self, flat: torch.Tensor, members: list[int], step: int) -> dict[int, torch.Tensor]:
        """The gradient exchange of this step: the seam's ``exchange`` (the library's by default)."""
        if self.exchange is exchange:
            return exchange(self.comm, flat, members, self.slot, step, on_point=self.on_point)
        return self.exchange(self.comm, flat, members, self.slot, step)

    def _recover(self, quorum: dict) -> None:
        """A recovery round: the donor sends the state to each joiner; everyone reports."""
        self.recoveries += 1
        step, donor, joiners = quorum["step"], quorum["donor"], quorum["joiners"]
        ok = True
        if self.slot == donor:
            buffer = io.BytesIO()
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
            torch.save({**state, "step": step, "history": self.history}, buffer)
            blob = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
            for joiner in joiners:
                try:
                    self.comm.send(torch.tensor([blob.numel()]), joiner)
                    self.on_point("donor_mid_send", step)
                    self.comm.send(blob, joiner)
                except PeerError:
                    pass  # that joiner died; it will not report
        elif self.slot in joiners:
            self.on_point("joiner_recovering", step)
            try:
                size = self.comm.recv(torch.zeros(1, dtype=torch.int64), donor)
                blob = self.comm.recv(torch.empty(int(size), dtype=torch.uint8), donor)
                state = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
                self.step, self.history = state["step"], [list(c) for c in state["history"]]
                self.recovered_bytes += blob.numel()
            except PeerError:
                ok = False  # the donor died mid-send: we stay a joiner and try again next round
        self._report(ok)

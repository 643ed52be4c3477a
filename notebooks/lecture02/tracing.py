"""Workers for lecture 02, section 2: record every message a collective sends."""

from collections import deque

import torch

import minidist as md


class TracingComm(md.CommView):
    """Wraps a communicator: logs each send and receive, then lets the real one do it.

    A view (md.CommView): every call it does not override goes to the communicator it
    wraps, `self.inner`. A view has no `shared_workspace`, so even algorithm="auto" could
    not take the shared-memory shortcut of md.allreduce; a named point-to-point algorithm
    always runs as asked.
    """

    def __init__(self, comm):
        super().__init__(comm)
        # in program order: (kind, peer, bytes, first element); kind is "send" or "recv"
        self.events = []

    def _log(self, kind, tensor, peer):
        self.events.append((kind, peer, tensor.nbytes, tensor.storage_offset()))

    def send(self, tensor, dst, tag=0):
        self._log("send", tensor, dst)
        self.inner.send(tensor, dst, tag)

    def isend(self, tensor, dst, tag=0):
        self._log("send", tensor, dst)
        return self.inner.isend(tensor, dst, tag)

    def recv(self, tensor, src, tag=0):
        self._log("recv", tensor, src)
        return self.inner.recv(tensor, src, tag)

    def irecv(self, tensor, src, tag=0):
        self._log("recv", tensor, src)
        return self.inner.irecv(tensor, src, tag)


def trace_allreduce(comm, algorithm, numel):
    """Allreduce a vector of `numel` elements through a TracingComm; return the log."""
    traced = TracingComm(comm)
    x = torch.arange(numel, dtype=torch.float32) + 100 * comm.rank
    md.allreduce(traced, x, algorithm=algorithm)
    p = comm.world_size
    expected = p * torch.arange(numel, dtype=torch.float32) + 100 * p * (p - 1) / 2
    assert torch.equal(x, expected), f"rank {comm.rank}: wrong sum"
    return traced.events


def schedule(logs):
    """Turn the ranks' logs into messages (step, src, dst, bytes, first element).

    The model: in one step a rank can send one message and receive one message, and it
    cannot send anything that depends on a message before that message has arrived. The
    k-th send from a to b is matched with the k-th receive by b from a (messages between
    two ranks arrive in order). A message's step is the step in which it is received.
    """
    p = len(logs)
    position = [0] * p  # next event of each rank
    send_free = [0] * p  # first step in which the rank's sending side is free
    recv_free = [0] * p  # ... its receiving side
    ready = [0] * p  # first step after everything the rank has received so far
    in_flight = {}  # (src, dst) -> queue of (step sent, bytes, first element)
    messages = []
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while position[r] < len(logs[r]):
                kind, peer, nbytes, offset = logs[r][position[r]]
                if kind == "send":
                    step = max(send_free[r], ready[r])
                    send_free[r] = step + 1
                    in_flight.setdefault((r, peer), deque()).append((step, nbytes, offset))
                else:
                    queue = in_flight.get((peer, r))
                    if not queue:
                        break  # the matching send has not been simulated yet
                    sent, nbytes, offset = queue.popleft()
                    step = max(sent, recv_free[r], ready[r])
                    recv_free[r] = ready[r] = step + 1
                    messages.append((step, peer, r, nbytes, offset))
                position[r] += 1
                progress = True
    assert all(position[r] == len(logs[r]) for r in range(p)), "unmatched send or receive"
    return sorted(messages)

"""The parameter server's messages and what each process is told and returns.

A worker's request is an int64 row list ``[kind, version, *rows]``; a push is followed by its
gradient rows (``send_rows``). Server 0's decision is ``[DECIDED, version, *worker ranks]`` and
its end ``[DONE, 0]``. ``ParamServerPlan`` is what every rank is told; ``ServerReport`` and
``WorkerReport`` what they return. The protocol itself: the package docstring; the two sides:
``server.py`` and ``worker.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ....comm import CommStats, Communicator
from ....parallel.messages import recv_rows
from ...model import GloveConfig

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

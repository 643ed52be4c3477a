"""What the hidden tests of assignment 2 run inside the worker processes, and their inputs.

The student's ``async_ps`` is imported only here, inside the processes ``md.launch`` starts,
never in the pytest or grader process. Every job takes JSON arguments only (the grading
sandbox receives jobs as JSON) and builds its data from them: a *data* dict (``make_pairs``)
and a *config* dict (``make_config``). This module does not import pytest.

The reference halves of the parameter server let a test pair the student's server with
trusted workers, and the student's workers with a trusted server:

* ``reference_server`` also logs, per applied push, ``[worker rank, pulled version]``;
* ``reference_worker`` reports the version of every pull;
* ``lockstep_worker`` makes the schedule deterministic: the workers pass a token around, all
  pull, then push one after the other, and after each push pull nothing to learn the
  position the server gave it. A test can then replay the run exactly.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile

import numpy as np
import torch

from minidist.errors import PeerError
from minidist.glove.cooccur import count
from minidist.glove.model import GloveConfig, Pairs, adagrad_update, init_gradsq, init_table, pair_gradients
from minidist.glove.trainers.common import batch_slices, split
from minidist.parallel.inbox import Inbox
from minidist.parallel.messages import recv_rows, send_rows

if __package__:  # under pytest: grader.a2_async.workers
    from .. import guard, student_comm
    from . import rules
else:  # in the grading sandbox, where these files are copied side by side
    import guard
    import rules
    import student_comm

PULL, PUSH, DONE = 0, 1, 2
STUDENT_MODULE = "async_ps"


def student():
    """The student's module, imported only after the guard refuses the library's trainers."""
    guard.install_rules(rules)
    return importlib.import_module(STUDENT_MODULE)


def wrapped(comm) -> student_comm.StudentComm:
    """The communicator the student's code gets: point-to-point only (``grader/student_comm.py``)."""
    return student_comm.StudentComm(comm)


# --- inputs ----------------------------------------------------------------------------------
def make_pairs(data: dict) -> Pairs:
    """The pairs of ``data`` in training order: random Zipf-like documents, no files.

    ``{"seed", "vocab", "tokens", "window", "groups"}``. With ``groups = g > 1`` the vocabulary
    is cut into ``g`` ranges, each with its own documents, and the pairs are ``g`` equal,
    consecutive blocks, block ``k`` touching only the rows of range ``k``: split into ``g``
    parts, no two parts share a table row.
    """
    rng = np.random.default_rng(data["seed"])
    vocab, groups = data["vocab"], data.get("groups", 1)
    blocks = []
    for k in range(groups):
        low, high = vocab * k // groups, vocab * (k + 1) // groups
        weights = 1.0 / np.arange(1, high - low + 1)
        ids = low + rng.choice(high - low, size=data["tokens"] // groups, p=weights / weights.sum())
        documents = [ids[start : start + 50] for start in range(0, len(ids), 50)]
        blocks.append(
            Pairs.from_cooccurrence(count(documents, vocab, data["window"])).shuffled(data["seed"] + k)
        )
    if groups == 1:
        return blocks[0]
    size = min(len(block) for block in blocks)
    parts = [block.subset(slice(0, size)) for block in blocks]
    return Pairs(
        *(torch.cat([getattr(p, name) for p in parts]) for name in ("rows", "cols", "log_x", "f_x")), vocab
    )


def make_config(config: dict) -> GloveConfig:
    return GloveConfig(**config)


def initial_state(order: Pairs, config: GloveConfig) -> tuple[torch.Tensor, torch.Tensor]:
    return init_table(order.vocab_size, config.dim, config.seed), init_gradsq(order.vocab_size, config.dim)


def schedule(order: Pairs, config: GloveConfig, parts: int, part: int) -> list[Pairs]:
    """Every batch worker ``part`` of ``parts`` trains on, in order, all epochs."""
    mine = order.subset(split(len(order), parts, part))
    return [
        mine.subset(b) for _ in range(config.epochs) for b in batch_slices(0, len(mine), config.batch_size)
    ]


# --- task 1 ----------------------------------------------------------------------------------
def lr_values(comm, cases: list[list]) -> list[float]:
    fn = student().staleness_aware_lr
    return [float(fn(lr, staleness)) for lr, staleness in cases]


# --- the reference halves of the parameter server --------------------------------------------
def _read(comm, src: int, width: int):
    header = recv_rows(comm, src, torch.int64)
    if int(header[0]) == DONE:
        return None
    grads = recv_rows(comm, src, torch.float32, (width,)) if int(header[0]) == PUSH else None
    return int(header[0]), int(header[1]), header[2:], grads


def reference_server(comm, table, gradsq, config: GloveConfig):
    width, active = table.shape[1], set(range(1, comm.world_size))
    inbox = Inbox(comm, sorted(active), lambda comm, src: _read(comm, src, width))
    version, staleness, log, requests = 0, [], [], []
    while active:
        try:
            src, message = inbox.get(timeout=comm.timeout)
        except RuntimeError as error:  # a worker died: a consequence, not the cause
            raise PeerError(str(error)) from None
        if message is None:
            requests.append([src, DONE, 0, 0])
            active.discard(src)
            continue
        kind, pulled, rows, grads = message
        # every request in the order it arrived: [worker, kind, rows, version answered or pushed]
        requests.append([src, kind, len(rows), version if kind == PULL else pulled])
        if kind == PULL:
            send_rows(comm, table[rows], src)
            comm.send(torch.tensor([version]), src)
        else:
            staleness.append(version - pulled)
            log.append([src, pulled])
            adagrad_update(table, gradsq, rows, grads, config.lr / max(1, version - pulled))
            version += 1
    return table, gradsq, staleness, log, requests


def _pull(comm, rows: torch.Tensor, width: int) -> tuple[torch.Tensor, int]:
    send_rows(comm, torch.cat([torch.tensor([PULL, 0]), rows]), 0)
    values = recv_rows(comm, 0, torch.float32, (width,))
    version = torch.empty(1, dtype=torch.int64)
    comm.recv(version, 0)
    return values, int(version)


def _gradients(comm, batch: Pairs, width: int):
    rows = torch.cat([batch.rows, batch.cols])
    values, version = _pull(comm, rows, width)
    grads, loss = pair_gradients(values, batch.log_x, batch.f_x)
    return rows, grads, float(loss), version


def _push(comm, rows, grads, version: int) -> None:
    send_rows(comm, torch.cat([torch.tensor([PUSH, version]), rows]), 0)
    send_rows(comm, grads, 0)


def reference_worker(comm, order: Pairs, config: GloveConfig) -> dict:
    pulled, losses = [], []
    for batch in schedule(order, config, comm.world_size - 1, comm.rank - 1):
        rows, grads, loss, version = _gradients(comm, batch, config.dim + 1)
        _push(comm, rows, grads, version)
        pulled.append(version)
        losses.append(loss)
    send_rows(comm, torch.tensor([DONE, 0]), 0)
    return {"pulled": pulled, "losses": losses}


def lockstep_worker(comm, order: Pairs, config: GloveConfig) -> dict:
    """Turns in a token ring of the workers: a pull phase, then a push phase, per round."""
    workers, width = comm.world_size - 1, config.dim + 1
    counts = [len(schedule(order, config, workers, k)) for k in range(workers)]
    mine = schedule(order, config, workers, comm.rank - 1)
    prev, nxt = (comm.rank - 2) % workers + 1, comm.rank % workers + 1
    token, turns = torch.zeros(1), 2 * max(counts)
    pulled, positions, losses, pending = [], [], [], None
    for turn in range(turns):
        if workers > 1 and not (comm.rank == 1 and turn == 0):
            comm.recv(token, prev)
        step = turn // 2
        if step < len(mine) and turn % 2 == 0:
            pending = _gradients(comm, mine[step], width)
        elif step < len(mine):
            rows, grads, loss, version = pending
            _push(comm, rows, grads, version)
            _, after = _pull(comm, torch.zeros(0, dtype=torch.int64), width)  # my push is applied
            pulled.append(version)
            positions.append(after - 1)
            losses.append(loss)
        if workers > 1 and not (comm.rank == workers and turn == turns - 1):
            comm.send(token, nxt)
    send_rows(comm, torch.tensor([DONE, 0]), 0)
    return {"pulled": pulled, "positions": positions, "losses": losses}


def parameter_server(comm, data: dict, config: dict, server: str, worker: str) -> dict:
    """Rank 0 a server, ranks 1.. workers; ``server``/``worker``: "student", "reference", "lockstep";
    ``worker`` may also be "prefetch" (the student's ``prefetching_worker``)."""
    order, config = make_pairs(data), make_config(config)
    if comm.rank == 0:
        table, gradsq = initial_state(order, config)
        if server == "student":
            returned = student().run_server(wrapped(comm), table, gradsq, config)
            if not isinstance(returned, (tuple, list)) or len(returned) != 3:
                raise TypeError(
                    f"run_server returned {type(returned).__name__}, not (table, gradsq, staleness)"
                )
            table, gradsq, staleness = returned
            return {"table": table, "gradsq": gradsq, "staleness": [int(s) for s in staleness]}
        table, gradsq, staleness, log, requests = reference_server(comm, table, gradsq, config)
        return {"table": table, "gradsq": gradsq, "staleness": staleness, "log": log, "requests": requests}
    if worker in ("student", "prefetch"):
        function = student().ps_worker if worker == "student" else student().prefetching_worker
        losses = function(wrapped(comm), order, config)
        return {"losses": [float(loss) for loss in losses]}
    return (lockstep_worker if worker == "lockstep" else reference_worker)(comm, order, config)


# --- task 3 ----------------------------------------------------------------------------------
def hogwild(comm, data: dict, config: dict) -> dict:
    """The student's hogwild_worker on a table and gradsq that every rank maps from one file."""
    order, config = make_pairs(data), make_config(config)
    table, gradsq = initial_state(order, config)
    folder = None
    if comm.rank == 0:
        folder = tempfile.mkdtemp(prefix="a2-hogwild-")
        table.numpy().tofile(os.path.join(folder, "table"))
        gradsq.numpy().tofile(os.path.join(folder, "gradsq"))
        name = torch.tensor(list(folder.encode()), dtype=torch.uint8)
        for rank in range(1, comm.world_size):
            send_rows(comm, name, rank)
    else:
        folder = bytes(recv_rows(comm, 0, torch.uint8).tolist()).decode()
    try:
        shared = [
            torch.from_file(os.path.join(folder, key), shared=True, size=t.numel()).view(t.shape)
            for key, t in (("table", table), ("gradsq", gradsq))
        ]
        comm.barrier()
        losses = student().hogwild_worker(wrapped(comm), order, shared[0], shared[1], config)
        comm.barrier()
        result = {"losses": [float(loss) for loss in losses]}
        if comm.rank == 0:
            result.update(table=shared[0].clone(), gradsq=shared[1].clone())
        return result
    finally:
        if comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)

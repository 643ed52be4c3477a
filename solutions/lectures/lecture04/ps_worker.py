"""Workers for lecture 04, section 1 (Try it 1): a parameter-server worker's step."""

import torch

from minidist.glove.model import pair_gradients
from minidist.glove.trainers.common import batch_slices, split
from minidist.glove.trainers.param_server.protocol import DONE, PULL, PUSH
from minidist.glove.trainers.param_server.server import Server
from minidist.parallel.messages import recv_rows, send_rows


def worker_step(comm, servers, mine, step, width):
    """One synchronous step of a worker that holds no table: pull, compute, push. Returns the loss.

    ``mine``: my part of global batch ``step`` (``Pairs``: it touches table rows ``mine.rows`` and
    ``mine.cols``); a table row is ``width = d + 1`` floats. Row ``x`` lives on server
    ``x % servers``; the servers are ranks ``0 .. servers - 1``. Every message is a tensor sent with
    ``send_rows`` and received with ``recv_rows`` (its length travels first), except the version:

    * pull: to every server, int64 ``[PULL, step, *rows]``: the rows of that server my pairs touch,
      each once. The server answers once it has applied step ``step - 1``: the rows' values
      (float32, ``n x width``, in the order asked), then its version (``comm.send`` of a 1-element
      int64 tensor).
    * compute: ``pair_gradients(values, mine.log_x, mine.f_x)``, where ``values`` are the rows of
      ``cat(mine.rows, mine.cols)`` in that order (repeats included).
    * push: to every server, int64 ``[PUSH, step, *rows]`` (its rows of ``cat(mine.rows, mine.cols)``,
      repeats included: AdaGrad squares every gradient row on its own), then their gradient rows.
    """
    # With rows = torch.cat([mine.rows, mine.cols]), torch.unique(rows, return_inverse=True) gives the
    # distinct rows and, for every row, its place among them: values[inverse] puts the pulled rows
    # back in the order of `rows`.
    ### BEGIN SOLUTION TODO(Try it 1): pull the rows, compute their gradients, push them
    rows = torch.cat([mine.rows, mine.cols])
    needed, inverse = torch.unique(rows, return_inverse=True)
    for s in range(servers):  # ask every server first: they look up their rows at the same time
        send_rows(comm, torch.cat([torch.tensor([PULL, step]), needed[needed % servers == s]]), s)
    values = torch.empty(len(needed), width)
    for s in range(servers):
        values[needed % servers == s] = recv_rows(comm, s, torch.float32, (width,))
        comm.recv(torch.empty(1, dtype=torch.int64), s)  # the server's version: step, in sync mode
    grads, loss = pair_gradients(values[inverse], mine.log_x, mine.f_x)
    for s in range(servers):
        here = rows % servers == s
        send_rows(comm, torch.cat([torch.tensor([PUSH, step]), rows[here]]), s)
        send_rows(comm, grads[here], s)
    return float(loss)
    ### END SOLUTION


def sync_worker(comm, order, plan, step_fn):
    """A synchronous worker: my part of every global batch, one ``step_fn`` each; then DONE."""
    servers, workers, config = plan.servers, plan.workers, plan.config
    me = comm.rank - servers  # 0 .. workers - 1
    batches = list(batch_slices(0, len(order), config.batch_size))
    loss = 0.0
    for step in range(config.epochs * len(batches)):
        batch = batches[step % len(batches)]
        part = split(batch.stop - batch.start, workers, (me + step) % workers)  # as the library's workers
        loss += step_fn(comm, servers, order.subset(batch).subset(part), step, config.dim + 1)
    for s in range(servers):
        send_rows(comm, torch.tensor([DONE, 0]), s)
    return loss, comm.stats


def parameter_server(comm, order, plan, step_fn):
    """Ranks ``0 .. plan.servers - 1`` run the library's server, the others ``sync_worker``."""
    comm.barrier()
    if comm.rank < plan.servers:
        server = Server(comm, order.vocab_size, plan)
        server.serve()
        return server.report(0.0)
    return sync_worker(comm, order, plan, step_fn)

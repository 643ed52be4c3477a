"""Lecture 04, section 3 (Try it 3): what an asynchronous server does with a push."""

from minidist.glove.model import adagrad_update


def apply_async_push(server, rows, grads, pushed_at):
    """Apply one push the moment it arrives, as an asynchronous server does; return its staleness.

    ``server`` has the attributes of ``glove.trainers.param_server.server.Server``: ``table`` and
    ``gradsq`` (its own rows only: table row ``x`` is its local row ``x // server.servers``),
    ``version`` (the pushes it has applied so far), ``staleness`` (a list: one entry per push),
    ``config.lr`` and ``plan.staleness_aware``. ``rows``: global table rows, all of them this
    server's; ``grads``: their gradient rows (``glove.model.adagrad_update`` may overwrite them);
    ``pushed_at``: the version the worker computed on.

    The staleness is the number of pushes applied since the worker's pull. Staleness-aware
    (Zhang et al. 2016) divides the learning rate by ``max(1, staleness)``.
    """
    raise NotImplementedError("TODO(Try it 3): the staleness, the learning rate, the update, the version")

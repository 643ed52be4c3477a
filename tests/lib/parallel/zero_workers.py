"""Workers for tests/lib/parallel/test_zero.py that only tests need (a wrong model, a crash).

The run functions shared with notebook 08 and the bench (``config``, ``model_config``,
``make_model``, ``make_data``, ``reference``, ``train_zero``, ``train_fsdp2``,
``compare_with_fsdp2``) live in ``minidist.models.zero_training`` and are re-exported here.
"""

from __future__ import annotations

from minidist.models.zero_training import (  # noqa: F401  (re-exported for test_zero.py)
    compare_with_fsdp2,
    config,
    make_data,
    make_model,
    model_config,
    my_rows,
    reference,
    train_fsdp2,
    train_zero,
)
from minidist.parallel import zero


def mismatched_shapes(comm, cfg: dict) -> None:
    """Rank 1 builds a wider model: construction must fail on every rank with a clear error."""
    wider = {**cfg, "hidden": cfg["hidden"] * 2} if comm.rank == 1 else cfg
    model = make_model(wider)
    if cfg["stage"] == 3:
        zero.FullyShardedModule(model, comm)
    else:
        zero.ZeroOptimizer(model.parameters(), comm, stage=cfg["stage"], lr=1e-3)


def crash_in_step(comm, cfg: dict) -> None:
    """Rank 1 dies before its first backward; rank 0 waits in a collective until the launch timeout."""
    model = make_model(cfg)
    sharded = zero.FullyShardedModule(model, comm)
    ids = my_rows(make_data(cfg)[0], comm.rank, cfg)
    if comm.rank == 1:
        raise RuntimeError("rank 1 crashed on purpose")
    sharded(ids, labels=ids).loss.backward()

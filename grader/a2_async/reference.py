"""Trusted references and checks of assignment 2, computed in one process from the inputs alone.

Used by the checks of ``cases.py`` (under pytest and in the grader, on reports read back from
the sandbox). Never copied into the sandbox. A failure is ``pytest.fail`` with a message for
the student that names what is wrong without giving the expected values away.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

from minidist.glove.model import adagrad_update, batch_step, full_loss, pair_gradients

from . import timing, workers

TOLERANCE = 1e-5  # the protocol's operations are exact; this only forgives a different rounding of lr


def fail(message: str):
    pytest.fail(message, pytrace=False)


def inputs(data: dict, config: dict):
    order, config = workers.make_pairs(data), workers.make_config(config)
    return order, config


def sequential(data: dict, config: dict, parts: int = 1) -> dict:
    """The single-process loop over the batches of each of ``parts`` parts, one part after the other.

    With one part this is what one worker (or one Hogwild rank) must compute; with parts that
    share no table row (``data["groups"] == parts``) it is also what Hogwild computes.
    """
    order, config = inputs(data, config)
    table, gradsq = workers.initial_state(order, config)
    losses, pushes = [], 0
    for part in range(parts):
        batches = workers.schedule(order, config, parts, part)
        per_epoch = len(batches) // config.epochs
        steps = [batch_step(table, gradsq, batch, config.lr) for batch in batches]
        losses.append([sum(steps[e * per_epoch : (e + 1) * per_epoch]) for e in range(config.epochs)])
        pushes += len(batches)
    return {"table": table, "gradsq": gradsq, "losses": losses, "pushes": pushes}


def replay(data: dict, config: dict, parts: int, log: list, what: str) -> dict:
    """The asynchronous run given the order the server applied pushes in, exactly.

    ``log[k] = [worker rank, version it pulled]`` for the k-th applied push; the push is
    that worker's next batch, its gradients computed from the table after ``version`` pushes.
    """
    order, config = inputs(data, config)
    table, gradsq = workers.initial_state(order, config)
    queues = [workers.schedule(order, config, parts, k) for k in range(parts)]
    used, snapshots, staleness = [0] * parts, [table.clone()], []
    losses = [[0.0] * config.epochs for _ in range(parts)]
    if not isinstance(log, list) or len(log) != sum(map(len, queues)):
        made = len(log) if isinstance(log, list) else 0
        fail(f"{what}: {sum(map(len, queues))} pushes expected, {made} made")
    for k, entry in enumerate(log):
        src, pulled = entry
        worker = src - 1
        if not 0 <= worker < parts or used[worker] == len(queues[worker]):
            fail(f"{what}: push {k} came from rank {src}, which had no batch left to push")
        if not 0 <= pulled <= k:
            fail(f"{what}: push {k} (rank {src}) says it was computed at version {pulled}, after {k} pushes")
        batch, epoch = queues[worker][used[worker]], used[worker] * config.epochs // len(queues[worker])
        used[worker] += 1
        rows = torch.cat([batch.rows, batch.cols])
        grads, loss = pair_gradients(snapshots[pulled][rows], batch.log_x, batch.f_x)
        losses[worker][epoch] += float(loss)
        adagrad_update(table, gradsq, rows, grads, config.lr / max(1, k - pulled))
        staleness.append(k - pulled)
        snapshots.append(table.clone())
    return {"table": table, "gradsq": gradsq, "staleness": staleness, "losses": losses}


# --- checks ----------------------------------------------------------------------------------
def check_tensor(where: str, got, expected: torch.Tensor) -> None:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        fail(f"{where}: got {shape}, expected a tensor of shape {tuple(expected.shape)}")
    wrong = ~((got.double() - expected.double()).abs() <= TOLERANCE)
    if wrong.any():
        index = tuple(wrong.nonzero()[0].tolist())
        fail(
            f"{where}: element {index} is {got[index].item():.6g}, expected {expected[index].item():.6g} "
            f"({int(wrong.sum())} of {expected.numel()} elements are wrong)"
        )


def check_losses(where: str, got, expected: list[float]) -> None:
    if not isinstance(got, list) or len(got) != len(expected):
        fail(f"{where}: returned {got!r:.80}, expected one loss per epoch ({len(expected)} numbers)")
    for epoch, (value, reference) in enumerate(zip(got, expected)):
        if not abs(value - reference) <= 1e-5 * abs(reference) + 1e-6:
            fail(f"{where}: the loss of epoch {epoch} is {value:.6g}, expected {reference:.6g}")


def check_reports(outs, world_size: int, what: str, keys: tuple[str, ...] = ("table", "gradsq")) -> None:
    if not isinstance(outs, list) or len(outs) != world_size or not all(isinstance(o, dict) for o in outs):
        fail(f"{what}: expected a report from each of {world_size} ranks")
    if any(key not in outs[0] for key in keys):
        fail(f"{what}: rank 0 did not report {keys}")


def check_exact(what: str, got: dict, expected: dict) -> None:
    check_tensor(f"{what}: the table", got["table"], expected["table"])
    check_tensor(f"{what}: gradsq", got["gradsq"], expected["gradsq"])


def check_staleness(what: str, got, expected: list[int]) -> None:
    if got != expected:
        at = next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        shown = got[at] if at < len(got) else "missing"
        wanted = expected[at] if at < len(expected) else "none"
        fail(
            f"{what}: the staleness of push {at} is {shown}, expected {wanted} "
            f"({len(got)} values returned, {len(expected)} pushes applied)"
        )


def check_converged(what: str, data: dict, config: dict, table, factor: float = 2.0) -> None:
    """The loss went well down: at most ``factor`` times the single-process loop's."""
    order, glove_config = inputs(data, config)
    start = full_loss(workers.initial_state(order, glove_config)[0], order)
    reference = full_loss(sequential(data, config)["table"], order)
    if not isinstance(table, torch.Tensor) or table.shape != (2 * order.vocab_size, glove_config.dim + 1):
        fail(f"{what}: no table of the right shape")
    loss = full_loss(table, order)
    if not loss <= min(factor * reference, start / 2):
        fail(
            f"{what}: the loss is {loss:.4f} after training (it was {start:.4f} before; one process "
            f"gets {reference:.4f}); updates lost or applied wrongly?"
        )


# --- the checks of each kind of test ------------------------------------------------------
def lr_check(cases: list) -> Callable:
    def check(outs):
        got = outs[0] if isinstance(outs, list) and outs else None
        if not isinstance(got, list) or len(got) != len(cases):
            fail(f"staleness_aware_lr: expected {len(cases)} results")
        for (lr, staleness), value in zip(cases, got):
            expected = lr / max(1, staleness)
            if not abs(value - expected) <= 1e-12 * expected:
                fail(f"staleness_aware_lr({lr}, {staleness}) is {value}, expected {expected}")

    return check


def sequential_check(what: str, d: dict, c: dict, student_side: str) -> Callable:
    """One worker: the table and gradsq of the single-process loop; staleness 0; its losses."""

    def check(outs):
        check_reports(outs, 2, what, ("table", "gradsq", "staleness"))
        expected = sequential(d, c)
        check_exact(what, outs[0], expected)
        check_staleness(
            f"{what}: with one worker every push is fresh", outs[0]["staleness"], [0] * expected["pushes"]
        )
        if student_side == "worker":
            check_losses(f"{what}: ps_worker's return value", outs[1].get("losses"), expected["losses"][0])

    return check


def lockstep_check(what: str, d: dict, c: dict, parts: int) -> Callable:
    def check(outs):
        check_reports(outs, parts + 1, what, ("table", "gradsq", "staleness"))
        log = {}
        for rank, report in enumerate(outs[1:], start=1):
            for pulled, position in zip(report["pulled"], report["positions"]):
                if position in log:
                    fail(f"{what}: two pushes were applied as push {position}: is the version counted right?")
                log[position] = [rank, pulled]
        if sorted(log) != list(range(len(log))):
            fail(f"{what}: after {len(log)} pushes the version answered to pulls is not {len(log)}")
        expected = replay(d, c, parts, [log[k] for k in range(len(log))], what)
        check_staleness(what, outs[0]["staleness"], expected["staleness"])
        check_exact(what, outs[0], expected)

    return check


def replay_check(what: str, d: dict, c: dict, parts: int) -> Callable:
    """The trusted server's log of the student's workers' pushes, replayed."""

    def check(outs):
        check_reports(outs, parts + 1, what, ("table", "gradsq", "log"))
        expected = replay(d, c, parts, outs[0]["log"], what)
        check_exact(what, outs[0], expected)
        for rank in range(1, parts + 1):
            where = f"{what}: ps_worker's return value on rank {rank}"
            check_losses(where, outs[rank].get("losses"), expected["losses"][rank - 1])

    return check


#: how much worse than the single-process loop a prefetching worker's table may end (full loss)
PREFETCH_LOSS_FACTOR = 1.05


def prefetch_check(what: str, d: dict, c: dict) -> Callable:
    """One prefetching worker with the trusted server: exact given the versions it pulled, one pull
    per batch in order, the loss within ``PREFETCH_LOSS_FACTOR`` of one process's; returns the
    emulated time over its lower bound (``timing``), from the requests the server received."""

    def check(outs) -> float:
        check_reports(outs, 2, what, ("table", "gradsq", "log", "requests"))
        expected = replay(d, c, 1, outs[0]["log"], what)
        check_exact(what, outs[0], expected)
        check_losses(f"{what}: the return value", outs[1].get("losses"), expected["losses"][0])
        order, config = inputs(d, c)
        batches = workers.schedule(order, config, 1, 0)
        requests, pulled, pushed = [], [], []
        for _src, kind, rows, version in outs[0]["requests"]:
            name = {workers.PULL: "pull", workers.PUSH: "push"}.get(kind, "done")
            requests.append((name, rows))
            (pulled if name == "pull" else pushed if name == "push" else []).append((version, rows))
        if requests[-1:] != [("done", 0)] or len(pulled) != len(batches):
            fail(
                f"{what}: {len(pulled)} pulls for {len(batches)} batches; the contract is one pull per batch"
            )
        needed = [len(torch.unique(torch.cat([b.rows, b.cols]))) for b in batches]
        for k, ((answered, rows), (carried, _)) in enumerate(zip(pulled, pushed)):
            if carried != answered or rows < needed[k]:
                fail(
                    f"{what}: push {k} carries version {carried}, and pull {k} was answered at version "
                    f"{answered} for {rows} rows (batch {k} touches {needed[k]}): the k-th push must be "
                    "computed from the k-th pull, which asks for every row of batch k"
                )
        loss, reference = full_loss(expected["table"], order), full_loss(sequential(d, c)["table"], order)
        if not loss <= PREFETCH_LOSS_FACTOR * reference:
            fail(
                f"{what}: the loss after training is {loss:.5f}, more than {PREFETCH_LOSS_FACTOR:g} times "
                f"one process's ({reference:.5f}): pulls too far ahead make the gradients too stale"
            )
        pairs = [len(b) for b in batches]
        seconds, bound = timing.emulated_seconds(requests, pairs, needed, config.dim + 1)
        return seconds / bound

    return check


def free_check(what: str, d: dict, c: dict, parts: int, trusted_workers: bool) -> Callable:
    """Free-running workers: every push applied once, staleness consistent, the loss went down."""

    def check(outs):
        check_reports(outs, parts + 1, what, ("table", "gradsq", "staleness"))
        pushes = sequential(d, c, parts)["pushes"]
        staleness = outs[0]["staleness"]
        if len(staleness) != pushes:
            fail(f"{what}: {len(staleness)} staleness values for {pushes} pushes")
        if trusted_workers:
            pulled = Counter(v for report in outs[1:] for v in report["pulled"])
            implied = Counter(k - s for k, s in enumerate(staleness))
            if pulled != implied:
                fail(f"{what}: push k with staleness s was computed at version k - s; workers pulled others")
        if any(s < 0 for s in staleness):
            fail(f"{what}: a negative staleness")
        check_converged(what, d, c, outs[0]["table"])

    return check


def hogwild_check(what: str, d: dict, c: dict, ranks: int, exact: bool) -> Callable:
    def check(outs):
        check_reports(outs, ranks, what)
        if not exact:
            check_converged(what, d, c, outs[0]["table"])
            return
        expected = sequential(d, c, parts=ranks)
        check_exact(what, outs[0], expected)
        for rank in range(ranks):
            check_losses(
                f"{what}: the return value on rank {rank}", outs[rank].get("losses"), expected["losses"][rank]
            )

    return check

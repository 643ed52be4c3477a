"""The one-process reference of an elastic run: replay its membership history.

``FaultTolerant`` records ``history[s]``, the slots whose gradients were averaged at step s. A
single process that, at each step, computes those slots' gradients, adds them in slot order and
divides by their count, then takes the optimizer step, must end with the *same bits* as every
survivor -- no matter who died where, or who was recovered from whom::

    history = [[0, 1, 2, 3], [0, 1, 2, 3], [0, 2, 3], ...]      # slot 1 died at step 2
    model, opt = replay(history, make_model, loss_of)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), survivor_params))

Written on its own, parameter by parameter (not with ``FaultTolerant``'s flat buffer), so that a
comparison with it tests the fault-tolerant step rather than repeating it. Cost: one forward and
backward per contributor per step, sum(len(c) for c in history) in all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def replay(
    history: Sequence[Sequence[int]],
    make_model: Callable[[], tuple[torch.nn.Module, object]],
    loss_of: Callable[[torch.nn.Module, int, int], torch.Tensor],
) -> tuple[torch.nn.Module, object]:
    """Train one model through ``history`` in one process; returns (model, optimizer).

    Args:
        history: the contributors of each step, ``FaultTolerant.history`` (slots, any order:
            they are added in increasing slot order, as the survivors do).
        make_model: builds (model, optimizer) exactly as every rank does (same seed).
        loss_of: ``loss_of(model, slot, step)``, slot ``slot``'s loss at ``step`` -- its own batch,
            the same one the run used.
    """
    model, optimizer = make_model()
    params = list(model.parameters())
    for step, contributors in enumerate(history):
        if not contributors:
            raise ValueError(f"history[{step}] is empty: every step has at least one contributor")
        grads = []
        for slot in sorted(contributors):
            model.zero_grad()
            loss_of(model, slot, step).backward()
            grads.append([p.grad.clone() for p in params])
        for i, p in enumerate(params):
            total = grads[0][i].clone()
            for g in grads[1:]:
                total = total + g[i]
            p.grad = total / len(contributors)
        optimizer.step()
    return model, optimizer

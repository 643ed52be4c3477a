"""LARS: layer-wise adaptive rate scaling for SGD with momentum (You, Gitman & Ginsburg, 2017).

With a large batch the learning rate must be large, but one global rate is too large for some
layers and too small for others: the ratio ||w|| / ||∇L(w)|| differs by orders of magnitude
between layers. LARS gives each parameter tensor (a layer) its own *local* rate, proportional
to that ratio, so every layer moves by about the same *relative* amount per step:

    update  = g + wd · w                               (gradient plus weight decay)
    trust   = η · ||w|| / ||update||                   (η: trust coefficient, 0.001 in the paper)
    buf     = momentum · buf + trust · update
    w       = w - lr · buf

Conventions: ``trust = 1`` when ||w|| = 0 (a freshly zeroed layer has no scale to keep) or
||update|| = 0 (nothing to scale); groups with ``trust_ratio=False`` (biases, LayerNorm -- see
``minidist.optim.groups.param_groups``) use ``trust = 1`` and their own ``weight_decay``.
The learning rate is outside the momentum buffer, as in ``torch.optim.SGD`` (the paper puts
it inside; the two agree while lr is constant): with every group's ``trust_ratio=False``
this *is* SGD with momentum (dampening 0, not Nesterov), which the tests check.

Cost: two norms per tensor per step (one extra read of w and of the update) on top of SGD.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["LARS"]


class LARS(torch.optim.Optimizer):
    """SGD with momentum and a per-tensor trust ratio ``trust_coefficient · ||w|| / ||g + wd·w||``.

    ``params``: tensors or groups (``param_groups(model, wd)`` sets ``weight_decay`` and
    ``trust_ratio`` per group). Group keys: ``lr``, ``momentum``, ``weight_decay``,
    ``trust_coefficient``, ``trust_ratio``.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        trust_ratio: bool = True,
    ) -> None:
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0 or trust_coefficient <= 0:
            raise ValueError(
                f"need lr >= 0, 0 <= momentum < 1, weight_decay >= 0, trust_coefficient > 0; got "
                f"lr={lr}, momentum={momentum}, weight_decay={weight_decay}, "
                f"trust_coefficient={trust_coefficient}"
            )
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            trust_ratio=trust_ratio,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for w in group["params"]:
                if w.grad is None:
                    continue
                update = (
                    w.grad.add(w, alpha=group["weight_decay"]) if group["weight_decay"] else w.grad.clone()
                )
                trust = 1.0
                if group["trust_ratio"]:
                    w_norm, u_norm = torch.linalg.vector_norm(w), torch.linalg.vector_norm(update)
                    ratio = group["trust_coefficient"] * w_norm / u_norm
                    trust = torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
                update.mul_(trust)
                state = self.state[w]
                if group["momentum"]:
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = update.clone()  # as torch's SGD: first buf = update
                    else:
                        state["momentum_buffer"].mul_(group["momentum"]).add_(update)
                    update = state["momentum_buffer"]
                w.add_(update, alpha=-group["lr"])
        return loss

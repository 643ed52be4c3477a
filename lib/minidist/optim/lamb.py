"""LAMB: layer-wise adaptive moments for large-batch training (You et al., 2019).

LARS's idea -- scale each layer's step by ||w|| / ||update|| -- applied to Adam's update, with
decoupled weight decay inside the update (as AdamW). Per parameter tensor w, at step t:

    m = β1·m + (1-β1)·g                 v = β2·v + (1-β2)·g²
    m̂ = m / (1-β1ᵗ)                     v̂ = v / (1-β2ᵗ)          (bias correction; optional)
    r = m̂ / (sqrt(v̂) + ε) + wd · w                               (Adam direction + weight decay)
    trust = ||w|| / ||r||                                          (φ(||w||) = ||w||, as the paper)
    w = w - lr · trust · r

Because ``trust · r`` has the norm of w, one step moves every layer by ``lr`` *relative to its
own size* -- a large learning rate cannot blow up a small layer, which is what lets BERT train
with a batch of 32k (76 minutes in the paper).

Conventions: ``trust = 1`` when ||w|| = 0 or ||r|| = 0; groups with ``trust_ratio=False``
(biases, LayerNorm: ``param_groups``) use ``trust = 1``. With ``trust_ratio=False`` everywhere,
``weight_decay=0`` and ``bias_correction=True`` the step is exactly Adam's (tested against
``torch.optim.Adam``). Cost: Adam's two moment buffers (8 bytes per fp32 parameter) plus two
norms per tensor per step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["LAMB"]


class LAMB(torch.optim.Optimizer):
    """Adam's direction plus decoupled weight decay, rescaled per tensor by ``||w|| / ||r||``.

    Group keys: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``trust_ratio``, ``bias_correction``.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        trust_ratio: bool = True,
        bias_correction: bool = True,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"need lr >= 0, eps >= 0, weight_decay >= 0 and betas in [0, 1); got "
                f"lr={lr}, eps={eps}, weight_decay={weight_decay}, betas={betas}"
            )
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            trust_ratio=trust_ratio,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for w in group["params"]:
                if w.grad is None:
                    continue
                g = w.grad
                state = self.state[w]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(w)
                    state["exp_avg_sq"] = torch.zeros_like(w)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                if group["bias_correction"]:
                    m_hat_scale, v_hat_scale = 1 / (1 - beta1**t), 1 / (1 - beta2**t)
                else:
                    m_hat_scale = v_hat_scale = 1.0
                r = (m * m_hat_scale) / ((v * v_hat_scale).sqrt_().add_(group["eps"]))
                if group["weight_decay"]:
                    r.add_(w, alpha=group["weight_decay"])
                if group["trust_ratio"]:
                    w_norm, r_norm = torch.linalg.vector_norm(w), torch.linalg.vector_norm(r)
                    ratio = w_norm / r_norm
                    r.mul_(torch.where((w_norm > 0) & (r_norm > 0), ratio, torch.ones_like(ratio)))
                w.add_(r, alpha=-group["lr"])
        return loss

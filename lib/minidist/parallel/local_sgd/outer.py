"""The outer step of DiLoCo: Nesterov-momentum SGD on the averaged pseudo-gradient.

Each worker i starts a round from the same global parameters theta and takes H inner steps
(AdamW in the paper) on its own data, ending at theta_i. Its *pseudo-gradient* is how far it
moved, taken as a gradient (it points uphill, like one)::

    delta_i = theta - theta_i                 (per worker, no communication)
    delta   = (1/p) sum_i delta_i             (one allreduce: the only message of the round)

and the outer optimizer treats ``delta`` as the gradient of the global parameters. DiLoCo
(Douillard et al. 2023) uses SGD with Nesterov momentum, lr 0.7, momentum 0.9, H = 500
inner steps (8 workers); the update, in torch.optim.SGD's convention (dampening 0)::

    v     <- mu v + delta                     (momentum buffer, starts at 0)
    theta <- theta - lr (delta + mu v)        (Nesterov: look one momentum step ahead)

Two special cases name the neighbours of DiLoCo:

* lr = 1, mu = 0: theta - delta = (1/p) sum_i theta_i, the average of the workers'
  parameters: **local SGD** (federated averaging).
* additionally H = 1 and an inner *SGD* step of rate eta: theta_i = theta - eta g_i, so
  theta - delta = theta - eta (1/p) sum_i g_i: **synchronous data parallel** with SGD. (With
  AdamW inner steps this is not DDP: averaging p AdamW updates is not one AdamW update of the
  averaged gradient, since each worker normalises its own gradient by its own second moment.)

Cost: 2 reads and 2 writes of the parameter vector per round on each worker; memory: one
copy of the global parameters and one momentum buffer (2 x the model, fp32).
"""

from __future__ import annotations

import torch

__all__ = ["nesterov_outer_step_"]


def nesterov_outer_step_(
    global_params: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor, lr: float, mu: float
) -> None:
    """In place: ``momentum <- mu momentum + delta``, then ``global_params -= lr (delta + mu momentum)``.

    All three are flat tensors of the same size (a fragment's slice works too). With ``mu = 0``
    the momentum buffer stays ``delta`` and the step is plain SGD.
    """
    if not (global_params.shape == momentum.shape == delta.shape):
        raise ValueError(
            f"global_params {tuple(global_params.shape)}, momentum {tuple(momentum.shape)} and delta "
            f"{tuple(delta.shape)} must have one shape: pass the same fragment's slice of each"
        )
    momentum.mul_(mu).add_(delta)
    global_params.sub_(delta.add(momentum, alpha=mu), alpha=lr)

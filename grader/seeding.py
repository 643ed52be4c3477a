"""Models whose initial weights depend on a seed only -- not on torch's global random state.

The trusted side builds the same models as the workers to compute references, and it checks
several submissions at once, on threads (``--jobs``). ``torch.manual_seed(s); nn.Linear(...)``
is not safe there: the global generator is shared by every thread, so another thread's
construction between the seeding and the draw changes the weights, and a correct submission
fails a check it passes alone (seen under load in CI). ``seeded_`` refills every parameter from
a generator of its own instead: the same weights on both sides, whatever runs beside them.
"""

from __future__ import annotations

import torch
from torch import nn


def seeded_(model: nn.Module, seed: int) -> nn.Module:
    """Refill ``model``'s parameters in place, in ``parameters()`` order, from ``seed`` alone;
    returns ``model``. Each tensor gets uniform(-b, b) with b = 1 / sqrt(its last dimension)
    (a vector: its length), the scale of ``nn.Linear``'s own initialisation."""
    g = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for parameter in model.parameters():
            fan_in = parameter.shape[-1] if parameter.dim() > 0 else 1
            bound = 1.0 / max(1, fan_in) ** 0.5
            draw = torch.rand(parameter.shape, generator=g, dtype=torch.float64) * (2 * bound) - bound
            parameter.copy_(draw)
    return model

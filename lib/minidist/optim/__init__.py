"""Optimisers and precision for large-batch training: LR scaling and warm-up, LARS, LAMB, loss scaling.

    from minidist.optim import LAMB, LARS, param_groups, scaled_lr, warmup_decay_schedule
    opt = LAMB(param_groups(model, weight_decay=0.01), lr=scaled_lr(1e-3, 4096, 256, "sqrt"))

``minidist.optim.large_batch`` (the batch-size experiment) and ``minidist.optim.amp`` (bf16
autocast, fp16 with master weights) are imported on demand.
"""

from minidist.optim.groups import is_excluded, param_groups
from minidist.optim.lamb import LAMB
from minidist.optim.lars import LARS
from minidist.optim.loss_scaling import DynamicLossScaler
from minidist.optim.schedules import (
    linear_scaled_lr,
    scaled_lr,
    sqrt_scaled_lr,
    warmup_decay_factor,
    warmup_decay_schedule,
    warmup_lr,
)

__all__ = [
    "LAMB",
    "LARS",
    "DynamicLossScaler",
    "is_excluded",
    "linear_scaled_lr",
    "param_groups",
    "scaled_lr",
    "sqrt_scaled_lr",
    "warmup_decay_factor",
    "warmup_decay_schedule",
    "warmup_lr",
]

"""Parameter groups for layer-wise adaptive optimisers: which tensors get weight decay and a trust ratio.

LARS and LAMB rescale each layer's update by a *trust ratio* ||w|| / ||update||, and both add
weight decay. Neither makes sense for a bias or a LayerNorm gain/shift: these vectors start at
0 or 1, their norm says nothing about the layer's scale, and decaying a LayerNorm gain towards
0 fights the normalisation. LAMB's authors (and BERT's) therefore exclude them:

    group 0  matrices (Linear / Embedding weights)      weight_decay = wd   trust_ratio = True
    group 1  vectors  (biases, LayerNorm weight & bias) weight_decay = 0    trust_ratio = False

A tensor with fewer than two dimensions is a vector; so is any parameter of an ``nn.LayerNorm``
(or any module whose class name contains "Norm"), whatever its shape. Each group also carries
``names`` (the parameter names, for reading), which the optimisers ignore.
"""

from __future__ import annotations

from torch import nn

__all__ = ["is_excluded", "param_groups"]


def is_excluded(module: nn.Module, name: str, param: nn.Parameter) -> bool:
    """True for biases and normalisation parameters: no weight decay, no trust ratio."""
    return param.dim() < 2 or "norm" in type(module).__name__.lower() or name == "bias"


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two parameter groups of ``model`` (trainable parameters only, each once even if tied).

    Returns ``[{"params", "names", "weight_decay": weight_decay, "trust_ratio": True},
    {"params", "names", "weight_decay": 0.0, "trust_ratio": False}]``; an empty group is left
    out. Pass the list to ``LARS``, ``LAMB`` or any ``torch.optim`` optimiser (which ignores
    ``trust_ratio``).
    """
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    adapted: dict = {"params": [], "names": [], "weight_decay": weight_decay, "trust_ratio": True}
    excluded: dict = {"params": [], "names": [], "weight_decay": 0.0, "trust_ratio": False}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            group = excluded if is_excluded(module, name, param) else adapted
            group["params"].append(param)
            group["names"].append(f"{module_name}.{name}" if module_name else name)
    return [g for g in (adapted, excluded) if g["params"]]

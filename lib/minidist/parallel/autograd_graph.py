"""What a forward reached: the tensors in its output, and the parameters their autograd graph reaches.

``DistributedDataParallel(find_unused_parameters=True)`` needs to know, right after forward,
which parameters will get no gradient in this backward (their buckets must not wait for
them). Like torch's DDP it walks the autograd graph backwards from the outputs::

    loss.grad_fn -> ... -> AccumulateGrad(embed.weight)     reached: will get a gradient
                        -> AccumulateGrad(head.weight)
    (no path to AccumulateGrad(unused.weight))               not reached: mark it ready now

An ``AccumulateGrad`` node holds its leaf tensor as ``node.variable``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


def tensors_in(output) -> list[torch.Tensor]:
    """Every tensor in a (nested) forward output: tensors, lists, tuples, dicts, dataclasses."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in tensors_in(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in tensors_in(item)]
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return [t for f in dataclasses.fields(output) for t in tensors_in(getattr(output, f.name))]
    return []


def reachable_params(roots) -> set[nn.Parameter]:
    """Parameters whose AccumulateGrad node is reachable from ``roots`` (autograd nodes)."""
    found, seen, stack = set(), set(), list(roots)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if isinstance(variable, nn.Parameter):
            found.add(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


__all__ = ["reachable_params", "tensors_in"]

"""The router of a mixture of experts: which experts each token goes to, with what weight, and who is dropped.

    x (T, d) ─► logits = x W_r        (T, E)      a linear layer, no bias
             ─► probs = softmax(logits)           each token's distribution over the E experts
             ─► top-k of probs: experts (T, k), gates (T, k)
             ─► capacity C per expert; the assignments past C are dropped

Gates. With k = 1 the gate is the chosen expert's probability itself (Switch Transformer,
Fedus et al. 2022, section 2.1: the output is p_i(x) E_i(x), which is how the router gets a
gradient). With k > 1 the k probabilities are renormalised to sum to 1 (Mixtral, Jiang et al.
2024, eq. 1: softmax over the top-k logits, which is the same thing). ``renormalize`` overrides.

Capacity (Switch, section 2.2; GShard, Lepikhin et al. 2021): an expert takes at most

    C = ceil(capacity_factor * T * k / E)          assignments from these T tokens

(T * k / E is its share under perfect balance). ``capacity_factor=None`` means no limit.

Priority (who is kept when an expert is over capacity) -- deterministic, by position: the
earlier token in the flattened batch (B, T) -> (B·T) comes first, and a token's choices in order:

    priority order:  (token 0, slot 0), (token 0, slot 1), (token 1, slot 0), ...

Why by position and not GShard's "every first choice before any second choice": in a decoder a
later token must not change an earlier one's output. By position, whether token t is kept
depends on tokens 0..t only, so the layer stays causal whatever the capacity (GShard's order
would let a later token's first choice push out an earlier token's second).

So expert e keeps min(load_e, C) assignments and drops  max(0, load_e - C)  of them, where
load_e is how many (token, slot) pairs chose e. A dropped assignment contributes nothing to
its token's output (its gate is not renormalised away); a token whose every choice is dropped
gets 0 from the layer, and the residual connection around the layer carries it unchanged.

Load-balancing loss (Switch, eq. 4):  aux = E * sum_i f_i * P_i, with f_i the fraction of the
T*k assignments that chose expert i (before capacity) and P_i the mean router probability of
expert i over the T tokens. Perfect balance gives 1 for any k; all tokens on one expert, E.
f_i has no gradient (it counts); P_i carries the router's. The model multiplies it by a
coefficient (Switch: alpha = 0.01).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["Routing", "MoEStats", "capacity", "route"]


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float | None) -> int:
    """C = ceil(capacity_factor * tokens * top_k / num_experts); ``tokens`` when the factor is None."""
    if capacity_factor is None:
        return tokens  # an expert can take every token once: nothing is ever dropped
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 (or None for no limit), got {capacity_factor}")
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


@dataclass(frozen=True)
class MoEStats:
    """What one forward did, as plain ints: ``load[e]`` assignments chose expert e, ``kept[e]``
    went through it, ``dropped[e] = load[e] - kept[e] = max(0, load[e] - capacity)``."""

    tokens: int
    top_k: int
    capacity: int
    load: list[int]
    kept: list[int]
    dropped: list[int]

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped)


@dataclass
class Routing:
    """The router's decisions for T tokens (tensors of the forward pass; gates and probs carry gradients)."""

    experts: torch.Tensor  # (T, k) int64: the chosen experts, best first
    gates: torch.Tensor  # (T, k): combine weights
    kept: torch.Tensor  # (T, k) bool: False where the expert was over capacity
    probs: torch.Tensor  # (T, E): the softmax
    aux_loss: torch.Tensor  # scalar: E * sum_i f_i P_i
    stats: MoEStats

    def assignments(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kept (token, slot) pairs sorted by (expert, priority): token, slot, expert -- each (n,).

        Sorted by expert first, so the rows for one expert (and for one rank, which holds a
        contiguous range of experts) are one contiguous block; within an expert, in priority order.
        """
        t, k = self.experts.shape
        index = torch.nonzero(self.kept.reshape(-1)).squeeze(1)  # priority order: token, then slot
        token, slot = index // k, index % k
        expert = self.experts[token, slot]
        order = torch.sort(expert, stable=True).indices
        return token[order], slot[order], expert[order]


def route(
    logits: torch.Tensor, top_k: int, capacity_factor: float | None, renormalize: bool | None = None
) -> Routing:
    """Top-k routing with capacity, from the router's logits (T, E); see the module docstring."""
    tokens, num_experts = logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..num_experts={num_experts}, got {top_k}")
    probs = torch.softmax(logits, dim=-1)
    top_probs, experts = probs.topk(top_k, dim=-1)
    if top_k > 1 if renormalize is None else renormalize:
        gates = top_probs / top_probs.sum(dim=-1, keepdim=True)
    else:
        gates = top_probs
    cap = capacity(tokens, top_k, num_experts, capacity_factor)
    # position of each assignment in its expert's queue, in priority order (token, then slot)
    one_hot = F.one_hot(experts.reshape(-1), num_experts)  # (T*k, E)
    queue = (one_hot.cumsum(0) * one_hot).sum(1) - 1  # 0, 1, 2, ... per expert
    kept = (queue < cap).view(tokens, top_k)
    load = one_hot.sum(0)
    kept_per_expert = torch.clamp(load, max=cap)
    if tokens:
        fraction = load.to(probs.dtype) / (tokens * top_k)
        aux = num_experts * (fraction * probs.mean(0)).sum()
    else:  # an empty batch: nothing to balance (and no NaN from a mean over nothing)
        aux = logits.sum() * 0.0
    stats = MoEStats(
        tokens=tokens,
        top_k=top_k,
        capacity=cap,
        load=load.tolist(),
        kept=kept_per_expert.tolist(),
        dropped=(load - kept_per_expert).tolist(),
    )
    return Routing(experts, gates, kept, probs, aux, stats)

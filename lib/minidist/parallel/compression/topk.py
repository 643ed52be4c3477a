"""Top-k by a sampled threshold: which entries of a bucket DGC sends, without sorting n of them.

An exact top-k of millions of entries is slow (on a GPU), so estimate the k-th
largest |v| from a random sample of ``sample_ratio`` of the entries, then take
every entry at least that large. The estimate is noisy: if more than k are taken, keep the k largest of
those (a top-k over the few chosen, cheap); if fewer, the free slots are padded::

    magnitude:  |v| of n entries            sample s of them, s = max(min_sample, ratio * n)
    threshold:  the ceil(s k / n)-th largest sample   (about k of the n entries are above it)
    chosen:     every entry >= threshold     more than k? keep the k largest of those

DGC (``dgc.py``) calls ``select_indices`` on its accumulated vector every step.
"""

from __future__ import annotations

import math

import torch


def sampled_threshold(
    magnitude: torch.Tensor,
    k: int,
    sample_ratio: float,
    generator: torch.Generator | None,
    min_sample: int = 256,
) -> torch.Tensor:
    """An estimate of the k-th largest entry of ``magnitude`` (>= 0) from a random sample.

    Sample s = max(min_sample, sample_ratio * n) entries (with replacement; all of them,
    in order, if s >= n) and return the ceil(s * k / n)-th largest sample: about k of
    the n entries lie at or above it (its share above is Beta-distributed with mean
    about k / n and relative spread about 1 / sqrt(s * k / n)).
    """
    n = magnitude.numel()
    size = min(n, max(min_sample, math.ceil(sample_ratio * n)))
    if size >= n:
        sample = magnitude
    else:
        sample = magnitude[torch.randint(n, (size,), generator=generator, device=magnitude.device)]
    k_sample = max(1, math.ceil(sample.numel() * k / n))
    return torch.topk(sample, k_sample, sorted=False).values.min()


def select_indices(
    values: torch.Tensor,
    k: int,
    sample_ratio: float,
    generator: torch.Generator | None,
    min_sample: int = 256,
) -> torch.Tensor:
    """Indices (sorted, int64, at most k) of the entries of ``values`` with the largest |value|.

    1. sample s = max(min_sample, sample_ratio * n) of the |values| (all of them if s >= n);
    2. threshold = the ceil(s * k / n)-th largest sample: about k entries of n lie above it;
    3. take every entry with |value| >= threshold;
    4. more than k taken: keep the k largest of them (a top-k of the taken ones only).

    With the whole vector as sample this is exactly top-k (ties broken by torch.topk).
    Cost: O(n) for the comparison, O(s) for the sample's top-k, no sort of n.
    """
    n = values.numel()
    if k >= n:
        return torch.arange(n, device=values.device)
    magnitude = values.abs()
    threshold = sampled_threshold(magnitude, k, sample_ratio, generator, min_sample)
    chosen = (magnitude >= threshold).nonzero().flatten()
    if chosen.numel() > k:  # the estimate was low: re-threshold among the chosen
        chosen = chosen[torch.topk(magnitude[chosen], k, sorted=False).indices]
    return chosen.sort().values


__all__ = ["sampled_threshold", "select_indices"]

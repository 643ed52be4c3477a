"""What overlapping the allreduce with backward can buy at most (DDP's ``overlap=True``).

With forward F, backward B, allreduce C and optimizer O, allreduce after backward costs
``F + B + C + O`` and perfect hiding ``F + max(B, C) + O``. Of the backward-and-allreduce
part alone the ratio is ``(B + C) / max(B, C)``, at most 2, reached when C = B: the GPU
regime, where backward is fast and the network is the bottleneck::

    after backward   | F |    B     |   C    | O |
    overlapped       | F |    B     | O |            (C hidden under B)
                           |   C    |

But the buckets that can launch only when backward ends never hide: for BERT the one with
the input word embedding (its gradient is final only when backward reaches the input; tied
with the MLM head) and every bucket after it (buckets launch in order), 40% of mini's
gradient bytes. With s their share, the best step is ``F + max(B + s*C, C) + O``.
``overlap_bound`` is the after-backward step over that best step; ``python -m minidist.bench
ddp`` measures B and C on its ``after backward`` row (where they do not overlap) and prints
the bound beside each ``overlap`` row.
"""

from __future__ import annotations


def overlap_bound(after: dict, tail_share: float) -> tuple[float, float]:
    """The most perfect overlap could gain over an ``after backward`` row (whose B and C
    do not overlap): (its step time / the best overlapped step, (B + C) / max(B, C)).

    The best overlapped step is ``step - B - C + max(B + s*C, C)``: the buckets
    that can launch only when backward ends, a share s of the bytes (for BERT the
    one with the input word embedding, tied with the MLM head, and those after it:
    40% of mini's gradients), can never hide. C is taken from the one-flat-buffer row; more
    buckets cost a little more each, so the true bound is a little lower still.
    """
    b, c = after["backward_ms"], after["comm_ms_per_step"]
    step_ms = after["step_s"] * 1e3
    best_ms = step_ms - b - c + max(b + tail_share * c, c)
    return step_ms / best_ms, (b + c) / max(b, c)


__all__ = ["overlap_bound"]

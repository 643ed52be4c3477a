"""Streaming DiLoCo's schedule: which fragment synchronises after which inner step.

DiLoCo exchanges the whole model once every H steps: a burst of 2(p-1)/p x model bytes, and
every worker idle while it crosses the slow link. Streaming DiLoCo (Douillard et al. 2025,
"Streaming DiLoCo with overlapping communication") cuts the parameters into F *fragments*
and synchronises each on its own H-step schedule, the F schedules staggered by H/F steps, so
the peak traffic is 1/F of the burst; and it lets a fragment's exchange run in the background
for tau inner steps before its result is used (the overlap).

Our rule (inner steps are counted from 1; step t is the t-th call of ``DiLoCo.step``)::

    offset_f = (f + 1) H // F                  f = 0 .. F-1
    fragment f is launched after step t  iff   t >= offset_f and (t - offset_f) % H == 0
    and applied (outer step + merge)   after step t + tau

With F = 1 this is DiLoCo: the one fragment every H steps. Picture, H = 4, F = 2, tau = 1
(L: the fragment's pseudo-gradient computed and its allreduce started, async; A: waited for,
outer step taken, merged into the local parameters; ---: in flight during inner steps)::

    inner step t    1   2   3   4   5   6   7   8   9
    fragment 0          L---A           L---A
    fragment 1                  L---A           L---A

Each fragment still travels once per H steps (bytes per token as DiLoCo), but at most
ceil(F tau / H) fragments are in flight at once. tau must be < H: a fragment's result is
applied before it is launched again.

Fragments here are **contiguous equal slices of the flattened parameter vector** (sizes differ
by at most one element), so every fragment costs the same bytes; the paper instead groups whole
transformer blocks, strided (fragment f = blocks f, f + F, ...), which keeps each layer's
tensors together. Both are a partition of the parameters; only the bytes per sync differ.
"""

from __future__ import annotations

__all__ = ["fragment_bounds", "fragment_offsets", "fragments_due", "timeline"]


def fragment_offsets(inner_steps: int, fragments: int) -> list[int]:
    """``offset_f = (f + 1) H // F``: the first inner step after which fragment f is launched."""
    if fragments < 1 or fragments > inner_steps:
        raise ValueError(
            f"fragments must lie in 1..inner_steps={inner_steps} (at most one a step), got {fragments}"
        )
    return [(f + 1) * inner_steps // fragments for f in range(fragments)]


def fragments_due(step: int, inner_steps: int, fragments: int) -> list[int]:
    """The fragments launched after inner step ``step`` (counted from 1)."""
    return [
        f
        for f, offset in enumerate(fragment_offsets(inner_steps, fragments))
        if step >= offset and (step - offset) % inner_steps == 0
    ]


def fragment_bounds(numel: int, fragments: int) -> list[tuple[int, int]]:
    """F contiguous ``(lo, hi)`` slices of ``range(numel)``, sizes differing by at most one."""
    return [(f * numel // fragments, (f + 1) * numel // fragments) for f in range(fragments)]


def timeline(inner_steps: int, fragments: int, delay: int, steps: int) -> str:
    """The schedule as the ASCII picture of this module's docstring (for notebooks and tests)."""
    width = 4
    lines = ["inner step t".ljust(16) + "".join(str(t).ljust(width) for t in range(1, steps + 1)).rstrip()]
    for f in range(fragments):
        row = [" " * width] * steps
        for t in range(1, steps + 1):
            if f in fragments_due(t, inner_steps, fragments):
                row[t - 1] = ("L" + "-" * (width - 1)) if delay else "LA".ljust(width)
                for s in range(t + 1, min(t + delay, steps + 1)):
                    row[s - 1] = "-" * width
                if delay and t + delay <= steps:
                    row[t + delay - 1] = "A".ljust(width)
        lines.append(f"fragment {f}".ljust(16) + "".join(row).rstrip())
    return "\n".join(lines)

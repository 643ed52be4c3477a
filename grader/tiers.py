"""A hidden test graded in tiers on a measured outcome: how fast, how small, how few bytes.

Most hidden tests pass or fail. A *measured* test (a ``Case`` with ``tiers``) first checks that
the result is right -- its check raises, as every check does, when it is not -- and then returns
one number measured on the trusted side: an emulated step time, bytes the transport carried, a
peak of counted memory, a perplexity. Never a number the student's code reports about itself, and
never a wall-clock time: the grading machine's load must not move a student between tiers.

The number earns a fraction of the case's points, by the first level it meets:

    Tiers(quantity="emulated step time / max(compute, communication)", unit="x",
          levels=((1.10, 1.0), (1.30, 0.5), (2.0, 0.25)), lower_is_better=True,
          baseline="the library's DDP: 1.31x")

gives full points at 1.10x or less, half at 1.30x or less, a quarter at 2x or less, and nothing
beyond. The library's own version of the task is the ``baseline``: it is measured by the course's
tests, and it must not reach the top tier (copying it is not the way to full marks). The grader
writes every measured value into a leaderboard per measured test (``leaderboard_rows``) and into
Gradescope's ``leaderboard`` field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Tiers", "Outcome"]


@dataclass(frozen=True)
class Outcome:
    """What a measured value earned: ``fraction`` of the points, at ``tier`` (1 = top, 0 = none)."""

    value: float
    fraction: float
    tier: int
    message: str


@dataclass(frozen=True)
class Tiers:
    quantity: str  # what is measured, as the leaderboard's column names it
    unit: str  # printed after the value: "x", " bytes", " MiB", "% perplexity"
    levels: tuple[tuple[float, float], ...]  # (bound, fraction of the points), best first
    lower_is_better: bool = True
    baseline: str = ""  # what the library's version measures (said in the feedback)

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError(f"{self.quantity}: a measured test needs at least one level")
        bounds = [bound for bound, _ in self.levels]
        fractions = [fraction for _, fraction in self.levels]
        ordered = sorted(bounds, reverse=not self.lower_is_better)
        if bounds != ordered or len(set(bounds)) != len(bounds):
            better = "increasing" if self.lower_is_better else "decreasing"
            raise ValueError(f"{self.quantity}: levels go best first, bounds strictly {better}: {bounds}")
        if (
            fractions[0] != 1.0
            or any(not 0 < f <= 1 for f in fractions)
            or fractions != sorted(fractions)[::-1]
        ):
            raise ValueError(
                f"{self.quantity}: fractions start at 1 and decrease, each in (0, 1]: {fractions}"
            )

    @property
    def order(self) -> str:
        """Gradescope's leaderboard order: ``asc`` when lower is better."""
        return "asc" if self.lower_is_better else "desc"

    def meets(self, value: float, bound: float) -> bool:
        return value <= bound if self.lower_is_better else value >= bound

    def fmt(self, value: float) -> str:
        return f"{value:.4g}{self.unit}"

    def outcome(self, value: object, points: float) -> Outcome:
        """What ``value`` earns of ``points``, with the sentence the student reads."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return Outcome(math.nan, 0.0, 0, f"{self.quantity}: no finite measurement ({value!r})")
        value = float(value)
        best = self.levels[0][0]
        word = "at most" if self.lower_is_better else "at least"
        full = f"full points need {word} {self.fmt(best)}"
        baseline = f"; for comparison, {self.baseline}" if self.baseline else ""
        for tier, (bound, fraction) in enumerate(self.levels, start=1):
            if self.meets(value, bound):
                earned = f"{fraction * points:g} of {points:g} points"
                if tier == 1:
                    return Outcome(
                        value, 1.0, 1, f"{self.quantity}: {self.fmt(value)}, the top tier ({earned})"
                    )
                message = (
                    f"{self.quantity}: {self.fmt(value)}, tier {tier} of {len(self.levels)} "
                    f"({earned}; {word} {self.fmt(bound)}); {full}{baseline}"
                )
                return Outcome(value, fraction, tier, message)
        last = self.levels[-1][0]
        message = (
            f"{self.quantity}: {self.fmt(value)}, short of every tier (0 of {points:g} points; the lowest "
            f"needs {word} {self.fmt(last)}); {full}{baseline}"
        )
        return Outcome(value, 0.0, 0, message)


def leaderboard_rows(entries: list[tuple[str, float, float]], tiers: Tiers) -> list[dict]:
    """``(student, value, points)`` entries ranked best first (ties share a rank, then by id)."""
    ordered = sorted(entries, key=lambda e: (e[1] if tiers.lower_is_better else -e[1], e[0]))
    rows, rank, previous = [], 0, None
    for position, (student, value, points) in enumerate(ordered, start=1):
        if value != previous:
            rank, previous = position, value
        rows.append({"rank": rank, "id": student, "value": f"{value:.6g}", "points": f"{points:g}"})
    return rows

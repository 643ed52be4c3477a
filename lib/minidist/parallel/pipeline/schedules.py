"""Pipeline schedules as data: which forward and backward each stage runs, in which order.

A model cut into p consecutive *stages* runs one stage per rank. A batch is cut into m
*microbatches*; stage r computes the forward of microbatch i (``("F", i)``), sends the
activations to stage r + 1, and later, when the gradient comes back from stage r + 1, computes
the backward (``("B", i)``) and sends the input gradient to stage r - 1.

A *schedule* is plain data: one list per stage of the actions that stage runs, in order.
This module is pure (no processes, no tensors): read it first. Its siblings take a schedule
and check and simulate it (``simulator``), draw it (``drawing``), run it over send/recv
(``executor``) and measure it on real processes (``measure``).

GPipe (Huang et al. 2019): all forwards, then all backwards. Every stage holds the activations
of all m microbatches at the peak. With t_F = 1, t_B = 2, p = 4, m = 4 (``draw_ascii``)::

    stage 0 |F0 F1 F2 F3 .  .  .  .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3
    stage 1 |.  F0 F1 F2 F3 .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3 .  .
    stage 2 |.  .  F0 F1 F2 F3 .  .  .  B0 B0 B1 B1 B2 B2 B3 B3 .  .  .  .
    stage 3 |.  .  .  F0 F1 F2 F3 B0 B0 B1 B1 B2 B2 B3 B3 .  .  .  .  .  .

1F1B (PipeDream-flush, Narayanan et al. 2021): stage r first runs p - 1 - r forwards
(warm-up), then alternates one forward and one backward (steady state), then drains the
remaining backwards (cool-down). Same length, so the same bubble as GPipe, but stage r never
holds more than p - r microbatches: activation memory no longer grows with m::

    stage 0 |F0 F1 F2 F3 .  .  .  .  .  .  B0 B0 .  B1 B1 .  B2 B2 .  B3 B3
    stage 1 |.  F0 F1 F2 .  .  .  .  B0 B0 F3 B1 B1 .  B2 B2 .  B3 B3 .  .
    stage 2 |.  .  F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3 .  .  .  .
    stage 3 |.  .  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .  .  .  .  .  .

The *bubble* is the idle share of p stages x makespan. With balanced stages both schedules
give ``(p - 1) / (m + p - 1)`` (``bubble_formula``): p - 1 forward and p - 1 backward slots of
fill and drain against m forward+backward slots of work. Interleaved 1F1B gives each rank v
model *chunks* (rank r holds virtual stages r, r + p, r + 2p, ...); each chunk costs 1/v of a
stage, so the fill and drain shrink v times: ``(p - 1) / (v m + p - 1)`` (the paper writes the
bubble-to-work ratio, (p - 1) / (v m)).
"""

from __future__ import annotations

__all__ = ["bubble_formula", "gpipe", "interleaved_one_f_one_b", "one_f_one_b", "peak_in_flight"]

Action = tuple  # ("F", mb) or ("B", mb); interleaved: ("F", mb, chunk)


def _check_sizes(stages: int, microbatches: int, chunks: int = 1) -> None:
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise ValueError(
            f"stages ({stages}), microbatches ({microbatches}) and chunks ({chunks}) must be >= 1"
        )


def gpipe(stages: int, microbatches: int) -> list[list[Action]]:
    """GPipe: every stage runs F0 .. F(m-1), then B0 .. B(m-1)."""
    _check_sizes(stages, microbatches)
    order = [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
    return [list(order) for _ in range(stages)]


def one_f_one_b(stages: int, microbatches: int) -> list[list[Action]]:
    """1F1B: on stage r, min(p - 1 - r, m) warm-up forwards, then F/B pairs, then the last backwards.

    Stage r, p = 4, m = 6:   r=0: F0 F1 F2 | F3 B0 F4 B1 F5 B2 | B3 B4 B5
                             r=3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5
    """
    _check_sizes(stages, microbatches)
    schedule = []
    for r in range(stages):
        warmup = min(stages - 1 - r, microbatches)
        actions: list[Action] = [("F", i) for i in range(warmup)]
        for i in range(microbatches - warmup):  # steady state: one forward, one backward
            actions += [("F", warmup + i), ("B", i)]
        actions += [("B", i) for i in range(microbatches - warmup, microbatches)]  # cool-down
        schedule.append(actions)
    return schedule


def interleaved_one_f_one_b(stages: int, microbatches: int, chunks: int) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2): rank r holds chunks c = 0..v-1.

    Chunk c of rank r is virtual stage c * p + r. Forwards go through microbatches in groups of
    p: the k-th forward of a rank is on chunk (k // p) % v, microbatch (k // (p v)) * p + k % p;
    the k-th backward walks the chunks in reverse. Rank r first runs (p - 1 - r) * 2 + (v - 1) * p
    forwards (capped at m v), then alternates, then drains. Needs m to be a multiple of p.
    """
    _check_sizes(stages, microbatches, chunks)
    p, m, v = stages, microbatches, chunks
    if v == 1:
        return [[(kind, mb, 0) for kind, mb in actions] for actions in one_f_one_b(p, m)]
    if m % p:
        raise ValueError(
            f"interleaved 1F1B takes microbatches in groups of the {p} stages: {m} microbatches is "
            f"not a multiple of {p}; use {m - m % p or p} or {m - m % p + p}"
        )
    total = m * v

    def forward(k: int) -> Action:
        return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def backward(k: int) -> Action:
        return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    schedule = []
    for r in range(p):
        warmup = min((p - 1 - r) * 2 + (v - 1) * p, total)
        actions = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [forward(warmup + k), backward(k)]
        actions += [backward(k) for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule


def bubble_formula(stages: int, microbatches: int, chunks: int = 1) -> float:
    """(p - 1) / (v m + p - 1): GPipe and 1F1B with v = 1; interleaved 1F1B with v chunks per rank."""
    _check_sizes(stages, microbatches, chunks)
    return (stages - 1) / (chunks * microbatches + stages - 1)


def peak_in_flight(schedule) -> list[int]:
    """Per stage, the most (microbatch, chunk) activations held at once: +1 at F, -1 at B.

    GPipe: m on every stage. 1F1B: p - r on stage r (at most p), when m >= p.
    """
    peaks = []
    for actions in schedule:
        held = peak = 0
        for a in actions:
            held += 1 if a[0] == "F" else -1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks

"""Draw a pipeline timeline: as text (``draw_ascii``) or as bars (``plot_timeline``).

Both take a ``simulator.Timeline``: simulated from a schedule (``simulator.simulate``) or measured
on real processes (``executor.timeline_of``). The pictures in the ``schedules`` docstring are
``draw_ascii(gpipe(4, 4))`` and ``draw_ascii(one_f_one_b(4, 4))``.
"""

from __future__ import annotations

from .simulator import Timeline, _name, simulate

__all__ = ["draw_ascii", "plot_timeline"]


def draw_ascii(schedule_or_timeline, t_forward: float = 1.0, t_backward: float = 2.0) -> str:
    """A text timeline, one row per stage, one column per time unit; '.' is idle.

    A schedule is first simulated with ``t_forward`` / ``t_backward``. A backward of 2 units
    prints its label twice.
    """
    tl = (
        schedule_or_timeline
        if isinstance(schedule_or_timeline, Timeline)
        else simulate(schedule_or_timeline, t_forward, t_backward)
    )
    rows = [row for row in tl.stages]
    t0 = min(s for row in rows for _, s, _ in row)
    unit = min(e - s for row in rows for _, s, e in row)
    width = max(len(_name(a, tl.chunks)) for row in rows for a, _, _ in row)
    n_cols = round(tl.makespan / unit)
    lines = []
    for r, row in enumerate(rows):
        cells = ["." * 1] * n_cols
        for a, s, e in row:
            first, last = round((s - t0) / unit), round((e - t0) / unit)
            for c in range(first, max(last, first + 1)):
                if c < n_cols:
                    cells[c] = _name(a, tl.chunks)
        lines.append(f"stage {r} |" + " ".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(lines)


def plot_timeline(tl: Timeline, ax=None, title: str | None = None):
    """Draw a Timeline as bars (forwards light, backwards dark), one row per stage; returns ax."""
    import matplotlib.pyplot as plt  # lazily: the library works without matplotlib

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 + 0.5 * len(tl.stages)))
    t0 = min(s for row in tl.stages for _, s, _ in row)
    for r, row in enumerate(tl.stages):
        for a, s, e in row:
            color = "#9ecae1" if a[0] == "F" else "#3182bd"
            ax.broken_barh(
                [(s - t0, e - s)], (r - 0.4, 0.8), facecolors=color, edgecolors="black", linewidth=0.5
            )
            ax.text(s - t0 + (e - s) / 2, r, _name(a, tl.chunks), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(tl.stages)), [f"stage {r}" for r in range(len(tl.stages))])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    bubble = f"bubble {tl.bubble_fraction:.1%}"
    ax.set_title(f"{title}: {bubble}" if title else bubble)
    return ax

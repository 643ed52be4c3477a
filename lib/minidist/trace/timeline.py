"""Reading a trace in the notebook: ``plot_timeline`` draws it, ``overlap`` measures it.

``plot_timeline`` draws a row per rank (compute over comm over messages, so overlap shows
as bars stacked over each other); ``overlap`` is the number behind that picture: the share
of communication time that lies inside backward.
"""

from __future__ import annotations

from .recorder import CATEGORIES

COLOURS = {"compute": "tab:blue", "comm": "tab:orange", "message": "tab:green", "optimizer": "tab:purple"}


def plot_timeline(events: list[dict], ax=None, title: str | None = None):
    """Draw a row per rank: compute (and optimizer) spans on top, comm spans under them and
    messages as a thin strip at the bottom, so overlap shows as bars stacked over each
    other. Times in ms from the earliest event. Returns the Axes."""
    import matplotlib.pyplot as plt  # lazily: the library must not need matplotlib

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1 + 0.8 * len({e["rank"] for e in events})))
    origin = min((e["ts_us"] for e in events), default=0.0)
    ranks = sorted({e["rank"] for e in events})
    # (y offset from the row's centre, bar height): compute above, comm below, messages a thin strip
    placement = {  # y axis inverted: the lowest offset is drawn on top
        "compute": (-0.42, 0.3),
        "optimizer": (-0.42, 0.3),
        "comm": (-0.08, 0.26),
        "message": (0.22, 0.18),
    }
    labelled = set()
    for row, rank in enumerate(ranks):
        for cat in CATEGORIES:
            bars = [
                ((e["ts_us"] - origin) / 1000, e["dur_us"] / 1000)
                for e in events
                if e["rank"] == rank and e["cat"] == cat
            ]
            if bars:
                offset, height = placement[cat]
                label = None if cat in labelled else cat
                labelled.add(cat)
                ax.broken_barh(bars, (row + offset, height), color=COLOURS[cat], alpha=0.8, label=label)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(-0.6, len(ranks) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    if title:
        ax.set_title(title)
    if labelled:
        ax.legend(loc="upper right", fontsize="small")
    return ax


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def overlap(events: list[dict], rank: int | None = None, inside: str = "backward") -> float:
    """The share of communication time that lies inside ``inside`` ("backward") spans.

    For every comm span (``cat == "comm"``) of a rank, the part of it that
    intersects that rank's spans named ``inside`` counts as hidden. The result is
    hidden time / comm time, summed over comm spans (two comm spans in flight at
    once both count) and over ranks (``rank=None``) or for one rank. 1.0: all
    communication ran while backward was computing; 0.0: none did.
    """
    ranks = sorted({e["rank"] for e in events}) if rank is None else [rank]
    hidden = total = 0.0
    for r in ranks:
        cover = _merged(
            [(e["ts_us"], e["ts_us"] + e["dur_us"]) for e in events if e["rank"] == r and e["name"] == inside]
        )
        for e in events:
            if e["rank"] != r or e["cat"] != "comm":
                continue
            start, end = e["ts_us"], e["ts_us"] + e["dur_us"]
            total += end - start
            hidden += sum(max(0.0, min(end, b) - max(start, a)) for a, b in cover)
    if total == 0:
        where = "any rank" if rank is None else f"rank {rank}"
        raise ValueError(f"no comm spans (cat='comm', non-zero length) for {where}: nothing to overlap")
    return hidden / total


__all__ = ["COLOURS", "overlap", "plot_timeline"]

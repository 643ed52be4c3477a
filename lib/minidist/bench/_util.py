"""Small helpers shared by the benchmarks: sizes, tables, where results go."""

from __future__ import annotations

import json
import os
from pathlib import Path

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            value = n / size
            return f"{value:g} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"


def size_range(lo: int, hi: int, factor: int = 4) -> list[int]:
    sizes, n = [], lo
    while n <= hi:
        sizes.append(n)
        n *= factor
    return sizes


def print_table(headers: list[str], rows: list[list], title: str = "") -> str:
    """A plain fixed-width table (also returned as text)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(h.rjust(w) for h, w in zip(cells[0], widths)))
    lines.append("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _fmt(value) -> str:
    if isinstance(value, float):
        if value != value:  # nan
            return "-"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    return str(value)


def out_dir(path: str | None) -> Path:
    directory = Path(path or os.environ.get("MINIDIST_BENCH_OUT", "bench-results"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def save_json(directory: Path, name: str, data) -> Path:
    path = directory / f"{name}.json"
    path.write_text(json.dumps(data, indent=1))
    return path


def new_figure(ncols: int = 1, figsize=(6, 4)):
    """A figure that never touches pyplot's global state (safe to call from a notebook:
    the notebook's backend and its open figures are left alone)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols)
    return fig, axes

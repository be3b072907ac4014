"""Scatter plots drawn with matplotlib, an optional extra (`pip install carnator[plot]`).

Why optional: the plots help a person read a benchmark or a calibration, and nothing else depends on them, so a pack
that runs inside ComfyUI does not pull a plotting library in. Without it no plot is written and `plot_unavailable`
says so in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOT_EXTRA = "pip install 'carnator[plot]' (matplotlib)"


def pyplot() -> Any | None:
    """matplotlib's pyplot on a file-only backend, or None where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_unavailable(what: str) -> str:
    return f"no {what}: matplotlib is not installed; {PLOT_EXTRA}"


def scatter(points: list[tuple[str, float, float]], path: Path, title: str, x_label: str, y_label: str,
            x_lines: tuple[float, ...] = (1.0,)) -> Path | None:
    """Write a PNG with one labelled point per (label, x, y), non-finite points left out, and a dashed guide at each
    of `x_lines` (default: a speedup of 1, as fast as plain); None where matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return None
    points = [(label, x, y) for label, x, y in points if x == x and y == y and abs(x) != float("inf")]
    figure, axes = plt.subplots(figsize=(9, 6), dpi=100)
    for index, (label, x, y) in enumerate(points):
        axes.scatter([x], [y], s=40, color=f"C{index % 10}", label=label, zorder=3)
    for x in x_lines:
        axes.axvline(x, color="grey", linestyle="--", linewidth=1)
    axes.set(title=title, xlabel=x_label, ylabel=y_label)
    axes.grid(True, alpha=0.3)
    if points:  # labels in a legend beside the axes: they never cover points or one another
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path

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


MARKERS = "osD^vP*X<>hp8d"
# The yardstick's measures (`judging.yardstick`), as a point or a curve row names them, and their axes.
MEASURES = (("psnr", "PSNR to the plain clip (dB)"), ("detail", "detail kept (ratio to the full render)"),
            ("adherence", "adherence (demo oracle)"))


def yardstick_panels(curve: list[dict[str, Any]], points: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Write a PNG of the yardstick's three measures against model calls, one panel each (adherence where every
    curve row has it): `curve` (rows with `steps`, `model_calls` and the measures: plain at each step count) joined,
    each point named by its steps, and each of `points` (`label`, `model_calls`, the measures) in a colour and marker
    of its own. None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    measures = [m for m in MEASURES if m[0] != "adherence" or all(row.get("adherence") is not None for row in curve)]
    figure, panels = plt.subplots(1, len(measures), figsize=(6 * len(measures), 5.5), dpi=100, squeeze=False)
    colours = plt.get_cmap("tab10")
    for axes, (measure, label) in zip(panels[0], measures, strict=True):
        axes.plot([row["model_calls"] for row in curve], [row[measure] for row in curve], color="black", marker="D",
                  linewidth=1.5, zorder=2, label="plain at fewer steps (the curve)")
        for row in curve:
            axes.annotate(str(row["steps"]), (row["model_calls"], row[measure]), textcoords="offset points",
                          xytext=(5, -11), fontsize=8)
        for index, point in enumerate(points):
            if point.get(measure) is not None:
                axes.scatter([point["model_calls"]], [point[measure]], s=120, color=colours(index % 10),
                             marker=MARKERS[(index + 6) % len(MARKERS)], edgecolors="black", zorder=4,
                             label=point["label"])
        axes.set(xlabel="model calls per request (mean)", ylabel=label)
        axes.grid(True, alpha=0.3)
    figure.legend(*panels[0][0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=8, frameon=False)
    figure.suptitle(title)
    figure.tight_layout(rect=(0, 0.06 + 0.03 * (len(points) // 2), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path

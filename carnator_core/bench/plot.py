"""Scatter plots drawn with matplotlib, an optional extra (`pip install carnator[plot]`).

Why optional: the plots help a person read a benchmark or a calibration, and nothing else depends on them, so a pack
that runs inside ComfyUI does not pull a plotting library in. Without it no plot is written and `plot_unavailable`
says so in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from carnator_core.judging.fewer_steps import fewer_steps_count

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


def quality_against_calls(configs: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Write a PNG of each configuration's PSNR to plain against its model calls, one distinct colour and marker each
    (adherence in its legend label), the plain-<n> runs joined as the fewer-steps curve; None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    figure, axes = plt.subplots(figsize=(10, 6), dpi=100)
    colours = plt.get_cmap("tab20")
    for index, config in enumerate(configs):
        adherence = "" if config.get("adherence") is None else f", adherence {config['adherence']:.3f}"
        axes.scatter([config["model_calls"]], [config["psnr"]], s=60, color=colours(index % 20),
                     marker=MARKERS[index % len(MARKERS)], edgecolors="black", zorder=3,
                     label=f"{config['name']}{adherence}")
    curve = sorted((c for c in configs if c["name"] == "plain" or fewer_steps_count(c["name"]) is not None),
                   key=lambda c: c["model_calls"])
    axes.plot([c["model_calls"] for c in curve], [c["psnr"] for c in curve], color="grey", linewidth=1.2,
              zorder=2, label="plain at fewer steps (joined)")
    axes.set(title=title, xlabel="model calls per request (mean)", ylabel="PSNR to plain (dB)")
    axes.grid(True, alpha=0.3)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path

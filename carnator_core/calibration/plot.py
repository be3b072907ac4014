"""The calibration plot: each forced resume's probe signal against how close its clip stayed to plain.

One panel per signal (structure, and guidance where CFG is on). Resumes of the fitted pairs are filled circles and
held-back ones hollow squares, one colour per resume depth; the fitted rule's bar at each depth is a dashed line of
that depth's colour, the shipped rule's a dotted grey line, the target PSNR a solid horizontal line. Every line is
named in a legend beside the axes, so no label covers another in the crowded high-agreement corner.
"""

from __future__ import annotations

from pathlib import Path

from carnator_core.bench.plot import plot_unavailable, pyplot
from carnator_core.calibration.fit import held_back
from carnator_core.calibration.profile import Profile
from carnator_core.calibration.session import Measured
from carnator_core.reuse.probe import ProbeThresholds


def calibration_plots(measured: list[Measured], profile: Profile, out: Path) -> tuple[list[Path], str]:
    """The plots written to `out`, and a line saying why there are none where matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return [], plot_unavailable("calibration plot")
    shipped = ProbeThresholds()
    written = []
    for signal in ("structure", "guidance"):
        resumes = [m.resume for m in measured if getattr(m.resume, signal) is not None]
        if not resumes:
            continue
        figure, axes = plt.subplots(figsize=(10, 6), dpi=100)
        depths = sorted({r.depth for r in resumes})
        threshold, slope = profile.thresholds[signal], profile.thresholds[f"{signal}_slope"]
        for index, depth in enumerate(depths):
            colour = f"C{index % 10}"
            for kept_back, marker, face in ((False, "o", colour), (True, "s", "none")):
                at = [r for r in resumes if r.depth == depth and held_back(r.pair) == kept_back]
                if at:
                    axes.scatter([getattr(r, signal) for r in at], [r.psnr_db for r in at], marker=marker, s=36,
                                 facecolors=face, edgecolors=colour, zorder=3,
                                 label=f"{depth:.0%} {'held back' if kept_back else 'fitted'}")
            axes.axvline(min(1.0, threshold + slope * depth), color=colour, linestyle="--", linewidth=1.2,
                         label=f"fitted rule at {depth:.0%}: {min(1.0, threshold + slope * depth):.3f}")
        for value in sorted({round(getattr(shipped, signal) + getattr(shipped, f'{signal}_slope') * d, 4)
                             for d in depths}):
            axes.axvline(min(1.0, value), color="grey", linestyle=":", linewidth=1)
        axes.plot([], [], color="grey", linestyle=":", label="shipped rule (per depth)")
        axes.axhline(profile.target.psnr_db, color="black", linewidth=1.2,
                     label=f"target {profile.target.psnr_db:g} dB")
        state = "in force" if profile.in_force else "not in force"
        axes.set(title=f"{signal} agreement vs PSNR to plain: profile {profile.name!r} ({state})",
                 xlabel=f"{signal} agreement at the resume state", ylabel="PSNR to the plain clip (dB)")
        axes.grid(True, alpha=0.3)
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        figure.tight_layout()
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"plot-{signal}.png"
        figure.savefig(path)
        plt.close(figure)
        written.append(path)
    return written, ""

"""The calibration plots: each forced resume's probe signal against how close its clip stayed to plain, and what
reuse and lowering the steps each cost for how close they stay.

One panel per signal (structure, and guidance where CFG is on). Resumes of the fitted pairs are filled circles and
held-back ones hollow squares, one colour per resume depth; the fitted rule's bar at each depth is a dashed line of
that depth's colour, the shipped rule's a dotted grey line, the target PSNR a solid horizontal line. Every line is
named in a legend beside the axes, so no label covers another in the crowded high-agreement corner.

The pairs panels (`plot-pairs.png`, where plain also ran at fewer steps) and the stream panels (`plot-stream.png`, a
stream calibration) show the yardstick's three measures against model calls, one axis each, as `bench workload`'s plot
does: PSNR to plain, detail kept and adherence (where the demo oracle scores the prompts); the plain-steps curve
joined, each point named by its step count, each mode named with its verdict (and at the knee, where it ran there).
A mode above the curve on every panel beats lowering the steps.
"""

from __future__ import annotations

from pathlib import Path

from carnator_core.calibration.equal_quality import PairsWeighing
from carnator_core.calibration.fit import held_back
from carnator_core.calibration.session import Measured
from carnator_core.judging.calibration_profile import Profile
from carnator_core.judging.plot import plot_unavailable, pyplot, yardstick_panels
from carnator_core.judging.probe_thresholds import ProbeThresholds
from carnator_core.judging.yardstick import StreamQuality


def calibration_plots(measured: list[Measured], profile: Profile, out: Path,
                      weighing: PairsWeighing | None = None) -> tuple[list[Path], str]:
    """The plots written to `out` (the pairs panels where `weighing` weighed the profile's verdicts), and a line
    saying why there are none where matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return [], plot_unavailable("calibration plot")
    written = _signal_plots(plt, measured, profile, out)
    if weighing is not None and profile.fewer_steps and \
            all(v.weighed_on == "pairs" for v in profile.equal_quality.values()):
        written += [path for path in [_pairs_plot(profile, weighing, out)] if path is not None]
    return written, ""


def stream_plots(profile: Profile, curve: list[dict], modes: dict[str, StreamQuality], out: Path) -> Path | None:
    """The stream panels (`judging.plot.yardstick_panels`): `curve` (the plain runs weighed against,
    `StreamCalibration.curve`) and each weighed mode with its verdict; None without matplotlib."""
    points = [{"label": f"{mode}: {profile.equal_quality[mode].words()}", "model_calls": quality.model_calls,
               "psnr": quality.psnr_db, "detail": quality.detail, "adherence": quality.adherence}
              for mode, quality in modes.items() if mode in profile.equal_quality]
    return yardstick_panels(curve, points, out / "plot-stream.png",
                            f"reuse vs the plain-steps curve on the stream: profile {profile.name!r}")


def _pairs_plot(profile: Profile, weighing: PairsWeighing, out: Path) -> Path | None:
    """The pairs panels (`judging.plain_steps_curve` on the pairs as two-prompt streams): each mode weighed at the
    workflow's steps with its verdict, and at the knee where it ran there."""
    points = []
    for steps, mode in weighing.modes:
        quality = weighing.quality(steps, mode)
        label = f"{mode}: {profile.equal_quality[mode].words()}" if steps == weighing.steps and \
            mode in profile.equal_quality else f"{mode} at {steps} steps (the knee)"
        points.append({"label": label, "model_calls": quality.model_calls, "psnr": quality.psnr_db,
                       "detail": quality.detail, "adherence": quality.adherence})
    return yardstick_panels(weighing.curve(), points, out / "plot-pairs.png",
                            f"reuse vs the plain-steps curve on the pairs: profile {profile.name!r}")


def _signal_plots(plt, measured: list[Measured], profile: Profile, out: Path) -> list[Path]:
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
        written.append(_saved(plt, figure, out / f"plot-{signal}.png"))
    return written


def _saved(plt, figure, path: Path) -> Path:
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path

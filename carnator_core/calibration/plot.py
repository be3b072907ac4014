"""The calibration plots: each forced resume's probe signal against how close its clip stayed to plain, and what
reuse and lowering the steps each cost for how close they stay.

One panel per signal (structure, and guidance where CFG is on). Resumes of the fitted pairs are filled circles and
held-back ones hollow squares, one colour per resume depth; the fitted rule's bar at each depth is a dashed line of
that depth's colour, the shipped rule's a dotted grey line, the target PSNR a solid horizontal line. Every line is
named in a legend beside the axes, so no label covers another in the crowded high-agreement corner.

The trade-off panel (`plot-calls.png`, where plain also ran at fewer steps) puts PSNR to plain against model calls:
the resumes as above, each pair's plain-<n> runs as grey crosses, the fewer-steps curve (the pairs weighed together)
as a joined line, and each mode's requests on the weighed pairs as a star: a star above the curve beats lowering the
steps, one below it does not.

The stream panels (`plot-stream.png`, a stream calibration) show the yardstick's three measures against model calls,
one axis each, as `bench workload`'s plot does: PSNR to plain, detail kept and adherence (where the demo oracle
scores the prompts); the plain-steps curve joined, each point named by its step count, each mode named with its
verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from carnator_core.calibration.fit import held_back
from carnator_core.calibration.session import Measured, PlainRun
from carnator_core.judging.calibration_profile import Profile
from carnator_core.judging.plot import plot_unavailable, pyplot, yardstick_panels
from carnator_core.judging.probe_thresholds import ProbeThresholds
from carnator_core.judging.yardstick import StreamQuality


def calibration_plots(measured: list[Measured], profile: Profile, out: Path,
                      plain_runs: Sequence[PlainRun] = ()) -> tuple[list[Path], str]:
    """The plots written to `out`, and a line saying why there are none where matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return [], plot_unavailable("calibration plot")
    written = _signal_plots(plt, measured, profile, out)
    if profile.fewer_steps and all(v.weighed_on == "pairs" for v in profile.equal_quality.values()):
        written.append(_trade_off_plot(plt, measured, profile, out, plain_runs))
    return written, ""


def stream_plots(profile: Profile, curve: list[dict], modes: dict[str, StreamQuality], out: Path) -> Path | None:
    """The stream panels (`judging.plot.yardstick_panels`): `curve` (the plain runs weighed against,
    `StreamCalibration.curve`) and each weighed mode with its verdict; None without matplotlib."""
    points = [{"label": f"{mode}: {profile.equal_quality[mode].words()}", "model_calls": quality.model_calls,
               "psnr": quality.psnr_db, "detail": quality.detail, "adherence": quality.adherence}
              for mode, quality in modes.items() if mode in profile.equal_quality]
    return yardstick_panels(curve, points, out / "plot-stream.png",
                            f"reuse vs the plain-steps curve on the stream: profile {profile.name!r}")


def _trade_off_plot(plt, measured: list[Measured], profile: Profile, out: Path,
                    plain_runs: Sequence[PlainRun]) -> Path:
    figure, axes = plt.subplots(figsize=(10, 6), dpi=100)
    for index, depth in enumerate(sorted({m.resume.depth for m in measured})):
        colour = f"C{index % 10}"
        for kept_back, marker, face in ((False, "o", colour), (True, "s", "none")):
            at = [m for m in measured if m.resume.depth == depth and held_back(m.resume.pair) == kept_back
                  and m.model_calls is not None]
            if at:
                axes.scatter([m.model_calls for m in at], [m.resume.psnr_db for m in at], marker=marker, s=36,
                             facecolors=face, edgecolors=colour, zorder=3,
                             label=f"resumed at {depth:.0%} {'held back' if kept_back else 'fitted'}")
    counts = {run.steps for run in profile.fewer_steps.values()}
    lowered = [run for run in plain_runs if run.steps in counts]
    if lowered:
        axes.scatter([r.model_calls for r in lowered], [r.psnr_db for r in lowered], marker="x", s=30, color="grey",
                     zorder=2, label="plain at fewer steps, per pair")
    curve = sorted(profile.fewer_steps.items(), key=lambda item: item[1].model_calls)
    axes.plot([run.model_calls for _, run in curve], [run.psnr_db for _, run in curve], color="black", marker="D",
              linewidth=1.5, zorder=4, label="plain at fewer steps, weighed pairs together")
    for name, run in curve:
        axes.annotate(name, (run.model_calls, run.psnr_db), textcoords="offset points", xytext=(6, -12), fontsize=8)
    for mode, marker in zip(("balanced", "fast"), ("*", "P"), strict=True):
        weighed = profile.equal_quality.get(mode)
        if weighed is not None:
            axes.scatter([weighed.model_calls], [weighed.psnr_db], marker=marker, s=180, color="crimson", zorder=5,
                         edgecolors="black", label=f"{mode}: {weighed.calls:.2f}x vs {weighed.against} "
                                                   f"({weighed.resumed}/{weighed.pairs} resumed)")
    axes.axhline(profile.target.psnr_db, color="black", linewidth=1, linestyle=":",
                 label=f"target {profile.target.psnr_db:g} dB")
    axes.set(title=f"reuse vs fewer steps: profile {profile.name!r}", xlabel="model calls per request",
             ylabel="PSNR to the plain clip (dB)")
    axes.grid(True, alpha=0.3)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return _saved(plt, figure, out / "plot-calls.png")


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

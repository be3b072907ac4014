"""A whole calibration: the pairs, the session's runs, the fit, the profile with its plots, and filing it.

The command (`python -m carnator_core.calibrate`) and the graph editor's `CarnatorCalibrate` node both run
`calibrate`, so a calibration started either way measures, fits and files the same profile.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from carnator_core.bench.plot import scatter
from carnator_core.calibration.fit import Fit, accepts, fit
from carnator_core.calibration.pairs import Pair, pairs_from_history
from carnator_core.calibration.profile import THRESHOLD_RANGES, Profile, QualityTarget
from carnator_core.calibration.session import Measured, Progress, Session
from carnator_core.calibration.workflow import CalibrationWorkflow
from carnator_core.client import ComfyClient, ComfyError
from carnator_core.reuse.settings import FORCED_DEPTHS

HISTORY_PAGE = 100


class NothingToCalibrate(RuntimeError):
    """No resume could be measured; the message says why."""


class NoPairs(NothingToCalibrate):
    """Neither the pairs given nor the store's history hold a pair to calibrate on."""


@dataclass(frozen=True)
class CalibrationPlan:
    """What to calibrate: the prepared workflow, its pairs (None: drawn from the store's history) and the target."""

    workflow: CalibrationWorkflow
    pairs: list[Pair] | None
    out: Path
    name: str
    depths: tuple[float, ...] = FORCED_DEPTHS
    target: QualityTarget = field(default_factory=QualityTarget)
    max_pairs: int = 12
    install: bool = True


@dataclass(frozen=True)
class Calibrated:
    """A finished calibration: the profile, the per-depth table, and where the profile was filed (None: not)."""

    profile: Profile
    result: Fit
    resumes: int
    table: list[str]
    location: str | None
    plots: list[Path]
    minutes: float

    def lines(self) -> list[str]:
        """What the command prints and the node reports when it is done."""
        t = self.result.thresholds
        held, held_pairs, oracle = self.result.held_back, self.result.held_back_pairs, self.result.oracle
        by_oracle = (f"; by the demo oracle: precision {_share(oracle.precision)}, recall {_share(oracle.recall)}"
                     if oracle else "")
        lines = [f"{self.resumes} resumes measured in {self.minutes:.1f} min", *self.table,
                 f"fitted: structure {t.structure:.3f}, guidance {t.guidance:.2f}, slope {t.structure_slope:.2f}",
                 f"held back ({held_pairs} pair{'' if held_pairs == 1 else 's'}): precision {_share(held.precision)}, "
                 f"recall {_share(held.recall)}{by_oracle}"]
        if not self.result.met_target:
            target = self.profile.target
            lines.append(f"no rule kept {target.precision:.0%} of the resumes it accepts within {target.psnr_db:g} dB "
                         f"and SSIM {target.ssim:g} of plain ({self.result.fitted.good} of the fitted pairs' resumes "
                         "are): this profile accepts no resume, so on this model and schedule Carnator borrows "
                         "attention masks only. To resume here, calibrate on more pairs or loosen the target (PSNR, "
                         "SSIM or precision).")
        if self.location is not None:
            lines.append(f"filed as {self.profile.describe()} in the store at {self.location}")
        return lines


def calibrate(client: ComfyClient, plan: CalibrationPlan, echo: Callable[[str], None] = print,
              on_progress: Callable[[Progress], None] | None = None,
              should_stop: Callable[[], bool] = lambda: False) -> Calibrated:
    """Run what is left of the calibration in `plan.out`, fit, write `profile.json`, `summary.json` and the plots
    there, and file the profile (unless `plan.install` is off). Raises CalibrationInterrupted when the server goes
    away or `should_stop()` says so before a run, NothingToCalibrate (NoPairs), WorkflowError, or ComfyError (the
    profile could not be filed: it is still written)."""
    started = time.monotonic()
    pairs = plan.pairs[:plan.max_pairs] if plan.pairs is not None else None
    if pairs is None:
        pairs, note = history_pairs(client, plan.workflow, plan.max_pairs)
        echo(note)
    if not pairs:
        raise NoPairs("no pairs to calibrate on")
    session = Session(client, plan.workflow, pairs, list(plan.depths), plan.out, echo=echo, on_progress=on_progress,
                      should_stop=should_stop)
    echo(f"calibrating on {len(pairs)} pairs x {len(plan.depths)} depths "
         f"({'decoded frames' if plan.workflow.decoder else 'latents'}"
         f"{', demo oracle' if plan.workflow.runs_demo else ''}); results in {plan.out}")
    measured = session.run()
    if not measured or not session.fingerprints:
        raise NothingToCalibrate("no resume could be measured (each run's line says why)")
    result = fit([m.resume for m in measured], plan.target)
    profile = Profile(model=str(session.fingerprints["model"]), schedule=str(session.fingerprints["schedule"]),
                      name=plan.name, thresholds={name: getattr(result.thresholds, name) for name in THRESHOLD_RANGES},
                      target=plan.target, fit_pairs=result.fit_pairs, held_back_pairs=result.held_back_pairs,
                      held_back=result.held_back, oracle=result.oracle,
                      cfg=float(session.fingerprints.get("cfg", 1.0)))
    (plan.out / "profile.json").write_text(profile.to_json())
    written = plots(measured, profile, plan.out)
    summary = {"profile": profile.as_dict(), "fitted": result.fitted.__dict__, "met_target": result.met_target,
               "resumes": len(measured), "skipped_pairs": session.skipped, "plots": [str(p) for p in written]}
    (plan.out / "summary.json").write_text(json.dumps(summary, indent=2))
    location = None
    if plan.install:
        try:
            location = session.install(profile.as_dict())
        except ComfyError as error:
            raise ComfyError(f"the profile could not be filed in the store ({error}); it is in "
                             f"{plan.out / 'profile.json'}") from None
    return Calibrated(profile=profile, result=result, resumes=len(measured), table=depth_table(measured, result, plan),
                      location=location, plots=written, minutes=(time.monotonic() - started) / 60)


def depth_table(measured: list[Measured], result: Fit, plan: CalibrationPlan) -> list[str]:
    """Per depth: the resumes measured, the good ones, and what the fitted rule accepts (of them good)."""
    lines = ["depth  resumes  good  accepted by the fitted rule (of them good)"]
    for depth in sorted({m.resume.depth for m in measured}):
        at = [m.resume for m in measured if m.resume.depth == depth]
        good = [plan.target.good(r.psnr_db, r.ssim) for r in at]
        taken = [accepts(result.thresholds, r) for r in at]
        kept = sum(t and g for t, g in zip(taken, good, strict=True))
        lines.append(f"{depth:5.0%}  {len(at):7}  {sum(good):4}  {sum(taken):8} ({kept})")
    return lines


def history_pairs(client: ComfyClient, workflow: CalibrationWorkflow, limit: int) -> tuple[list[Pair], str]:
    """Pairs from the history of the store the workflow's reuse node reads."""
    location = Session.store_location(client, workflow)
    entries, offset = [], 0
    while True:
        query = urllib.parse.urlencode({"store": location, "offset": offset, "limit": HISTORY_PAGE})
        page = client.api(f"/carnator/store/entries?{query}")
        entries += page.get("entries", [])
        offset += HISTORY_PAGE
        if offset >= int(page.get("total") or 0):
            return pairs_from_history(entries, limit)


def plots(measured: list[Measured], profile: Profile, out: Path) -> list[Path]:
    """One scatter per signal: each resume's signal against its PSNR to plain, one colour per depth, with the target
    PSNR (horizontal) and the fitted threshold at each depth (vertical) as guides."""
    written = []
    for signal in ("structure", "guidance"):
        ordered = sorted((m for m in measured if getattr(m.resume, signal) is not None), key=lambda m: m.resume.depth)
        points = [(f"{m.resume.depth:.0%}", getattr(m.resume, signal), m.resume.psnr_db) for m in ordered]
        if points:
            threshold, slope = profile.thresholds[signal], profile.thresholds[signal + "_slope"]
            bars = tuple(sorted({round(min(1.0, threshold + slope * m.resume.depth), 4) for m in ordered}))
            title = (f"{signal} agreement vs PSNR to plain, coloured by resume depth; fitted threshold "
                     f"{threshold:.3f} + {slope:.2f} x depth (vertical), target {profile.target.psnr_db:.0f} dB "
                     f"(horizontal)")
            written.append(scatter(points, out / f"plot-{signal}.png", title, f"{signal} agreement at the resume",
                                   "PSNR to plain (dB)", x_lines=bars, y_lines=(profile.target.psnr_db,),
                                   colour_by_label=True))
    return written


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"

"""A whole calibration: the pairs, the session's runs, the fit, the profile with its plots, and filing it.

The command (`python -m carnator_core.calibrate`) and the graph editor's `CarnatorCalibrate` node both run
`calibrate`, so a calibration started either way measures, fits and files the same profile.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from carnator_core.calibration.equal_quality import PairsWeighing
from carnator_core.calibration.fit import HELD_BACK_EVERY, Fit, accepts, fit
from carnator_core.calibration.plot import calibration_plots, stream_plots
from carnator_core.calibration.server_runs import Progress
from carnator_core.calibration.session import KneeRun, Measured, PlainRun, Session
from carnator_core.calibration.stream import NoStreamVerdict, StreamCalibration
from carnator_core.calibration.verdict import pairs_line, verdict
from carnator_core.calibration.workflow import CalibrationWorkflow
from carnator_core.client import ComfyClient, ComfyError
from carnator_core.judging.calibration_profile import THRESHOLD_RANGES, WEIGHED_MODES, Profile
from carnator_core.judging.plain_steps_curve import MAX_LOWERED_COUNTS, next_count
from carnator_core.judging.probe_thresholds import ProbeThresholds
from carnator_core.judging.quality_target import QualityTarget
from carnator_core.prompt_pairs import Pair, pairs_from_history, stream_from_history
from carnator_core.reuse.settings import FORCED_DEPTHS

HISTORY_PAGE = 100
FEWEST_STEPS = 2  # plain at fewer steps never runs below this
STREAM_ONLY_REASON = ("not in force: a stream calibration fits no thresholds (calibrate on pairs, --pairs or "
                      "--from-store, to fit them); it carries the stream's verdict")


class NothingToCalibrate(RuntimeError):
    """No resume could be measured; the message says why."""


class NoPairs(NothingToCalibrate):
    """Nothing given to calibrate on: no pair (given or in the store's history) and no stream that can give a
    verdict; the message says why."""


@dataclass(frozen=True)
class CalibrationPlan:
    """What to calibrate: the prepared workflow, its pairs (None: the pairs and the stream drawn from the store's
    history; empty: none), the stream of prompts the verdict is weighed on (None: each pair weighed as a two-prompt
    stream) and the target."""

    workflow: CalibrationWorkflow
    pairs: list[Pair] | None
    out: Path
    name: str
    depths: tuple[float, ...] = FORCED_DEPTHS
    target: QualityTarget = field(default_factory=QualityTarget)
    max_pairs: int = 12
    install: bool = True
    force: bool = False  # put the profile in force whatever its held-back pairs say
    fewer_steps: bool = True  # also sample plain at fewer steps, to weigh each mode against lowering the steps
    prompts: list[str] | None = None


@dataclass(frozen=True)
class Calibrated:
    """A finished calibration: the profile, the per-depth table, and where the profile was filed (None: not)."""

    profile: Profile
    result: Fit | None  # None: a calibration on a stream alone, which fits nothing
    resumes: int
    table: list[str]
    location: str | None
    plots: list[Path]
    minutes: float
    pairs_used: int = 0
    plot_note: str = ""  # why there is no plot, where there is none
    fewer_steps_note: str = ""  # why no mode is weighed against plain at fewer steps, where none is

    def lines(self) -> list[str]:
        """What the command prints and the node reports when it is done."""
        if self.result is None:
            return [self.profile.reason, f"stream calibrated in {self.minutes:.1f} min", *self._closing()]
        t = self.result.thresholds
        held, held_pairs, oracle = self.result.held_back, self.result.held_back_pairs, self.result.oracle
        by_oracle = (f"; by the demo oracle: precision {_share(oracle.precision)}, recall {_share(oracle.recall)}"
                     if oracle else "")
        shipped = self.result.shipped_held_back
        by_shipped = f"; shipped rule on them: precision {_share(shipped.precision)}" if shipped else ""
        bound = "n/a" if self.result.lower_bound is None else f"{self.result.lower_bound:.2f}"
        margin = "meets" if self.result.margin_met else "misses"
        lines = [self.profile.reason, pairs_line(self.result, self.pairs_used),
                 f"{self.resumes} resumes measured in {self.minutes:.1f} min", *self.table,
                 f"fitted: structure {t.structure:.3f}, guidance {t.guidance:.2f}, slope {t.structure_slope:.2f} "
                 f"(95% lower bound on its fitted precision {bound}: {margin} the target"
                 f"{'' if self.result.margin_met else ', so it is no looser than the shipped rule'})",
                 f"held back ({held_pairs} pair{'' if held_pairs == 1 else 's'}): precision {_share(held.precision)}, "
                 f"recall {_share(held.recall)}{by_oracle}{by_shipped}"]
        if not self.result.met_target:
            target = self.profile.target
            lines.append(f"no rule kept {target.precision:.0%} of the resumes it accepts within {target.psnr_db:g} dB "
                         f"and SSIM {target.ssim:g} of plain ({self.result.fitted.good} of the fitted pairs' resumes "
                         "are): this profile accepts no resume, so on this model and schedule Carnator borrows "
                         "attention masks only. To resume here, calibrate on more pairs or loosen the target (PSNR, "
                         "SSIM or precision).")
        return lines + self._closing()

    def _closing(self) -> list[str]:
        lines = [self.plot_note] if self.plot_note else []
        if self.location is not None:
            state = "in force" if self.profile.in_force else "not in force: shipped thresholds judge"
            lines.append(f"filed as {self.profile.describe()} in the store at {self.location} ({state})")
        # last, what the user came for: per mode, whether reuse beats lowering the steps (or why that is not told)
        return lines + [line for line in self.profile.verdict_lines() or [self.fewer_steps_note] if line]


def calibrate(client: ComfyClient, plan: CalibrationPlan, echo: Callable[[str], None] = print,
              on_progress: Callable[[Progress], None] | None = None,
              should_stop: Callable[[], bool] = lambda: False) -> Calibrated:
    """Run what is left of the calibration in `plan.out`: the stream (where there is one) and the pairs (where there
    are any), fit, write `profile.json`, `summary.json` and the plots there, and file the profile (unless
    `plan.install` is off). Raises CalibrationInterrupted when the server goes away or `should_stop()` says so before
    a run, NothingToCalibrate (NoPairs), WorkflowError, or ComfyError (the profile could not be filed: it is still
    written)."""
    started = time.monotonic()
    pairs = plan.pairs[:plan.max_pairs] if plan.pairs is not None else None
    prompts = plan.prompts
    if pairs is None:
        pairs, prompts, note = history(client, plan.workflow, plan.max_pairs)
        echo(note)
    if prompts is not None and not plan.fewer_steps:
        echo("the stream is not weighed: plain at fewer steps is turned off, and the stream weighs reuse against it")
        prompts = None
    stream = None if prompts is None else _stream(client, plan, prompts, bool(pairs), echo, on_progress, should_stop)
    if stream is None and not pairs:
        raise NoPairs("neither pairs nor a stream of prompts to calibrate on")
    try:
        stream_verdict = None if stream is None else stream.run()
    except NoStreamVerdict as error:
        raise NothingToCalibrate(str(error)) from None
    if stream_verdict is not None and stream_verdict.note:
        echo(stream_verdict.note)
    fitted = _fitted(client, plan, distinct_pairs(pairs, echo), echo, on_progress, should_stop,
                     weigh=stream_verdict is None) if pairs else None
    if fitted is None:
        profile = _stream_profile(plan, stream)
        measured, plain_runs, knee_runs, note = [], [], [], ""
    else:
        profile, measured, plain_runs, note = fitted.profile, fitted.measured, fitted.plain_runs, fitted.note
        knee_runs = fitted.knee_runs
    if stream_verdict is not None:
        profile = replace(profile, fewer_steps=stream_verdict.fewer_steps, equal_quality=stream_verdict.verdicts,
                          recommended=stream_verdict.recommended)
        note = stream_verdict.note or note
    (plan.out / "profile.json").write_text(profile.to_json())
    written, plot_note = calibration_plots(measured, profile, plan.out, None if fitted is None else fitted.weighing)
    curve = None if stream is None else stream.curve()
    if stream is not None:
        stream_plot = stream_plots(profile, curve, {mode: stream.mode_quality(mode) for mode in WEIGHED_MODES},
                                   plan.out)
        written += [stream_plot] if stream_plot else []
    result = None if fitted is None else fitted.result
    summary = {"profile": profile.as_dict(), "resumes": len(measured), "plots": [str(p) for p in written],
               "plain_runs": [asdict(run) for run in plain_runs], "knee_runs": [asdict(run) for run in knee_runs],
               "equal_quality_verdict": profile.verdict_lines() or
               [note], **(fitted.summary if fitted else {}),
               **({"stream": {"prompts": prompts, "curve": curve,
                              "runs": [asdict(row) for row in stream.rows]}} if stream is not None else {})}
    (plan.out / "summary.json").write_text(json.dumps(summary, indent=2))
    location = None
    if plan.install:
        try:
            location = _install(client, plan.workflow, profile, merge=fitted is None)
        except ComfyError as error:
            raise ComfyError(f"the profile could not be filed in the store ({error}); it is in "
                             f"{plan.out / 'profile.json'}") from None
    return Calibrated(profile=profile, result=result, resumes=len(measured),
                      table=[] if fitted is None else fitted.table, location=location, plots=written,
                      minutes=(time.monotonic() - started) / 60, pairs_used=0 if fitted is None else fitted.pairs_used,
                      plot_note=plot_note, fewer_steps_note=note)


def _stream(client: ComfyClient, plan: CalibrationPlan, prompts: list[str], fits_pairs: bool,
            echo: Callable[[str], None], on_progress: Callable[[Progress], None] | None,
            should_stop: Callable[[], bool]) -> StreamCalibration | None:
    """The stream calibration of `prompts`; where the stream can give no verdict, NothingToCalibrate, or (with pairs
    to fit on) None and a line saying why."""
    try:
        stream = StreamCalibration(client, plan.workflow, prompts, plan.out / "stream", echo=echo,
                                   on_progress=on_progress, should_stop=should_stop)
    except NoStreamVerdict as error:
        if not fits_pairs:
            raise NoPairs(str(error)) from None
        echo(f"{error}; the pairs still fit thresholds")
        return None
    echo(f"stream: {len(prompts)} prompts, plain and {' and '.join(WEIGHED_MODES)} each as the engine runs them, then "
         f"plain at up to {MAX_LOWERED_COUNTS} bisected step counts (at most {MAX_LOWERED_COUNTS + 1} plain runs per "
         "prompt)")
    return stream


@dataclass(frozen=True)
class _Fitted:
    """The pairs' part of a calibration: the fitted profile (weighed on the pairs), what it was fitted on, and the
    summary's fields about the fit."""

    profile: Profile
    result: Fit
    measured: list[Measured]
    plain_runs: list[PlainRun]
    pairs_used: int
    table: list[str]
    note: str
    summary: dict
    weighing: PairsWeighing | None = None  # the pairs weighed against plain at fewer steps (None: not run)
    knee_runs: list[KneeRun] = field(default_factory=list)


def _fitted(client: ComfyClient, plan: CalibrationPlan, pairs: list[Pair], echo: Callable[[str], None],
            on_progress: Callable[[Progress], None] | None, should_stop: Callable[[], bool], *,
            weigh: bool) -> _Fitted:
    """The pairs calibrated: thresholds fitted and, unless a stream already weighed the modes (`weigh` False), the
    pairs weighed against plain at fewer steps as two-prompt streams."""
    lowers, fewer_steps_note = fewer_steps_plan(plan) if weigh else (
        False, "the pairs fit thresholds only: the stream weighed the modes against plain at fewer steps")
    echo(fewer_steps_note)
    session = Session(client, plan.workflow, pairs, list(plan.depths), plan.out, echo=echo, on_progress=on_progress,
                      should_stop=should_stop)
    echo(f"calibrating on {len(pairs)} pairs x {len(plan.depths)} depths "
         f"({'decoded frames' if plan.workflow.decoder else 'latents'}"
         f"{f', {plan.workflow.oracle.name} oracle' if plan.workflow.oracle else ''}); results in {plan.out}")
    measured = session.run()
    if not measured or not session.fingerprints:
        raise NothingToCalibrate("no resume could be measured (each run's line says why)")
    result = fit([m.resume for m in measured], plan.target)
    pairs_used = len({m.resume.pair for m in measured})
    decided = verdict(result, plan.target, pairs_used, plan.force)
    profile = Profile(model=str(session.fingerprints["model"]), schedule=str(session.fingerprints["schedule"]),
                      name=plan.name, thresholds={name: getattr(result.thresholds, name) for name in THRESHOLD_RANGES},
                      target=plan.target, fit_pairs=result.fit_pairs, held_back_pairs=result.held_back_pairs,
                      held_back=result.held_back, oracle=result.oracle,
                      cfg=float(session.fingerprints.get("cfg", 1.0)), in_force=decided.in_force,
                      reason=decided.reason, forced=decided.forced)
    weighing = None
    if lowers:
        judging = profile.probe_thresholds() if profile.in_force else ProbeThresholds()
        weighing = _plain_steps_curve(session, measured, judging, plan.workflow.steps, echo)
        fewer, verdicts, recommended = weighing.weigh()
        profile = replace(profile, fewer_steps=fewer, equal_quality=verdicts, recommended=recommended)
        if not verdicts:
            fewer_steps_note = "no pair has its plain runs at fewer steps measured: no mode is weighed against them"
    plain_runs = session.these_plain_runs()
    summary = {"fitted": result.fitted.__dict__, "met_target": result.met_target, "margin_met": result.margin_met,
               "fitted_lower_bound": result.lower_bound,
               "shipped_held_back": None if result.shipped_held_back is None else result.shipped_held_back.__dict__,
               "pairs_used": pairs_used, "pairs_needed": result.pairs_needed, "skipped_pairs": session.skipped}
    return _Fitted(profile=profile, result=result, measured=measured, plain_runs=plain_runs, pairs_used=pairs_used,
                   table=depth_table(measured, result, plan), note=fewer_steps_note, summary=summary,
                   weighing=weighing, knee_runs=session.these_knee_runs())


def _plain_steps_curve(session: Session, measured: list[Measured], thresholds: ProbeThresholds, steps: int,
                       echo: Callable[[str], None]) -> PairsWeighing:
    """Plain at the step counts that bracket each mode's quality and the knee (`judging.plain_steps_curve`), on every
    pair, then each weighed mode at the knee; the pairs weighed on all of it."""
    def weighing() -> PairsWeighing:
        return PairsWeighing(measured, session.these_plain_runs(), thresholds, steps, session.these_knee_runs())

    counts = weighing().counts
    session.expect(len(session.pairs) * (MAX_LOWERED_COUNTS + len(WEIGHED_MODES)))
    for count in counts:  # a count an interrupted calibration began
        session.plain_at(count)
    while len(counts) < MAX_LOWERED_COUNTS:
        count = next_count(steps, counts, weighing().judges(), fewest=FEWEST_STEPS)
        if count is None:
            break
        echo(f"plain-steps curve: plain at {count} of {steps} steps on every pair")
        session.plain_at(count)
        counts = [*counts, count]
    at_knee = weighing().knee()
    if at_knee < steps:
        echo(f"knee of the plain-steps curve: plain at {at_knee} of {steps} steps is as good as full plain; "
             f"{', '.join(WEIGHED_MODES)} at {at_knee} steps on every pair")
        session.modes_at(at_knee)
    return weighing()


def _stream_profile(plan: CalibrationPlan, stream: StreamCalibration) -> Profile:
    """The profile of a calibration on a stream alone: the shipped thresholds, not in force (a stream fits none), to
    carry the stream's verdict."""
    if not stream.fingerprints:
        raise NothingToCalibrate("no run of the stream was recorded, so the model it ran cannot be told")
    return Profile(model=str(stream.fingerprints["model"]), schedule=str(stream.fingerprints["schedule"]),
                   name=plan.name, thresholds={name: getattr(ProbeThresholds(), name) for name in THRESHOLD_RANGES},
                   target=plan.target, cfg=float(stream.fingerprints.get("cfg", 1.0)), in_force=False,
                   reason=STREAM_ONLY_REASON)


def _install(client: ComfyClient, workflow: CalibrationWorkflow, profile: Profile, merge: bool) -> str:
    """File `profile` in the store the workflow's reuse node reads; with `merge`, a profile already filed there for
    the same model and schedule keeps its thresholds and takes this one's verdict. The store's location."""
    location = Session.store_location(client, workflow)
    query = urllib.parse.urlencode({"store": location})
    if merge:
        filed = next((p for p in client.api(f"/carnator/store/profiles?{query}").get("profiles", [])
                      if p.get("key") == profile.key), None)
        if filed is not None:
            kept = Profile.from_dict({name: value for name, value in filed.items() if name not in ("key", "description")})
            profile = replace(kept, fewer_steps=profile.fewer_steps, equal_quality=profile.equal_quality,
                              recommended=profile.recommended)
    client.api(f"/carnator/store/profiles?{query}", profile.as_dict())
    return location


def fewer_steps_plan(plan: CalibrationPlan) -> tuple[bool, str]:
    """Whether plain also runs at fewer steps (bisected, at least `FEWEST_STEPS`), and one line saying so, or why
    not."""
    if not plan.fewer_steps:
        return False, "plain at fewer steps: not run (turned off), so no mode is weighed against lowering the steps"
    workflow = plan.workflow
    if workflow.steps is None:
        return False, f"plain at fewer steps: not run, since the steps cannot be lowered here: {workflow.steps_note}"
    first = (FEWEST_STEPS - 1 + workflow.steps) // 2  # the middle of the first bracket (`next_count`)
    if first < FEWEST_STEPS:
        return False, f"plain at fewer steps: none of {workflow.steps} steps leaves {FEWEST_STEPS} or more"
    return True, (f"plain also at up to {MAX_LOWERED_COUNTS} bisected step counts of {workflow.steps} (the first "
                  f"{first}), then {' and '.join(WEIGHED_MODES)} at the knee")


def distinct_pairs(pairs: list[Pair], echo: Callable[[str], None]) -> list[Pair]:
    """The pairs less repeats and pairs of one prompt twice (each named); NoPairs where none is left. Fewer than a
    profile needs are calibrated (the measurements are kept) with a line saying that no profile will be put in
    force: every third pair is held back to decide that."""
    kept: list[Pair] = []
    for number, pair in enumerate(pairs, 1):
        if pair.earlier == pair.new:
            echo(f"pair {number} ({pair.earlier[:60]!r}) has the same prompt twice: skipped")
        elif pair in kept:
            echo(f"pair {number} ({pair.earlier[:40]!r} -> {pair.new[:40]!r}) repeats an earlier pair: skipped")
        else:
            kept.append(pair)
    given = f"{len(kept)} distinct pair{'' if len(kept) == 1 else 's'} of {len(pairs)} given"
    if not kept:
        raise NoPairs(f"{given}: nothing to calibrate on")
    if len(kept) < HELD_BACK_EVERY:
        echo(f"{given}: no profile will be put in force, since that takes at least {HELD_BACK_EVERY} distinct pairs "
             f"(every {HELD_BACK_EVERY}rd is held back to test the fit) and a stable fit far more; calibrate on more "
             "pairs")
    return kept


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


def history(client: ComfyClient, workflow: CalibrationWorkflow, limit: int) -> tuple[list[Pair], list[str], str]:
    """The pairs and the stream of prompts from the history of the store the workflow's reuse node reads, and a line
    saying what was found."""
    location = Session.store_location(client, workflow)
    entries, offset = [], 0
    while True:
        query = urllib.parse.urlencode({"store": location, "offset": offset, "limit": HISTORY_PAGE})
        page = client.api(f"/carnator/store/entries?{query}")
        entries += page.get("entries", [])
        offset += HISTORY_PAGE
        if offset >= int(page.get("total") or 0):
            pairs, note = pairs_from_history(entries, limit)
            return pairs, stream_from_history(entries, limit + 1), note


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"

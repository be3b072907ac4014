"""Is reuse worth it on this model, told from the pairs alone: each resuming mode weighed against plain sampling at
fewer steps by the one yardstick (`judging.yardstick`), each pair weighed as a two-prompt stream.

Per pair weighed (the held-back ones, which the fit never saw; every pair where none is held back) the stream is the
earlier prompt, sampled plain (nothing is stored before it: every configuration costs it its plain calls; at fewer
steps it is taken to lose what the new prompt's run at as many steps loses, since only the new prompt is sampled
there), then the new prompt. In a mode the new prompt resumes at the deepest measured depth within the mode's limit
(`RESUME_LIMITS`) that the rule judging it (the profile's where it is in force, else the shipped one) accepts, as the
engine resumes at the deepest checkpoint its probes pass: it costs that forced resume's model calls and its clip is
that resume's. A request the rule resumes nowhere costs the plain run's calls and one probe call (a miss costs at most
one) and its clip is the plain one.

The recommendation (`judging.recommendation`) is the cheapest of plain at each measured count and the modes at the
workflow's steps that is as good as full plain, over the same two-prompt streams. A stream calibration
(`calibration.stream`) weighs the modes as the engine runs them instead, at the knee too; this is what a calibration
on pairs alone can tell.
"""

from __future__ import annotations

import statistics

from carnator_core.calibration.fit import accepts, held_back
from carnator_core.calibration.session import Measured, PlainRun
from carnator_core.judging.calibration_profile import WEIGHED_MODES, FewerStepsRun, ModeVerdict
from carnator_core.judging.probe_thresholds import ProbeThresholds
from carnator_core.judging.quality import mse_from_psnr
from carnator_core.judging.recommendation import Recommendation, recommend
from carnator_core.judging.yardstick import RequestOutcome, StreamQuality, equal_quality
from carnator_core.reuse.settings import RESUME_LIMITS

MISS_PROBE_CALLS = 1  # what a request that resumes nowhere spends beyond the plain run: one probe call


def weigh(measured: list[Measured], plain_runs: list[PlainRun], thresholds: ProbeThresholds,
          steps: int) -> tuple[dict[str, FewerStepsRun], dict[str, ModeVerdict], Recommendation | None]:
    """The fewer-steps runs by name, the verdict per weighed mode and the recommendation, on the pairs with every
    plain run measured; empty (and None) where there is no such pair."""
    counts = sorted({r.steps for r in plain_runs if r.steps != steps}, reverse=True)
    by_pair = {(r.pair, r.steps): r for r in plain_runs}
    complete = sorted({r.pair for r in plain_runs if all((r.pair, n) in by_pair for n in (steps, *counts))})
    kept_back = [pair for pair in complete if held_back(pair)]
    pairs = kept_back or complete
    if not pairs or not counts:
        return {}, {}, None
    donors = [RequestOutcome(model_calls=by_pair[p, steps].model_calls, mse=0.0, detail=1.0) for p in pairs]
    plain = [*donors, *donors]
    # at fewer steps the earlier prompt is taken to lose what the new one does: both at the new prompt's run
    lowered = {n: [_outcome(by_pair[p, n]) for p in pairs] * 2 for n in counts}
    fewer = {f"plain-{n}": fewer_steps_run(n, lowered[n], [by_pair[p, n].ssim for p in pairs]) for n in counts}
    verdicts, weighed_runs = {}, {}
    for mode in WEIGHED_MODES:
        requests = [_request(mode, [m for m in measured if m.resume.pair == pair], by_pair[pair, steps], thresholds)
                    for pair in pairs]
        runs = [*donors, *(outcome for outcome, _, _ in requests)]
        weighed_runs[steps, mode] = runs
        weighed = equal_quality(runs, plain, lowered, steps)
        quality = StreamQuality.of(runs)
        verdicts[mode] = ModeVerdict(
            model_calls=round(weighed.model_calls, 2), psnr_db=round(quality.psnr_db, 2),
            ssim=round(statistics.median(similarity for _, similarity, _ in requests), 4),
            resumed=sum(resumed for _, _, resumed in requests), pairs=len(pairs), held_back=bool(kept_back),
            steps=steps, against=weighed.against, against_calls=round(weighed.against_calls, 2),
            calls=round(weighed.calls, 3), interval=weighed.rounded_interval(), decided_by=weighed.decided_by,
            steps_short=weighed.steps_short, weighed_on="pairs", detail=round(quality.detail, 4))
    return fewer, verdicts, recommend(plain, lowered, weighed_runs, steps)


def _request(mode: str, resumes: list[Measured], plain: PlainRun,
             thresholds: ProbeThresholds) -> tuple[RequestOutcome, float, bool]:
    """One pair's new prompt in `mode`: its outcome, its SSIM against plain, and whether it resumed."""
    within = [m for m in resumes if m.resume.depth <= RESUME_LIMITS[mode] + 1e-9 and m.model_calls is not None]
    taken = [m for m in within if accepts(thresholds, m.resume)]
    if not taken:
        calls = plain.model_calls + (MISS_PROBE_CALLS if within else 0)
        return RequestOutcome(model_calls=calls, mse=0.0, detail=1.0), plain.ssim, False
    deepest = max(taken, key=lambda m: m.resume.depth)
    return (RequestOutcome(model_calls=float(deepest.model_calls), mse=mse_from_psnr(deepest.resume.psnr_db),
                           detail=deepest.detail), deepest.resume.ssim, True)


def fewer_steps_run(steps: int, outcomes: list[RequestOutcome], ssims: list[float]) -> FewerStepsRun:
    """Plain at `steps` steps as a profile keeps it: its requests' outcomes together and their median SSIM."""
    quality = StreamQuality.of(outcomes)
    return FewerStepsRun(steps=steps, psnr_db=round(quality.psnr_db, 2), ssim=round(statistics.median(ssims), 4),
                         model_calls=round(quality.model_calls, 2), detail=round(quality.detail, 4))


def _outcome(run: PlainRun) -> RequestOutcome:
    return RequestOutcome(model_calls=run.model_calls, mse=mse_from_psnr(run.psnr_db), detail=run.detail)

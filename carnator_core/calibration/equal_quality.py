"""Is reuse worth it on this model? Each resuming mode weighed against plain sampling at fewer steps, on the
calibration's own pairs, by the yardstick of the workload benchmark (`carnator_core.judging.fewer_steps`).

Per pair weighed (the held-back ones, which the fit never saw; every pair where none is held back) a request in a
mode is taken to resume at the deepest measured depth within the mode's limit (`RESUME_LIMITS`) that the rule
judging it (the profile's where it is in force, else the shipped one) accepts, as the engine resumes at the deepest
checkpoint its probes pass: it costs that forced resume's model calls, and its clip is that resume's. A request the
rule resumes nowhere costs the plain run's calls and one probe call (a miss costs at most one) and its clip is the
plain one. Quality is PSNR against the full plain clips of the pairs' clips together (mean squared error over them,
so a plain clip's "infinite" dB cannot hide the ones that differ), as `bench workload` measures it; the cheapest
plain-<n> at least that close is the mode's yardstick.

What this does not measure: a resume from a donor is a different clip from the request's own plain one, and PSNR
against plain cannot tell a different valid clip from a worse one (docs/calibration.md).
"""

from __future__ import annotations

import statistics

from carnator_core.bench.quality import psnr_from_mse
from carnator_core.calibration.fit import accepts, held_back
from carnator_core.calibration.session import Measured, PlainRun
from carnator_core.judging.calibration_profile import WEIGHED_MODES, FewerStepsRun, ModeVerdict
from carnator_core.judging.fewer_steps import cheapest_as_good
from carnator_core.judging.probe_thresholds import ProbeThresholds
from carnator_core.reuse.settings import RESUME_LIMITS

MISS_PROBE_CALLS = 1  # what a request that resumes nowhere spends beyond the plain run: one probe call


def weigh(measured: list[Measured], plain_runs: list[PlainRun], thresholds: ProbeThresholds,
          steps: int) -> tuple[dict[str, FewerStepsRun], dict[str, ModeVerdict]]:
    """The fewer-steps runs by name and the verdict per weighed mode, on the pairs with every plain run measured;
    both empty where there is no such pair."""
    counts = sorted({r.steps for r in plain_runs if r.steps != steps}, reverse=True)
    by_pair = {(r.pair, r.steps): r for r in plain_runs}
    complete = sorted({r.pair for r in plain_runs if all((r.pair, n) in by_pair for n in (steps, *counts))})
    kept_back = [pair for pair in complete if held_back(pair)]
    pairs = kept_back or complete
    if not pairs or not counts:
        return {}, {}
    fewer = {f"plain-{n}": FewerStepsRun(steps=n, psnr_db=_together([by_pair[p, n].psnr_db for p in pairs]),
                                         ssim=round(statistics.median(by_pair[p, n].ssim for p in pairs), 4),
                                         model_calls=round(_mean([by_pair[p, n].model_calls for p in pairs]), 2))
             for n in counts}
    plain_calls = _mean([by_pair[p, steps].model_calls for p in pairs])
    verdicts = {mode: _verdict([_request(mode, [m for m in measured if m.resume.pair == pair], by_pair[pair, steps],
                                         thresholds) for pair in pairs], fewer, plain_calls, steps, bool(kept_back))
                for mode in WEIGHED_MODES}
    return fewer, verdicts


def _verdict(outcomes: list[tuple[float, float, float, bool]], fewer: dict[str, FewerStepsRun], plain_calls: float,
             steps: int, kept_back: bool) -> ModeVerdict:
    """A mode's requests (`_request`) weighed against the cheapest fewer-steps run as close to plain."""
    calls = _mean([outcome[0] for outcome in outcomes])
    psnr = _together([outcome[1] for outcome in outcomes])
    against = cheapest_as_good({name: run.model_calls for name, run in fewer.items()},
                               lambda name: fewer[name].psnr_db >= psnr) or "plain"
    against_calls = plain_calls if against == "plain" else fewer[against].model_calls
    return ModeVerdict(model_calls=round(calls, 2), psnr_db=psnr,
                       ssim=round(statistics.median(outcome[2] for outcome in outcomes), 4),
                       resumed=sum(outcome[3] for outcome in outcomes), pairs=len(outcomes), held_back=kept_back,
                       steps=steps, against=against, against_calls=round(against_calls, 2),
                       calls=round(against_calls / calls, 3))


def _request(mode: str, resumes: list[Measured], plain: PlainRun,
             thresholds: ProbeThresholds) -> tuple[float, float, float, bool]:
    """One pair's request in `mode`: its model calls, PSNR and SSIM against plain, and whether it resumed."""
    within = [m for m in resumes if m.resume.depth <= RESUME_LIMITS[mode] + 1e-9 and m.model_calls is not None]
    taken = [m for m in within if accepts(thresholds, m.resume)]
    if not taken:
        return plain.model_calls + (MISS_PROBE_CALLS if within else 0), plain.psnr_db, plain.ssim, False
    deepest = max(taken, key=lambda m: m.resume.depth)
    return float(deepest.model_calls), deepest.resume.psnr_db, deepest.resume.ssim, True


def _together(psnr_db: list[float]) -> float:
    """The PSNR of clips together: of their mean squared error, each taken back from its PSNR (peak 1)."""
    return round(psnr_from_mse(_mean([10 ** (-value / 10) for value in psnr_db])), 2)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)

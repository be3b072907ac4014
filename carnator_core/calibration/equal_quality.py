"""Is reuse worth it on this model, told from the pairs alone: each resuming mode weighed against plain sampling at
fewer steps by the one yardstick (`judging.yardstick`), each pair weighed as a two-prompt stream.

Per pair weighed (the held-back ones, which the fit never saw; every pair where none is held back) the stream is the
earlier prompt, sampled plain (nothing is stored before it: every configuration costs it its plain calls; at fewer
steps it is taken to lose what the new prompt's run at as many steps loses, since only the new prompt is sampled
there), then the new prompt. In a mode at the workflow's steps the new prompt resumes at the deepest measured depth
within the mode's limit (`RESUME_LIMITS`) that the rule judging it (the profile's where it is in force, else the
shipped one) accepts, as the engine resumes at the deepest checkpoint its probes pass: it costs that forced resume's
model calls and its clip is that resume's. A request the rule resumes nowhere costs the plain run's calls and one
probe call (a miss costs at most one) and its clip is the plain one.

Plain at fewer steps runs at the counts the plain-steps curve bisects to (`judging.plain_steps_curve`), as a stream
calibration's does; at the knee of that curve each mode runs the new prompt through the engine (`KneeRun`, judged
as the engine judges that step count), its earlier prompt taken at the knee's plain run. The recommendation
(`judging.recommendation`) is the cheapest of plain at each measured count and the modes at both step counts that is
as good as full plain, over the same two-prompt streams.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from carnator_core.calibration.fit import accepts, held_back
from carnator_core.calibration.session import KneeRun, Measured, PlainRun
from carnator_core.judging.calibration_profile import WEIGHED_MODES, FewerStepsRun, ModeVerdict
from carnator_core.judging.probe_thresholds import ProbeThresholds
from carnator_core.judging.quality import mse_from_psnr
from carnator_core.judging.recommendation import Recommendation, as_good_as_full, knee, recommend
from carnator_core.judging.yardstick import RequestOutcome, StreamQuality, curve_row, equal_quality, falls_short
from carnator_core.reuse.settings import RESUME_LIMITS

MISS_PROBE_CALLS = 1  # what a request that resumes nowhere spends beyond the plain run: one probe call


class PairsWeighing:
    """The pairs as two-prompt streams: their plain runs at every measured count, each mode at the workflow's steps
    and at the knee, the judges that bisect the plain-steps curve, and the verdicts."""

    def __init__(self, measured: Sequence[Measured], plain_runs: Sequence[PlainRun], thresholds: ProbeThresholds,
                 steps: int, knee_runs: Sequence[KneeRun] = ()) -> None:
        self.steps = steps
        self.counts = sorted({r.steps for r in plain_runs if r.steps != steps}, reverse=True)
        self._by_pair = {(r.pair, r.steps): r for r in plain_runs}
        complete = sorted({r.pair for r in plain_runs
                           if all((r.pair, n) in self._by_pair for n in (steps, *self.counts))})
        kept_back = [pair for pair in complete if held_back(pair)]
        self.held_back = bool(kept_back)
        self.pairs = kept_back or complete
        donors = [_identical(self._by_pair[p, steps]) for p in self.pairs]
        self.plain = [*donors, *donors]
        # at fewer steps the earlier prompt is taken to lose what the new one does: both at the new prompt's run
        self.lowered = {n: [_outcome(self._by_pair[p, n]) for p in self.pairs] * 2 for n in self.counts}
        self.requests = {mode: [_request(mode, [m for m in measured if m.resume.pair == pair],
                                         self._by_pair[pair, steps], thresholds) for pair in self.pairs]
                         for mode in WEIGHED_MODES}
        self.modes = {(steps, mode): [*donors, *(outcome for outcome, _, _ in self.requests[mode])]
                      for mode in WEIGHED_MODES}
        for count in {r.steps for r in knee_runs} & set(self.counts):
            runs = {(r.pair, r.mode): r for r in knee_runs if r.steps == count}
            for mode in WEIGHED_MODES:
                if all((p, mode) in runs for p in self.pairs):
                    self.modes[count, mode] = [*self.lowered[count][:len(self.pairs)],
                                               *(runs[p, mode].outcome() for p in self.pairs)]

    def judges(self) -> list[Callable[[int], bool]]:
        """Whether plain at n steps is as good as each mode at the workflow's steps, and as full plain (the knee)."""
        def as_good_as(mode: str) -> Callable[[int], bool]:
            return lambda n: falls_short(self.lowered[n], self.modes[self.steps, mode], self.plain) is None
        return [*(as_good_as(mode) for mode in WEIGHED_MODES), lambda n: as_good_as_full(self.lowered[n], self.plain)]

    def knee(self) -> int:
        """The fewest measured plain steps as good as full plain (the workflow's steps where none fewer is)."""
        return knee(self.plain, self.lowered, self.steps) if self.pairs else self.steps

    def curve(self) -> list[dict]:
        """Every plain run weighed against, fewest steps first: its calls and the yardstick's measures."""
        runs = {**self.lowered, self.steps: self.plain}
        return [curve_row(n, runs[n]) for n in sorted(runs)]

    def quality(self, steps: int, mode: str) -> StreamQuality:
        return StreamQuality.of(self.modes[steps, mode])

    def weigh(self) -> tuple[dict[str, FewerStepsRun], dict[str, ModeVerdict], Recommendation | None]:
        """The fewer-steps runs by name, the verdict per weighed mode and the recommendation; empty (and None) where
        no pair has every plain run measured or none was run at fewer steps."""
        if not self.pairs or not self.counts:
            return {}, {}, None
        fewer = {f"plain-{n}": fewer_steps_run(n, self.lowered[n], [self._by_pair[p, n].ssim for p in self.pairs])
                 for n in self.counts}
        verdicts = {}
        for mode in WEIGHED_MODES:
            runs, requests = self.modes[self.steps, mode], self.requests[mode]
            weighed = equal_quality(runs, self.plain, self.lowered, self.steps)
            quality = StreamQuality.of(runs)
            verdicts[mode] = ModeVerdict(
                model_calls=round(weighed.model_calls, 2), psnr_db=round(quality.psnr_db, 2),
                ssim=round(statistics.median(similarity for _, similarity, _ in requests), 4),
                resumed=sum(resumed for _, _, resumed in requests), pairs=len(self.pairs), held_back=self.held_back,
                steps=self.steps, against=weighed.against, against_calls=round(weighed.against_calls, 2),
                calls=round(weighed.calls, 3), interval=weighed.rounded_interval(), decided_by=weighed.decided_by,
                steps_short=weighed.steps_short, weighed_on="pairs", detail=round(quality.detail, 4))
        return fewer, verdicts, recommend(self.plain, self.lowered, self.modes, self.steps)


def weigh(measured: Sequence[Measured], plain_runs: Sequence[PlainRun], thresholds: ProbeThresholds, steps: int,
          knee_runs: Sequence[KneeRun] = ()) -> tuple[dict[str, FewerStepsRun], dict[str, ModeVerdict],
                                                      Recommendation | None]:
    """`PairsWeighing.weigh` of these runs."""
    return PairsWeighing(measured, plain_runs, thresholds, steps, knee_runs).weigh()


def _request(mode: str, resumes: list[Measured], plain: PlainRun,
             thresholds: ProbeThresholds) -> tuple[RequestOutcome, float, bool]:
    """One pair's new prompt in `mode`: its outcome, its SSIM against plain, and whether it resumed."""
    within = [m for m in resumes if m.resume.depth <= RESUME_LIMITS[mode] + 1e-9 and m.model_calls is not None]
    taken = [m for m in within if accepts(thresholds, m.resume)]
    if not taken:
        calls = plain.model_calls + (MISS_PROBE_CALLS if within else 0)
        return (RequestOutcome(model_calls=calls, mse=0.0, detail=1.0, adherence=plain.adherence), plain.ssim,
                False)
    deepest = max(taken, key=lambda m: m.resume.depth)
    return (RequestOutcome(model_calls=float(deepest.model_calls), mse=mse_from_psnr(deepest.resume.psnr_db),
                           detail=deepest.detail, adherence=deepest.adherence), deepest.resume.ssim, True)


def fewer_steps_run(steps: int, outcomes: list[RequestOutcome], ssims: list[float]) -> FewerStepsRun:
    """Plain at `steps` steps as a profile keeps it: its requests' outcomes together and their median SSIM."""
    quality = StreamQuality.of(outcomes)
    return FewerStepsRun(steps=steps, psnr_db=round(quality.psnr_db, 2), ssim=round(statistics.median(ssims), 4),
                         model_calls=round(quality.model_calls, 2), detail=round(quality.detail, 4))


def _identical(run: PlainRun) -> RequestOutcome:
    """The full-step plain run, against itself."""
    return RequestOutcome(model_calls=run.model_calls, mse=0.0, detail=1.0, adherence=run.adherence)


def _outcome(run: PlainRun) -> RequestOutcome:
    return RequestOutcome(model_calls=run.model_calls, mse=mse_from_psnr(run.psnr_db), detail=run.detail,
                          adherence=run.adherence)

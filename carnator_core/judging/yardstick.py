"""The one yardstick of "is reuse worth it": a configuration's requests weighed against plain sampling at fewer steps,
as `bench workload` and the calibration both weigh them.

Equal quality means all three, each against the request's own full-step plain render:
- as adherent (the demo world's oracle, where it scores the prompts; within `ADHERENCE_TOLERANCE`);
- as close by PSNR (the requests' clips together: the PSNR of their mean squared error);
- as detailed (the mean detail ratio, `judging.quality.detail_ratio`, within `DETAIL_TOLERANCE`): fewer steps lose fine
  detail, a resume keeps the full-step detail of its own schedule, and PSNR to plain alone cannot tell a blur from a
  different valid render.
A configuration's adherence and detail count up to the full render's own (`quality_bar`): no plain run is asked to beat
the full-step render it converges to.

A configuration's equal-quality ratio is the mean model calls of the cheapest plain run that is as good (full plain
always is) over its own. Its interval is a seeded percentile bootstrap over the requests, every run's outcome on a
request drawn together, so that the choice of the plain run as good is redrawn with them. The words say "not settled"
exactly when the interval holds 1 (`judging.ratio_interval.ratio_words`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from carnator_core.judging.quality import psnr_from_mse
from carnator_core.judging.ratio_interval import ratio_words

ADHERENCE_TOLERANCE = 0.005  # how much less adherence still counts as the same
DETAIL_TOLERANCE = 0.05  # how much less detail (a ratio to the full render's) still counts as the same: about what a
# stream's mean detail of equally valid full-step renders spreads (docs/measurements.md)
INTERVAL_LEVEL = 0.9
RESAMPLES = 2000
FULL = "plain"  # the full-step plain run, as good as itself


@dataclass(frozen=True)
class RequestOutcome:
    """One request in one configuration, against the same prompt's full-step plain render."""

    model_calls: float
    mse: float  # mean squared error to the plain clip (values in [0, 1]; 0 where identical)
    detail: float  # detail ratio to the plain clip (1: as detailed)
    adherence: float | None = None  # the oracle's share of the prompt kept; None where it scores none


@dataclass(frozen=True)
class StreamQuality:
    """Requests together: mean model calls, the PSNR of their clips together, mean detail ratio, mean adherence."""

    model_calls: float
    psnr_db: float
    detail: float
    adherence: float | None

    @classmethod
    def of(cls, outcomes: Sequence[RequestOutcome]) -> StreamQuality:
        scored = [o.adherence for o in outcomes if o.adherence is not None]
        return cls(model_calls=_mean([o.model_calls for o in outcomes]),
                   psnr_db=psnr_from_mse(_mean([o.mse for o in outcomes])),
                   detail=_mean([o.detail for o in outcomes]),
                   adherence=_mean(scored) if scored else None)


def curve_row(steps: int, outcomes: Sequence[RequestOutcome]) -> dict:
    """Plain at `steps` steps as the plain-steps curve shows it: its calls and the three measures, rounded."""
    quality = StreamQuality.of(outcomes)
    return {"steps": steps, "model_calls": round(quality.model_calls, 2), "psnr": round(quality.psnr_db, 2),
            "detail": round(quality.detail, 4),
            "adherence": None if quality.adherence is None else round(quality.adherence, 3)}


def quality_bar(mode: StreamQuality, full: StreamQuality) -> StreamQuality:
    """What a plain run must reach to be as good as `mode`: its PSNR, and its adherence and detail up to the full
    render's own (a resume that keeps a donor's right attribute, or renders sharper, asks no plain run to beat the
    full-step render plain runs converge to)."""
    adherence = mode.adherence if mode.adherence is None or full.adherence is None else \
        min(mode.adherence, full.adherence)
    return StreamQuality(model_calls=mode.model_calls, psnr_db=mode.psnr_db, detail=min(mode.detail, full.detail),
                         adherence=adherence)


def short_of(candidate: StreamQuality, target: StreamQuality) -> str | None:
    """The first measure on which `candidate` falls short of `target` (`quality_bar`): adherence, PSNR or detail; None
    where it is as good on all three."""
    if candidate.adherence is not None and target.adherence is not None \
            and candidate.adherence < target.adherence - ADHERENCE_TOLERANCE:
        return "adherence"
    if candidate.psnr_db < target.psnr_db:
        return "PSNR"
    if candidate.detail < target.detail - DETAIL_TOLERANCE:
        return "detail"
    return None


def falls_short(candidate: Sequence[RequestOutcome], runs: Sequence[RequestOutcome],
                plain: Sequence[RequestOutcome]) -> str | None:
    """Where the plain run `candidate` falls short of the configuration's `runs` (`quality_bar`, `plain` the full
    render's): the measure, or None where it is as good."""
    return short_of(StreamQuality.of(candidate), quality_bar(StreamQuality.of(runs), StreamQuality.of(plain)))


@dataclass(frozen=True)
class EqualQuality:
    """A configuration against the cheapest plain run as good: that run (`against`: `plain` or `plain-<n>`), the
    ratio of its calls over the configuration's, the ratio's interval, the measure that kept the next cheaper plain
    run out (`decided_by`; None where the cheapest measured one is as good) and the steps plain needs: between
    `steps_short` (the most steps measured that fall short; None where none does) and `steps_needed`."""

    against: str
    against_calls: float
    model_calls: float
    calls: float
    interval: tuple[float, float]
    requests: int
    decided_by: str | None
    steps_needed: int
    steps_short: int | None

    def words(self) -> str:
        return ratio_words(self.calls, self.interval, self.requests)

    def rounded_interval(self) -> tuple[float, float]:
        return round(self.interval[0], 3), round(self.interval[1], 3)

    def as_dict(self) -> dict:
        return {"against": self.against, "against_calls": round(self.against_calls, 2),
                "model_calls": round(self.model_calls, 2), "calls": round(self.calls, 3),
                "interval": list(self.rounded_interval()), "requests": self.requests,
                "decided_by": self.decided_by, "steps_needed": self.steps_needed, "steps_short": self.steps_short,
                "words": self.words()}


def equal_quality(runs: Sequence[RequestOutcome], plain: Sequence[RequestOutcome],
                  fewer: Mapping[int, Sequence[RequestOutcome]], steps: int, seed: int = 0) -> EqualQuality:
    """`runs` (a configuration's requests) against full `plain` and the plain runs at fewer steps (`fewer`, by step
    count), every sequence over the same requests in the same order."""
    count = len(runs)
    if not count or len(plain) != count or any(len(outcomes) != count for outcomes in fewer.values()):
        raise ValueError("the yardstick needs the same, non-zero number of requests in every run")
    against, calls, decided_by = _cheapest_as_good(runs, plain, fewer, range(count))
    rng = random.Random(seed)
    ratios = sorted(_cheapest_as_good(runs, plain, fewer, [rng.randrange(count) for _ in range(count)])[1]
                    for _ in range(RESAMPLES))
    tail = (1.0 - INTERVAL_LEVEL) / 2.0
    interval = ratios[int(tail * RESAMPLES)], ratios[min(RESAMPLES - 1, int((1.0 - tail) * RESAMPLES))]
    mode = StreamQuality.of(runs)
    needed = steps if against == FULL else int(against.removeprefix("plain-"))
    short = [n for n in fewer if n < needed and falls_short(fewer[n], runs, plain) is not None]
    return EqualQuality(against=against, against_calls=calls * mode.model_calls, model_calls=mode.model_calls,
                        calls=calls, interval=interval, requests=count, decided_by=decided_by, steps_needed=needed,
                        steps_short=max(short) if short else None)


def _cheapest_as_good(runs: Sequence[RequestOutcome], plain: Sequence[RequestOutcome],
                      fewer: Mapping[int, Sequence[RequestOutcome]],
                      picks: Sequence[int]) -> tuple[str, float, str | None]:
    """Over the requests `picks`: the cheapest plain run as good as `runs`, its calls over theirs, and the measure on
    which the next cheaper plain run fell short."""
    mode = StreamQuality.of([runs[i] for i in picks])
    full = StreamQuality.of([plain[i] for i in picks])
    target = quality_bar(mode, full)
    candidates = sorted(((StreamQuality.of([outcomes[i] for i in picks]), f"plain-{n}") for n, outcomes in fewer.items()),
                        key=lambda item: item[0].model_calls)
    decided_by = None
    for quality, name in candidates:
        if quality.model_calls >= full.model_calls:
            break
        missing = short_of(quality, target)
        if missing is None:
            return name, quality.model_calls / mode.model_calls, decided_by
        decided_by = missing
    return FULL, full.model_calls / mode.model_calls, decided_by


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)

"""What to run: the cheapest configuration (step count and mode, plain included) as good as the full-step plain render,
weighed by the one yardstick (`judging.yardstick`) against the cheapest plain run as good as it.

People choose their step count, so "does reuse save?" is the wrong question at a step count more than the quality
needs. A run is **as good as full plain** when, against each request's own full-step plain render and over the
requests together, it is as adherent (the demo oracle, within `ADHERENCE_TOLERANCE`) and as detailed (within
`DETAIL_TOLERANCE`): what makes a render right and sharp. Closeness to plain by PSNR is not asked of it, since a resume
that keeps a donor's composition is an equally valid render far from plain's by PSNR; it is asked where a plain run is
weighed against the configuration (`equal_quality`). The **knee** of the plain-steps curve is the fewest measured plain
steps as good as full plain. Each reuse mode is weighed at the workflow's steps and at the knee; the recommendation is
the cheapest as-good configuration by mean model calls (plain where no mode is cheaper), with its ratio to the
cheapest plain run as good as it by the yardstick and the ratio's interval.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from carnator_core.judging.ratio_interval import ratio_words
from carnator_core.judging.yardstick import (
    ADHERENCE_TOLERANCE,
    DETAIL_TOLERANCE,
    FULL,
    RequestOutcome,
    StreamQuality,
    equal_quality,
)

PLAIN = "plain"


def as_good_as_full(outcomes: Sequence[RequestOutcome], full: Sequence[RequestOutcome]) -> bool:
    """Whether `outcomes` are as good as the full-step plain renders `full` (the module's rule)."""
    run, reference = StreamQuality.of(outcomes), StreamQuality.of(full)
    if run.adherence is not None and reference.adherence is not None \
            and run.adherence < reference.adherence - ADHERENCE_TOLERANCE:
        return False
    return run.detail >= reference.detail - DETAIL_TOLERANCE


def knee(full: Sequence[RequestOutcome], fewer: Mapping[int, Sequence[RequestOutcome]], steps: int) -> int:
    """The fewest measured plain steps as good as full plain (`steps` where no fewer count is)."""
    return min((n for n, outcomes in fewer.items() if n < steps and as_good_as_full(outcomes, full)), default=steps)


@dataclass(frozen=True)
class Recommendation:
    """The configuration to run: `steps` in `mode` (PLAIN: plain sampling), its mean model calls, and the cheapest
    plain run as good as it (`against`, its steps `against_steps`) with the calls ratio and its interval."""

    steps: int
    mode: str
    model_calls: float
    full_steps: int
    against: str
    against_steps: int
    calls: float
    interval: tuple[float, float]
    requests: int

    def words(self) -> str:
        if self.mode == PLAIN:
            lower = "" if self.steps == self.full_steps else f" (as good as plain at {self.full_steps})"
            return f"run plain at {self.steps} steps{lower}: no reuse mode is as good for fewer model calls here"
        verdict = ratio_words(self.calls, self.interval, self.requests)
        joined = f" it {verdict}" if self.interval[0] > 1.0 else f": {verdict}"  # "it saves 1.6x", ": not settled"
        return (f"run {self.steps} steps in {self.mode}: as good as plain at {self.full_steps}; against plain at "
                f"{self.against_steps} by model calls{joined}")

    def as_dict(self) -> dict:
        return {"steps": self.steps, "mode": self.mode, "calls": round(self.calls, 3),
                "model_calls": round(self.model_calls, 2), "interval": [round(v, 3) for v in self.interval],
                "against": self.against, "against_steps": self.against_steps, "full_steps": self.full_steps,
                "requests": self.requests, "words": self.words()}


def recommend(full: Sequence[RequestOutcome], fewer: Mapping[int, Sequence[RequestOutcome]],
              modes: Mapping[tuple[int, str], Sequence[RequestOutcome]], steps: int) -> Recommendation:
    """The cheapest of plain (at `steps` and at each count of `fewer`) and of the `modes` runs (by (steps, mode)) that
    is as good as full plain, weighed against the cheapest plain run as good as it. Every sequence is over the same
    requests in the same order."""
    candidates = [(StreamQuality.of(full).model_calls, steps, PLAIN, full)]
    candidates += [(StreamQuality.of(o).model_calls, n, PLAIN, o) for n, o in fewer.items() if n < steps]
    candidates += [(StreamQuality.of(o).model_calls, n, mode, o) for (n, mode), o in modes.items()]
    good = [c for c in candidates if c[3] is full or as_good_as_full(c[3], full)]
    calls, run_steps, mode, outcomes = min(good, key=lambda c: (c[0], c[2] != PLAIN, c[1]))
    if mode == PLAIN:
        return Recommendation(steps=run_steps, mode=PLAIN, model_calls=calls, full_steps=steps,
                              against=PLAIN if run_steps == steps else f"plain-{run_steps}", against_steps=run_steps,
                              calls=1.0, interval=(1.0, 1.0), requests=len(full))
    weighed = equal_quality(outcomes, full, fewer, steps)
    against_steps = steps if weighed.against == FULL else int(weighed.against.removeprefix("plain-"))
    return Recommendation(steps=run_steps, mode=mode, model_calls=weighed.model_calls, full_steps=steps,
                          against=weighed.against, against_steps=against_steps, calls=weighed.calls,
                          interval=weighed.interval, requests=weighed.requests)

"""Where a donor's state at σ enters another run's schedule (`carnator_core.lookup.noise_process`: which donors share
the request's noise process)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from carnator_core.reuse.cached_evaluation import same_sigma


@dataclass(frozen=True)
class ResumePoint:
    """Where a donor state at `sigma` enters a request's schedule: at request step `step`, whose sigma it takes
    (`exact`: the request's own sigma there is the donor's)."""

    step: int
    sigma: float
    exact: bool


def resume_point(sigmas: Sequence[float], sigma: float) -> ResumePoint | None:
    """The request step a donor state at `sigma` resumes at: the step whose sigma it equals, else the last step above
    it, whose place it takes (the run then goes on with the request's sigmas below `sigma`, so it makes as many model
    calls as a resume at that step). None where the schedule does not reach `sigma` (it starts below it, or ends
    above it) or the resume would save no step (step 0), or the schedule is not strictly decreasing there."""
    for index, value in enumerate(sigmas):
        if same_sigma(value, sigma):
            return ResumePoint(index, value, True) if 0 < index < len(sigmas) - 1 else None
        if value < sigma:
            if index < 2 or not sigmas[index - 1] > sigma:
                return None
            return ResumePoint(index - 1, sigma, False)
    return None


def resumed_schedule(sigmas: Sequence[float], point: ResumePoint) -> list[float]:
    """The request's schedule with the resume's sigma in its step's place."""
    return [*sigmas[:point.step], point.sigma, *sigmas[point.step + 1:]]

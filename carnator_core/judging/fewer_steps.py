"""Plain sampling at fewer steps: the cheapest alternative to reuse, and the yardstick both the workload benchmark
and the calibration weigh reuse against.

A fewer-steps run is the same graph (same seed, sampler and scheduler) with its steps lowered, named
`plain-<its steps>`: at 1/2, 1/3 and 1/4 of them in the workload's timed rows, at bisected counts on the plain-steps
curve (`judging.plain_steps_curve`) of the workload and both calibrations. A configuration or a mode is weighed against the
cheapest of them as good as its own by the yardstick (`judging.yardstick`); the ratio of that run's calls over the
configuration's is below 1 where just taking fewer steps gets as good for less.

Here, below the benchmarks and calibration, because the calibration profile's checks read these names too.
"""

from __future__ import annotations

import re

FEWER_STEPS_DIVISORS = (2, 3, 4)
FEWER_STEPS_NAME = re.compile(r"plain-(\d+)")


def fewer_steps(steps: int, fewest: int = 1) -> tuple[list[str], list[str]]:
    """The plain-at-fewer-steps runs of a `steps`-step graph, and a line for each fraction that has none: fewer than
    `fewest` steps, or a step count a larger fraction already runs."""
    names: list[str] = []
    skipped: list[str] = []
    for divisor in FEWER_STEPS_DIVISORS:
        count = steps // divisor
        name = f"plain-{count}"
        if count < fewest:
            least = "" if fewest <= 1 else f", fewer than {fewest}"
            skipped.append(f"plain at 1/{divisor} of {steps} steps skipped: that is {step_count(count)}{least}")
        elif name in names:
            skipped.append(f"plain at 1/{divisor} of {steps} steps skipped: {step_count(count)}, as {name} "
                           "already runs")
        else:
            names.append(name)
    return names, skipped


def step_count(count: int) -> str:
    return f"{count} step" if count == 1 else f"{count} steps"


def fewer_steps_count(name: str) -> int | None:
    """The steps of a plain-at-fewer-steps run (`plain-<steps>`); None for every other name."""
    match = FEWER_STEPS_NAME.fullmatch(name)
    return int(match.group(1)) if match else None

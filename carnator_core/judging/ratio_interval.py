"""How sure a ratio over paired requests is: a percentile bootstrap over the requests, and the words that say it.

Why: a speedup measured on one run is a ratio of two medians over a handful of requests, and one request's spread can
move it by more than the effect measured; the interval shows how far.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence


def median_ratio_interval(baseline: Sequence[float], other: Sequence[float], level: float = 0.9,
                          resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The `level` interval of median(baseline) / median(other), resampling the request pairs with replacement.
    Seeded, so the same requests always give the same interval (a generated table must not change on its own)."""
    if len(baseline) != len(other) or not baseline:
        raise ValueError("the ratio's interval needs the same, non-zero number of requests on both sides")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie strictly between 0 and 1, got {level}")
    rng = random.Random(seed)
    count = len(baseline)
    ratios = []
    for _ in range(resamples):
        picks = [rng.randrange(count) for _ in range(count)]
        ratios.append(statistics.median(baseline[i] for i in picks) / statistics.median(other[i] for i in picks))
    ratios.sort()
    tail = (1.0 - level) / 2.0
    return ratios[int(tail * resamples)], ratios[min(resamples - 1, int((1.0 - tail) * resamples))]


def settled(interval: tuple[float, float]) -> bool:
    """Whether an interval of a speedup says which side of 1 it lies on."""
    return interval[0] > 1.0 or interval[1] < 1.0


def ratio_words(ratio: float, interval: tuple[float, float], requests: int) -> str:
    """A speedup over lowering the steps in words: "saves 1.30x (1.10–1.50x)", "lower the steps instead (0.60x,
    0.50–0.70x)", or "not settled (0.80–1.20x)" with about how many more prompts would settle it (or a tie, where the
    interval is the point 1), exactly when the interval holds 1."""
    low, high = interval
    if low > 1.0:
        return f"saves {ratio:.2f}x ({low:.2f}–{high:.2f}x)"
    if high < 1.0:
        return f"lower the steps instead ({ratio:.2f}x, {low:.2f}–{high:.2f}x)"
    if high - low < 0.005:  # every resample the same: the configuration ran the plain run's calls on every request
        return f"not settled: a tie ({ratio:.2f}x), the calls of the plain run as good on every request"
    return f"not settled ({low:.2f}–{high:.2f}x): {_more_to_settle(ratio, interval, requests)}"


def _more_to_settle(ratio: float, interval: tuple[float, float], requests: int) -> str:
    """The interval narrows as one over the root of the requests' count: about how many more would keep 1 out."""
    half_width = (interval[1] - interval[0]) / 2
    distance = abs(ratio - 1.0)
    if distance < 0.01 or half_width <= 0:
        return "the ratio sits at 1.00x, so no number of prompts can be told to settle it"
    more = max(1, math.ceil(requests * (half_width / distance) ** 2) - requests)
    return f"about {more} more prompt{'' if more == 1 else 's'} would settle it"

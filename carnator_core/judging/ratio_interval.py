"""How sure a ratio of medians over paired requests is: a percentile bootstrap over the requests.

Why: a speedup measured on one run is a ratio of two medians over a handful of requests, and one request's spread can
move it by more than the effect measured; the interval shows how far.
"""

from __future__ import annotations

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

"""The plain-steps curve a configuration really crosses: plain sampled at step counts chosen by bisection, so that
for each configuration weighed the steps plain needs to be as good (`judging.yardstick`) are bracketed between a count
that falls short and one that is as good, up to the full steps; so is the knee (the fewest plain steps as good as full
plain, `judging.recommendation`), where the modes are weighed again.

Each new count refines the widest bracket of any configuration (the first measured is half the steps), and costs one
plain run per request; `MAX_LOWERED_COUNTS` bounds them, so a stream calibration costs at most that many plain runs
per prompt beside the full one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

MAX_LOWERED_COUNTS = 4


def bracket(steps: int, measured: Iterable[int], as_good: Callable[[int], bool], fewest: int = 1) -> tuple[int, int]:
    """(the most steps measured that fall short, below the fewest as good; `fewest` - 1 where none does; the fewest
    measured steps as good, or the full `steps`)."""
    counts = sorted(set(measured))
    enough = min((n for n in counts if as_good(n)), default=steps)
    short = max((n for n in counts if n < enough and not as_good(n)), default=fewest - 1)
    return short, enough


def next_count(steps: int, measured: Iterable[int], as_good: Iterable[Callable[[int], bool]],
               fewest: int = 1) -> int | None:
    """The next step count to sample plain at: the middle of the widest bracket still holding an unmeasured count;
    None where every bracket is closed."""
    counts = set(measured)
    widest: tuple[int, int] | None = None
    for judge in as_good:
        short, enough = bracket(steps, counts, judge, fewest)
        middle = (short + enough) // 2
        if middle > short and middle not in counts and (widest is None or enough - short > widest[1] - widest[0]):
            widest = short, enough
    return None if widest is None else sum(widest) // 2

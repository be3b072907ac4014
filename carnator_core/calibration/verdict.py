"""Whether a fitted profile is put in force: its held-back pairs decide, so a calibration never makes reuse less safe.

A profile judges runs only where its precision on the held-back pairs (resumes the fit never saw) meets the target and
is not below the shipped rule's on the same resumes; otherwise it is filed not in force and the shipped thresholds
keep judging. The one line that says so ends with an estimate of how many pairs would settle it.
"""

from __future__ import annotations

from dataclasses import dataclass

from carnator_core.calibration.fit import HELD_BACK_EVERY, Fit
from carnator_core.judging.calibration_profile import FORCED_NOTE
from carnator_core.judging.quality_target import QualityTarget


@dataclass(frozen=True)
class Verdict:
    in_force: bool
    reason: str  # one line
    forced: bool = False


def verdict(result: Fit, target: QualityTarget, pairs_used: int, force: bool = False) -> Verdict:
    """In force or not, and why; `force` puts a profile the held-back pairs do not support in force anyway."""
    supported, why = _held_back_support(result, target)
    if supported:
        return Verdict(True, f"in force: {why}")
    reason = f"not in force: {why}; {settle(result, pairs_used)}"
    if force:
        return Verdict(True, f"{FORCED_NOTE} (--force); held back: {why}", forced=True)
    return Verdict(False, reason)


def pairs_line(result: Fit, pairs_used: int) -> str:
    needed = "cannot be told here (no good resume passes the shipped rule, or the target precision is 1)" \
        if result.pairs_needed is None \
        else f"needs about {result.pairs_needed}"
    return f"pairs used {pairs_used}; a stable fit here {needed}"


def settle(result: Fit, pairs_used: int) -> str:
    """About how many more pairs would settle whether the profile holds."""
    if result.pairs_needed is None:
        return "no count of pairs can be told to settle it (no good resume passes the shipped rule here, or the " \
               "target precision is 1)"
    more = result.pairs_needed - pairs_used
    if more > 0:
        return f"about {more} more pairs ({result.pairs_needed} in all) would settle it"
    return f"the {pairs_used} pairs are as many as a stable fit needs here: the held-back resumes disagree with the fit"


def _held_back_support(result: Fit, target: QualityTarget) -> tuple[bool, str]:
    held, shipped = result.held_back, result.shipped_held_back
    shipped_precision = None if shipped is None else shipped.precision
    if result.held_back_pairs == 0:
        return False, f"no pair was held back (every {_ordinal(HELD_BACK_EVERY)} pair is; at least " \
                      f"{HELD_BACK_EVERY} distinct pairs are needed)"
    if held.precision is None:
        if not result.met_target and shipped_precision is not None and shipped_precision < target.precision:
            return True, f"no rule keeps the target here and the shipped rule's held-back precision is " \
                         f"{shipped_precision:.2f}: this profile resumes nothing"
        return False, f"the fitted rule accepted none of the {result.held_back_pairs} held-back pairs' resumes, so " \
                      "nothing shows its precision"
    counts = f"{round(held.precision * held.accepted)} of {held.accepted} accepted resumes good"
    if held.precision < target.precision:
        return False, f"held-back precision {held.precision:.2f} ({counts}) is below the target {target.precision:.2f}"
    if shipped_precision is not None and held.precision < shipped_precision - 1e-12:
        return False, f"held-back precision {held.precision:.2f} ({counts}) is below the shipped rule's " \
                      f"{shipped_precision:.2f} on the same resumes"
    versus = "" if shipped_precision is None else f", the shipped rule's {shipped_precision:.2f}"
    return True, f"held-back precision {held.precision:.2f} ({counts}) meets the target {target.precision:.2f}{versus}"


def _ordinal(n: int) -> str:
    return {2: "second", 3: "third", 4: "fourth"}.get(n, f"{n}th")

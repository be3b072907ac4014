"""Fitting probe thresholds to forced resumes: the rule that accepts the most good resumes at the target precision.

Each `Resume` is one forced resume of a calibration pair: the signals the engine judged it on (the step-0 screen
and the probe at the resume depth) and how close its clip came to the new prompt's plain clip. A rule
(`ProbeThresholds`) accepts a resume when the screen passes at depth 0 and the probe at its depth, as the engine
decides for a same-noise donor. The fit searches a grid of structure and guidance thresholds and a shared depth
slope and takes, of the admissible rules, the one with the highest recall (ties: the shipped rule where it is among
them, else the strictest).

Why a margin: a rule picked for its precision on a few dozen resumes is picked partly for luck, so a rule may loosen
the shipped one only where a one-sided Clopper-Pearson lower bound (`CONFIDENCE`) on its precision over the fitted
resumes meets the target. Where no rule shows that, the admissible rules are those at least as strict as the shipped
one in every threshold whose observed precision meets the target: the user's target can tighten the shipped rule
without a margin, never loosen it. Pairs are split into fitted and held back, so the precision and recall the profile
reports are measured on pairs the fit never saw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from carnator_core.judging.calibration_profile import Score
from carnator_core.judging.probe_thresholds import ProbeThresholds
from carnator_core.judging.quality_target import QualityTarget

STRUCTURE_GRID = np.round(np.arange(0.50, 1.0001, 0.005), 4)
GUIDANCE_GRID = np.round(np.arange(0.0, 1.0001, 0.02), 4)
SLOPE_GRID = np.round(np.arange(0.0, 0.3001, 0.03), 4)
HELD_BACK_EVERY = 3  # every third pair is held back from the fit
CONFIDENCE = 0.95  # of the one-sided lower bound a looser rule's precision must show


@dataclass(frozen=True)
class Resume:
    """One forced resume of a calibration pair and its quality against the new prompt's plain clip."""

    pair: int
    depth: float
    screen_structure: float | None  # None: the donor was not screened (not the request's initial noise)
    screen_guidance: float | None
    structure: float
    guidance: float | None
    psnr_db: float
    ssim: float
    oracle_kept: bool | None = None  # kept the plain run's oracle adherence (demo model only)


@dataclass(frozen=True)
class Fit:
    thresholds: ProbeThresholds
    fitted: Score
    held_back: Score
    oracle: Score | None
    fit_pairs: int
    held_back_pairs: int
    # False when no rule kept the target precision on the fitted pairs: `thresholds` then accept no resume
    met_target: bool = True
    # whether the rule's lower confidence bound on its fitted precision meets the target (else it is no looser than
    # the shipped rule), and that bound (None: it accepts no fitted resume)
    margin_met: bool = False
    lower_bound: float | None = None
    shipped_held_back: Score | None = None  # the shipped rule on the same held-back resumes
    pairs_needed: int | None = None  # about how many pairs a fit with the margin needs here (None: cannot tell)


def held_back(pair: int) -> bool:
    return pair % HELD_BACK_EVERY == HELD_BACK_EVERY - 1


def accepts(thresholds: ProbeThresholds, resume: Resume) -> bool:
    """Whether the engine, judging by `thresholds`, would take this resume."""
    def passes(depth: float, structure: float | None, guidance: float | None) -> bool:
        if structure is not None and not structure >= min(1.0, thresholds.structure + thresholds.structure_slope * depth):
            return False
        return guidance is None or guidance >= min(1.0, thresholds.guidance + thresholds.guidance_slope * depth)
    return passes(0.0, resume.screen_structure, resume.screen_guidance) and \
        passes(resume.depth, resume.structure, resume.guidance)


def score(thresholds: ProbeThresholds, resumes: list[Resume], target: QualityTarget) -> Score:
    return Score.of([accepts(thresholds, r) for r in resumes], [target.good(r.psnr_db, r.ssim) for r in resumes])


def binomial_tail(successes: int, trials: int, p: float) -> float:
    """P(X >= successes) for X ~ Binomial(trials, p)."""
    if successes <= 0:
        return 1.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    return min(1.0, sum(math.exp(math.lgamma(trials + 1) - math.lgamma(j + 1) - math.lgamma(trials - j + 1)
                                 + j * log_p + (trials - j) * log_q) for j in range(successes, trials + 1)))


def precision_lower_bound(good: int, accepted: int, confidence: float = CONFIDENCE) -> float | None:
    """The one-sided Clopper-Pearson lower bound on a precision of `good` of `accepted` (None: nothing accepted):
    the p at which seeing `good` or more would happen only 1 - confidence of the time (bisection on the tail)."""
    if accepted <= 0:
        return None
    if good <= 0:
        return 0.0
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (low, middle) if binomial_tail(good, accepted, middle) > 1.0 - confidence else (middle, high)
    return low


def good_needed(accepted_max: int, precision: float, confidence: float = CONFIDENCE) -> np.ndarray:
    """For every count of accepted resumes n up to `accepted_max`, the fewest good ones whose lower bound reaches
    `precision` (n + 1 where none does): the bound reaches p exactly where seeing that many is unlikely at p."""
    if precision <= 0.0:
        return np.ones(accepted_max + 1, dtype=np.int64)
    needed = np.empty(accepted_max + 1, dtype=np.int64)
    for n in range(accepted_max + 1):
        j = np.arange(n + 1)
        log_pmf = np.array([math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) for k in j]) \
            + j * math.log(precision) + (n - j) * math.log1p(-precision) if precision < 1.0 else None
        tails = np.cumsum(np.exp(log_pmf)[::-1])[::-1] if log_pmf is not None else None
        unlikely = [k for k in range(1, n + 1) if tails is not None and tails[k] <= 1.0 - confidence]
        needed[n] = unlikely[0] if unlikely else n + 1
    return needed


def resumes_for_margin(precision: float, confidence: float = CONFIDENCE) -> int | None:
    """The fewest accepted resumes, all good, whose lower bound reaches `precision` (None: none can)."""
    if precision >= 1.0:
        return None
    return max(1, math.ceil(math.log(1.0 - confidence) / math.log(precision)))


def pairs_needed(resumes: list[Resume], target: QualityTarget) -> int | None:
    """About how many pairs a fit with the margin needs on this model: enough fitted pairs that the shipped rule's
    good accepted resumes per pair (as measured here) add up to `resumes_for_margin`, with every third pair held
    back. None where nothing measured here is a good resume the shipped rule accepts."""
    needed = resumes_for_margin(target.precision)
    pairs = len({r.pair for r in resumes})
    kept = sum(accepts(ProbeThresholds(), r) and target.good(r.psnr_db, r.ssim) for r in resumes)
    if needed is None or not pairs or not kept:
        return None
    return math.ceil(needed / (kept / pairs) * HELD_BACK_EVERY / (HELD_BACK_EVERY - 1))


def fit(resumes: list[Resume], target: QualityTarget) -> Fit:
    """The fitted thresholds, scored on the fitted and the held-back pairs (see the module docstring)."""
    training = [r for r in resumes if not held_back(r.pair)]
    testing = [r for r in resumes if held_back(r.pair)]
    thresholds, met_target, margin_met = _search(training, target)
    oracle_rows = [r for r in testing if r.oracle_kept is not None]
    oracle = Score.of([accepts(thresholds, r) for r in oracle_rows], [bool(r.oracle_kept) for r in oracle_rows]) \
        if oracle_rows else None
    fitted = score(thresholds, training, target)
    return Fit(thresholds=thresholds, fitted=fitted,
               held_back=score(thresholds, testing, target), oracle=oracle,
               fit_pairs=len({r.pair for r in training}), held_back_pairs=len({r.pair for r in testing}),
               met_target=met_target, margin_met=margin_met,
               lower_bound=None if fitted.precision is None else
               precision_lower_bound(round(fitted.precision * fitted.accepted), fitted.accepted),
               shipped_held_back=score(ProbeThresholds(), testing, target),
               pairs_needed=pairs_needed(resumes, target))


def _search(resumes: list[Resume], target: QualityTarget) -> tuple[ProbeThresholds, bool, bool]:
    """The best admissible rule on `resumes`, whether it meets the target (else it is the strictest, accepting
    nothing) and whether it shows the margin (see the module docstring)."""
    shipped = ProbeThresholds()
    if not resumes:
        return shipped, True, False
    depth = np.array([r.depth for r in resumes])[:, None, None, None]
    good = np.array([target.good(r.psnr_db, r.ssim) for r in resumes])[:, None, None, None]
    structure = STRUCTURE_GRID[None, :, None, None]
    guidance = GUIDANCE_GRID[None, None, :, None]
    slope = SLOPE_GRID[None, None, None, :]

    def column(values: list[float | None]) -> np.ndarray:
        return np.array([np.inf if v is None else v for v in values])[:, None, None, None]

    uses_guidance = any(r.guidance is not None or r.screen_guidance is not None for r in resumes)
    accepted = (column([r.screen_structure for r in resumes]) >= structure) \
        & (column([r.structure for r in resumes]) >= np.minimum(1.0, structure + slope * depth)) \
        & (column([r.screen_guidance for r in resumes]) >= guidance) \
        & (column([r.guidance for r in resumes]) >= np.minimum(1.0, guidance + slope * depth))
    accepted_count = accepted.sum(axis=0)
    good_accepted = (accepted & good).sum(axis=0)
    precision = np.where(accepted_count > 0, good_accepted / np.maximum(accepted_count, 1), 0.0)
    with_margin = (accepted_count > 0) & (good_accepted >= good_needed(len(resumes), target.precision)[accepted_count])
    no_looser = (STRUCTURE_GRID >= shipped.structure - 1e-9)[:, None, None] \
        & (GUIDANCE_GRID >= shipped.guidance - 1e-9)[None, :, None] \
        & (SLOPE_GRID >= min(shipped.structure_slope, shipped.guidance_slope) - 1e-9)[None, None, :]
    feasible = with_margin | (no_looser & (accepted_count > 0) & (precision >= target.precision - 1e-12))
    if not uses_guidance:  # runs without CFG: the guidance threshold decides nothing; keep the shipped one
        feasible &= np.isclose(GUIDANCE_GRID, GUIDANCE_GRID[np.abs(GUIDANCE_GRID - shipped.guidance).argmin()]
                               )[None, :, None]
    if not feasible.any():  # nothing good can be accepted at the target: the strictest rule, which accepts nothing
        return ProbeThresholds(structure=1.0, structure_slope=float(SLOPE_GRID[-1]), guidance=1.0,
                               guidance_slope=float(SLOPE_GRID[-1])), False, False
    recall = np.where(feasible, good_accepted, -1)
    best = recall.max()
    candidates = np.argwhere(recall == best)
    as_shipped = (int(np.abs(STRUCTURE_GRID - shipped.structure).argmin()),
                  int(np.abs(GUIDANCE_GRID - shipped.guidance).argmin()),
                  int(np.abs(SLOPE_GRID - shipped.structure_slope).argmin()))
    if recall[as_shipped] == best:  # the data asks for no change: tightening would only cost recall on unseen pairs
        i, j, k = as_shipped
    else:  # the strictest of the best: highest structure, then slope, then guidance threshold
        i, j, k = max(candidates, key=lambda c: (STRUCTURE_GRID[c[0]], SLOPE_GRID[c[2]], GUIDANCE_GRID[c[1]]))
    return ProbeThresholds(structure=float(STRUCTURE_GRID[i]), structure_slope=float(SLOPE_GRID[k]),
                           guidance=float(GUIDANCE_GRID[j]), guidance_slope=float(SLOPE_GRID[k])), True, \
        bool(with_margin[i, j, k])

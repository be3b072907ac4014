"""Fitting probe thresholds to forced resumes: the rule that accepts the most good resumes at the target precision.

Each `Resume` is one forced resume of a calibration pair: the signals the engine judged it on (the step-0 screen
and the probe at the resume depth) and how close its clip came to the new prompt's plain clip. A rule
(`ProbeThresholds`) accepts a resume when the screen passes at depth 0 and the probe at its depth, as the engine
decides for a same-noise donor. The fit searches a grid of structure and guidance thresholds and a shared depth
slope, keeps the rules whose accepted resumes are good at least `target.precision` of the time, and of those takes
the one with the highest recall (ties: the strictest). Pairs are split into fitted and held back, so the precision
and recall the profile reports are measured on pairs the fit never saw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from carnator_core.calibration.profile import QualityTarget, Score
from carnator_core.reuse.probe import ProbeThresholds

STRUCTURE_GRID = np.round(np.arange(0.50, 1.0001, 0.005), 4)
GUIDANCE_GRID = np.round(np.arange(0.0, 1.0001, 0.02), 4)
SLOPE_GRID = np.round(np.arange(0.0, 0.3001, 0.03), 4)
HELD_BACK_EVERY = 3  # every third pair is held back from the fit


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


def fit(resumes: list[Resume], target: QualityTarget) -> Fit:
    """The fitted thresholds, scored on the fitted and the held-back pairs (see the module docstring)."""
    training = [r for r in resumes if not held_back(r.pair)]
    testing = [r for r in resumes if held_back(r.pair)]
    thresholds, met_target = _search(training, target)
    oracle_rows = [r for r in testing if r.oracle_kept is not None]
    oracle = Score.of([accepts(thresholds, r) for r in oracle_rows], [bool(r.oracle_kept) for r in oracle_rows]) \
        if oracle_rows else None
    return Fit(thresholds=thresholds, fitted=score(thresholds, training, target),
               held_back=score(thresholds, testing, target), oracle=oracle,
               fit_pairs=len({r.pair for r in training}), held_back_pairs=len({r.pair for r in testing}),
               met_target=met_target)


def _search(resumes: list[Resume], target: QualityTarget) -> tuple[ProbeThresholds, bool]:
    """The best rule on `resumes` and whether it meets the target (else it is the strictest, accepting nothing)."""
    shipped = ProbeThresholds()
    if not resumes:
        return shipped, True
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
    feasible = (accepted_count > 0) & (precision >= target.precision - 1e-12)
    if not uses_guidance:  # runs without CFG: the guidance threshold decides nothing; keep the shipped one
        feasible &= np.isclose(GUIDANCE_GRID, GUIDANCE_GRID[np.abs(GUIDANCE_GRID - shipped.guidance).argmin()]
                               )[None, :, None]
    if not feasible.any():  # nothing good can be accepted at the target: the strictest rule, which accepts nothing
        return ProbeThresholds(structure=1.0, structure_slope=float(SLOPE_GRID[-1]), guidance=1.0,
                               guidance_slope=float(SLOPE_GRID[-1])), False
    recall = np.where(feasible, good_accepted, -1)
    best = recall.max()
    candidates = np.argwhere(recall == best)
    # the strictest of the best: highest structure, then slope, then guidance threshold
    i, j, k = max(candidates, key=lambda c: (STRUCTURE_GRID[c[0]], SLOPE_GRID[c[2]], GUIDANCE_GRID[c[1]]))
    return ProbeThresholds(structure=float(STRUCTURE_GRID[i]), structure_slope=float(SLOPE_GRID[k]),
                           guidance=float(GUIDANCE_GRID[j]), guidance_slope=float(SLOPE_GRID[k])), True

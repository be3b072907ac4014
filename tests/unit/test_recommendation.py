"""The recommendation: the cheapest configuration (steps and mode, plain included) as good as full plain, weighed
against the cheapest plain run as good as it."""

from __future__ import annotations

from carnator_core.judging.recommendation import PLAIN, knee, recommend
from carnator_core.judging.yardstick import RequestOutcome

REQUESTS = 8


def _runs(calls: float, psnr_mse: float, detail: float, adherence: float = 1.0) -> list[RequestOutcome]:
    return [RequestOutcome(model_calls=calls + (i % 2), mse=psnr_mse, detail=detail, adherence=adherence)
            for i in range(REQUESTS)]


FULL = _runs(30, 0.0, 1.0)
FEWER = {15: _runs(15, 1e-2, 0.85, 0.9), 22: _runs(22, 4e-3, 0.97, 0.99), 26: _runs(26, 1e-4, 0.99)}


def test_the_knee_is_the_fewest_plain_steps_as_adherent_and_as_detailed_as_full_plain():
    assert knee(FULL, FEWER, 30) == 26
    assert knee(FULL, {15: FEWER[15]}, 30) == 30  # none as good: the full steps


def test_a_mode_cheaper_than_the_knee_is_recommended_with_its_ratio_against_the_plain_run_as_good():
    modes = {(30, "fast"): _runs(16, 2e-3, 1.0), (26, "fast"): _runs(17, 2e-3, 1.0),
             (30, "balanced"): _runs(21, 2e-3, 1.0)}
    chosen = recommend(FULL, FEWER, modes, 30)
    assert (chosen.steps, chosen.mode, chosen.against) == (30, "fast", "plain-26")
    assert abs(chosen.calls - 26.5 / 16.5) < 1e-9 and chosen.interval[0] > 1.0
    assert chosen.words().startswith("run 30 steps in fast: as good as plain at 30; against plain at 26 by model "
                                     "calls it saves 1.61x")
    assert chosen.as_dict()["mode"] == "fast" and chosen.as_dict()["steps"] == 30


def test_a_recommended_mode_whose_ratio_is_not_settled_says_so_in_a_sentence():
    spread = [RequestOutcome(model_calls=calls, mse=2e-3, detail=1.0, adherence=1.0)  # cheaper on some requests only
              for calls in (6, 40, 8, 42, 7, 41, 9, 40)]
    chosen = recommend(FULL, FEWER, {(30, "fast"): spread}, 30)
    assert chosen.mode == "fast" and chosen.interval[0] <= 1.0 <= chosen.interval[1], chosen
    assert chosen.words().startswith("run 30 steps in fast: as good as plain at 30; against plain at 26 by model "
                                     "calls: not settled ("), chosen.words()


def test_plain_at_the_knee_is_recommended_where_no_mode_is_cheaper_or_as_good():
    blurred = {(30, "fast"): _runs(12, 2e-3, 0.8)}  # cheaper but not as detailed
    dearer = {(30, "balanced"): _runs(27, 1e-3, 1.0)}
    for modes in (blurred, dearer, {}):
        chosen = recommend(FULL, FEWER, modes, 30)
        assert (chosen.mode, chosen.steps) == (PLAIN, 26)
        assert chosen.words() == ("run plain at 26 steps (as good as plain at 30): no reuse mode is as good for "
                                  "fewer model calls here")

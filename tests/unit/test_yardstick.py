"""The one yardstick `bench workload` and the calibration both weigh reuse by: as adherent, as close to plain and as
detailed; the plain-steps curve bisected to bracket a configuration's quality; the interval and the words."""

from __future__ import annotations

import pytest
import torch

from carnator_core.judging.plain_steps_curve import bracket, next_count
from carnator_core.judging.quality import detail, detail_ratio
from carnator_core.judging.ratio_interval import ratio_words, settled
from carnator_core.judging.yardstick import RequestOutcome, StreamQuality, equal_quality, quality_bar, short_of


def _quality(psnr: float = 40.0, detail_kept: float = 1.0, adherence: float | None = 1.0) -> StreamQuality:
    return StreamQuality(model_calls=10.0, psnr_db=psnr, detail=detail_kept, adherence=adherence)


def test_a_plain_run_falls_short_on_adherence_psnr_or_detail_and_the_first_is_named():
    goal = _quality()
    assert short_of(_quality(), goal) is None
    assert short_of(_quality(adherence=0.996), goal) is None  # within the tolerance
    assert short_of(_quality(adherence=0.99, psnr=30.0), goal) == "adherence"
    assert short_of(_quality(psnr=39.9), goal) == "PSNR"
    assert short_of(_quality(detail_kept=0.94), goal) == "detail"
    assert short_of(_quality(detail_kept=0.96), goal) is None
    assert short_of(_quality(adherence=None), _quality(adherence=1.0)) is None  # no oracle: PSNR and detail decide
    # a resume sharper or more adherent than its plain render asks no more than the full render's own
    full = _quality(psnr=100.0, detail_kept=1.0, adherence=0.9)
    target = quality_bar(_quality(detail_kept=1.2, adherence=0.95), full)
    assert (target.detail, target.adherence, target.psnr_db) == (1.0, 0.9, 40.0)
    assert short_of(_quality(detail_kept=0.99, adherence=0.9), target) is None


def test_detail_sees_a_blur_that_psnr_to_a_different_render_cannot_tell():
    torch.manual_seed(0)
    frames = torch.rand(2, 3, 16, 16)
    blurred = torch.nn.functional.avg_pool2d(frames, 3, stride=1, padding=1, count_include_pad=False)
    assert detail(frames) > 0 and detail_ratio(blurred, frames) < 0.5 and detail_ratio(frames, frames) == 1.0
    assert detail_ratio(torch.zeros(1, 8, 8), torch.zeros(1, 8, 8)) == 1.0  # a flat reference counts as matched


def _outcomes(calls: list[float], psnr: float, detail_kept: float = 1.0) -> list[RequestOutcome]:
    return [RequestOutcome(model_calls=c, mse=10 ** (-psnr / 10), detail=detail_kept, adherence=1.0) for c in calls]


def test_the_cheapest_plain_run_as_good_sets_the_ratio_its_interval_redraws_the_choice_with_the_requests():
    plain = _outcomes([30.0] * 8, 100.0)
    fewer = {15: _outcomes([15.0] * 8, 35.0), 22: _outcomes([22.0] * 8, 45.0)}
    mode = _outcomes([7.0, 7.0, 7.0, 7.0, 31.0, 7.0, 7.0, 31.0], 42.0)
    weighed = equal_quality(mode, plain, fewer, 30)
    assert (weighed.against, weighed.steps_needed, weighed.steps_short, weighed.decided_by) == (
        "plain-22", 22, 15, "PSNR")
    assert weighed.calls == pytest.approx(22.0 / 13.0)
    low, high = weighed.interval
    assert low <= weighed.calls <= high and low > 1.0 and weighed.words().startswith("saves 1.69x (")
    assert equal_quality(mode, plain, fewer, 30) == weighed  # seeded: the same requests, the same interval
    blurred = {**fewer, 22: _outcomes([22.0] * 8, 45.0, detail_kept=0.9)}
    assert equal_quality(mode, plain, blurred, 30).against == "plain"  # as close, but it lost the detail
    with pytest.raises(ValueError, match="same, non-zero number of requests"):
        equal_quality(mode[:3], plain, fewer, 30)


def test_the_words_say_not_settled_exactly_when_the_interval_holds_one():
    assert ratio_words(1.3, (1.1, 1.5), 16) == "saves 1.30x (1.10–1.50x)"
    assert ratio_words(0.6, (0.5, 0.7), 16) == "lower the steps instead (0.60x, 0.50–0.70x)"
    assert ratio_words(1.1, (0.8, 1.4), 16) == "not settled (0.80–1.40x): about 128 more prompts would settle it"
    assert ratio_words(1.0, (0.9, 1.1), 16).endswith("no number of prompts can be told to settle it")
    assert ratio_words(1.0, (1.0, 1.0), 8) == "not settled: a tie (1.00x), the calls of the plain run as good on every request"
    for interval in ((1.1, 1.5), (0.5, 0.7), (0.8, 1.4), (1.0, 1.2)):
        assert settled(interval) == ("not settled" not in ratio_words(1.05, interval, 8))


def test_the_curve_bisects_to_bracket_each_configuration_within_its_budget():
    def needs(steps: int):
        return lambda n: n >= steps

    measured: list[int] = []
    for _ in range(3):
        measured.append(next_count(30, measured, [needs(21)]))
    assert measured == [15, 22, 18]
    assert bracket(30, measured, needs(21)) == (18, 22)
    # two configurations: the widest bracket is refined first; closed brackets ask for nothing
    assert next_count(30, [15, 22], [needs(25), needs(10)]) == 7  # (0, 15) is wider than (22, 30)
    assert next_count(8, [4, 5, 6, 7], [needs(5)]) is None
    assert next_count(30, [], []) is None

"""Per-head REUSE/OWN hysteresis driven by synthetic recall sequences."""

import pytest

from carnator_core.attention.hysteresis import HeadHysteresis, HeadMode, check_recall_thresholds


def test_head_switches_exactly_at_the_thresholds_without_flapping():
    policy = HeadHysteresis(enter_recall=0.9, exit_recall=0.7, confirm_checks=2)
    head = (3, 5)
    recalls = [0.92, 0.8, 0.71, 0.7, 0.69, 0.85, 0.95, 0.89, 0.9, 0.9, 0.75, 0.72]
    expected = ["reuse", "reuse", "reuse", "reuse", "own", "own", "own", "own", "own", "reuse", "reuse", "reuse"]
    modes = [policy.check(head, recall, step).value for step, recall in enumerate(recalls)]
    assert modes == expected
    # 0.95 then 0.89 breaks the streak; 0.9 twice in a row is needed to re-enter
    assert [entry[2] for entry in policy.history()["3:5"]] == expected


def test_values_between_the_thresholds_never_change_the_mode():
    policy = HeadHysteresis(enter_recall=0.9, exit_recall=0.7)
    assert policy.adopt((0, 0), 0.95, 0) is HeadMode.REUSE
    assert policy.adopt((0, 1), 0.5, 0) is HeadMode.OWN
    for step, recall in enumerate([0.71, 0.89, 0.8, 0.75, 0.88, 0.7], start=1):
        assert policy.check((0, 0), recall, step) is HeadMode.REUSE
        assert policy.check((0, 1), recall, step) is HeadMode.OWN
    assert policy.counts() == {"heads_reuse": 1, "heads_own": 1}


def test_adoption_needs_enter_recall():
    policy = HeadHysteresis(enter_recall=0.9, exit_recall=0.7)
    assert policy.adopt((1, 1), 0.899, 0) is HeadMode.OWN
    assert policy.adopt((1, 2), 0.9, 0) is HeadMode.REUSE


@pytest.mark.parametrize(("enter", "exit_"), [(0.7, 0.9), (0.8, 0.8), (1.1, 0.5), (0.9, -0.1)])
def test_inconsistent_thresholds_are_refused(enter, exit_):
    with pytest.raises(ValueError):
        HeadHysteresis(enter_recall=enter, exit_recall=exit_)


def test_refused_thresholds_name_both_inputs():
    with pytest.raises(ValueError, match="exit_recall must be lower than enter_recall"):
        check_recall_thresholds(enter_recall=0.75, exit_recall=0.9)
    check_recall_thresholds(enter_recall=1.0, exit_recall=0.0)

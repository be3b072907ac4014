"""Reuse settings from node inputs: defaults from the settings themselves, every input checked once, by name."""

from __future__ import annotations

import pytest

from carnator_core.reuse.probe import ProbeThresholds
from carnator_core.reuse.settings import INPUT_RANGES, ReuseSettings, input_default, input_range


def test_inputs_left_out_take_the_settings_defaults():
    assert ReuseSettings.from_inputs() == ReuseSettings()
    assert ReuseSettings.from_inputs(prompt=None).prompt == ""


def test_threshold_inputs_set_the_probe_thresholds():
    settings = ReuseSettings.from_inputs(structure_threshold=0.7, guidance_threshold=0.6, depth_slope=0.2)
    assert settings.thresholds == ProbeThresholds(structure=0.7, structure_slope=0.2, guidance=0.6,
                                                  guidance_slope=0.2)
    assert (input_default("structure_threshold"), input_default("depth_slope")) == (
        ProbeThresholds.structure, ProbeThresholds.structure_slope)


@pytest.mark.parametrize("name", sorted(INPUT_RANGES))
def test_each_range_is_enforced_at_its_edges_naming_the_input(name):
    low, high = INPUT_RANGES[name]
    assert input_range(name) == {"min": low, "max": high}
    assert low <= input_default(name) <= high
    ReuseSettings.from_inputs(**{name: low})
    ReuseSettings.from_inputs(**{name: high})
    for outside in (low - 1, high + 1, float("nan")):
        with pytest.raises(ValueError, match=name):
            ReuseSettings.from_inputs(**{name: outside})


@pytest.mark.parametrize("name", ["mode", "seed_policy", "verification"])
def test_an_unknown_choice_is_refused_naming_the_input(name):
    with pytest.raises(ValueError, match=name):
        ReuseSettings.from_inputs(**{name: "sideways"})


@pytest.mark.parametrize("steps", [1, 2, 4, 7, 8])
def test_few_step_schedules_record_every_step(steps):
    assert ReuseSettings().checkpoint_steps(steps) == list(range(steps))


def test_longer_schedules_record_at_the_fractions_and_step_zero():
    assert ReuseSettings().checkpoint_steps(30) == [0, 6, 10, 15, 20, 24]
    assert ReuseSettings().checkpoint_steps(9) == [0, 2, 3, 4, 6, 7]

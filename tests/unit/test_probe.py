"""The probe's signals and the thresholds that decide on them, on synthetic latents."""

from __future__ import annotations

import math

import pytest
import torch

from carnator_core.judging.probe_signals import ProbeSignals
from carnator_core.judging.probe_thresholds import ProbeThresholds
from carnator_core.reuse.probe import (
    CONDITIONAL_BRANCHES,
    conditional_agreement,
    downsample_guidance,
    probe_signals,
    screen_basis,
)

VIDEO = (1, 16, 3, 8, 8)  # (batch, channels, frames, height, width)
IMAGE = (1, 4, 8, 8)
THRESHOLDS = ProbeThresholds()


def _random(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _signals(structure: float, guidance: float | None, depth: float = 0.0) -> ProbeSignals:
    return ProbeSignals(depth=depth, raw_agreement=structure, structure_agreement=structure, guidance_cosine=guidance)


@pytest.mark.parametrize("shape", [VIDEO, IMAGE], ids=["video", "image"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_identical_states_agree_fully_and_pass_at_every_depth(shape, dtype):
    state, x0, guidance = (_random(shape, seed).to(dtype) for seed in (0, 1, 2))
    stored_guidance = downsample_guidance(guidance)  # as recording keeps it
    for depth in (0.0, 0.5, 0.8):
        signals = probe_signals(depth, state, x0.clone(), x0, guidance, stored_guidance)
        assert signals.depth == depth
        assert signals.raw_agreement == pytest.approx(1.0)
        assert signals.structure_agreement == pytest.approx(1.0)
        assert signals.guidance_cosine == pytest.approx(1.0, abs=1e-6)
        assert THRESHOLDS.passes(signals) and not THRESHOLDS.donor_hopeless(signals)


def test_unrelated_states_fail_and_the_donor_is_given_up():
    state, x0_donor, x0_new, guidance_new, guidance_donor = (_random(VIDEO, seed) for seed in range(5))
    signals = probe_signals(0.2, state, x0_new, x0_donor, guidance_new, downsample_guidance(guidance_donor))
    assert signals.structure_agreement < 0.5 and abs(signals.guidance_cosine) < 0.2
    assert not THRESHOLDS.passes(signals) and THRESHOLDS.donor_hopeless(signals)


def test_a_global_colour_shift_changes_raw_agreement_not_structure():
    """Per-frame, per-channel means are appearance: removing them leaves the structure of the prediction."""
    state, x0 = _random(VIDEO, 0), _random(VIDEO, 1)
    shifted = x0 + torch.linspace(-2, 2, VIDEO[1]).view(1, -1, 1, 1, 1)
    signals = probe_signals(0.5, state, shifted, x0, None, None)
    assert signals.raw_agreement < 0.5 and signals.structure_agreement == pytest.approx(1.0)
    assert signals.guidance_cosine is None and THRESHOLDS.passes(signals)  # without CFG structure decides alone


@pytest.mark.parametrize("depth", [0.0, 0.35, 0.8])
def test_the_structure_threshold_decides_at_its_edge(depth):
    needed = THRESHOLDS.needed_structure(depth)
    assert needed == pytest.approx(THRESHOLDS.structure + THRESHOLDS.structure_slope * depth)
    assert THRESHOLDS.passes(_signals(needed, None, depth))
    assert not THRESHOLDS.passes(_signals(math.nextafter(needed, 0.0), None, depth))


@pytest.mark.parametrize("depth", [0.0, 0.35, 0.8])
def test_the_guidance_threshold_decides_at_its_edge(depth):
    needed = THRESHOLDS.guidance + THRESHOLDS.guidance_slope * depth
    structure = THRESHOLDS.needed_structure(depth)
    assert THRESHOLDS.passes(_signals(structure, needed, depth))
    assert not THRESHOLDS.passes(_signals(structure, math.nextafter(needed, 0.0), depth))
    assert not THRESHOLDS.passes(_signals(math.nextafter(structure, 0.0), 1.0, depth))  # both must hold


def test_the_give_up_margin_decides_at_its_edge():
    edge = THRESHOLDS.needed_structure(0.5) - THRESHOLDS.give_up_margin
    assert not THRESHOLDS.donor_hopeless(_signals(edge, None, 0.5))
    assert THRESHOLDS.donor_hopeless(_signals(math.nextafter(edge, 0.0), None, 0.5))


@pytest.mark.parametrize("depth", [0.35, 0.8])
def test_a_corrected_state_meets_the_same_bar_and_never_gives_the_donor_up(depth):
    """At a corrected donor state the bar is the same, and a miss there leaves the donor's shallower checkpoints to be
    probed."""
    needed = THRESHOLDS.needed_structure(depth)
    corrected = ProbeSignals(depth=depth, raw_agreement=needed, structure_agreement=needed, guidance_cosine=None,
                             corrected=True)
    below = ProbeSignals(depth=depth, raw_agreement=needed, structure_agreement=math.nextafter(needed, 0.0),
                         guidance_cosine=None, corrected=True)
    assert THRESHOLDS.passes(corrected) and not THRESHOLDS.passes(below)
    far = ProbeSignals(depth=depth, raw_agreement=0.0, structure_agreement=0.0, guidance_cosine=None, corrected=True)
    assert not THRESHOLDS.passes(far) and not THRESHOLDS.donor_hopeless(far)
    assert corrected.as_dict()["corrected"] is True and "corrected" not in _signals(needed, None, depth).as_dict()


def test_thresholds_never_ask_for_more_than_full_agreement():
    strict = ProbeThresholds(structure=0.95, structure_slope=0.5, guidance=0.95, guidance_slope=0.5)
    assert strict.needed_structure(0.8) == 1.0
    assert strict.passes(_signals(1.0, 1.0, 0.8))


@pytest.mark.parametrize("case", ["NaN prediction", "state equals the donor's prediction", "infinite state"])
def test_unusable_inputs_give_a_failing_probe(case):
    state, x0_new, x0_donor = _random(VIDEO, 0), _random(VIDEO, 1), _random(VIDEO, 2)
    if case == "NaN prediction":
        x0_new[0, 0, 0, 0, 0] = float("nan")
    elif case == "state equals the donor's prediction":
        state = x0_donor.clone()
    else:
        state[0, 0, 0, 0, 0] = float("inf")
    signals = probe_signals(0.5, state, x0_new, x0_donor, None, None)
    assert math.isnan(signals.structure_agreement)
    assert not THRESHOLDS.passes(signals) and THRESHOLDS.donor_hopeless(signals)


def test_guidance_that_cannot_be_compared_is_left_out():
    state, x0, guidance = _random(VIDEO, 0), _random(VIDEO, 1), _random(VIDEO, 2)
    other_grid = downsample_guidance(_random((1, 16, 3, 16, 16), 3), (3, 5, 5))
    assert probe_signals(0.5, state, x0, x0, guidance, other_grid).guidance_cosine is not None  # pooled to it
    assert probe_signals(0.5, state, x0, x0, guidance, _random((1, 8, 3, 4, 4), 4)).guidance_cosine is None
    assert probe_signals(0.5, state, x0, x0, guidance, None).guidance_cosine is None
    assert probe_signals(0.5, state, x0, x0, None, guidance).guidance_cosine is None


def test_predictions_of_other_shapes_raise():
    state, x0 = _random(VIDEO, 0), _random(VIDEO, 1)
    with pytest.raises(RuntimeError):
        probe_signals(0.5, state, _random((1, 16, 3, 4, 4), 2), x0, None, None)


@pytest.mark.parametrize("cfg_scale", [2.0, 4.0, 6.0])
def test_the_conditional_branches_agree_alike_at_every_guidance_scale(cfg_scale):
    """Two requests with one negative prompt share the unconditional branch at a state: the conditional agreement
    recovered from the CFG outputs and the live guidance is the outputs' agreement at cfg 1, while the outputs'
    own agreement falls with the scale (the guidance is small beside the distance from the noisy state)."""
    state, cond_donor = (_random(VIDEO, seed) for seed in (0, 2))
    uncond = cond_donor - 0.3 * _random(VIDEO, 1)
    cond_new = cond_donor + 0.15 * _random(VIDEO, 3)  # a rewording: the conditional branches nearly agree

    def output(cond: torch.Tensor) -> torch.Tensor:
        return uncond + cfg_scale * (cond - uncond)

    at_cfg_1 = probe_signals(0.0, state, cond_new, cond_donor, None, None).structure_agreement
    guided = probe_signals(0.0, state, output(cond_new), output(cond_donor), None, None).structure_agreement
    conditional = conditional_agreement(state, output(cond_new), output(cond_donor), cond_new - uncond, cfg_scale)
    assert conditional == pytest.approx(at_cfg_1, abs=1e-5) and guided < at_cfg_1 - 0.01
    signals = ProbeSignals(depth=0.0, raw_agreement=guided, structure_agreement=guided, guidance_cosine=None,
                           conditional_agreement=conditional)
    assert signals.weakest_structure == conditional  # what the screen's bar is compared with
    assert conditional_agreement(state, cond_new, cond_donor, cond_new - uncond, 1.0) == pytest.approx(at_cfg_1)


def test_the_screen_judges_the_conditional_branches_only_where_the_unconditional_branch_is_shared():
    guidance = torch.ones(1, 2, 2, 4, 4)
    form = "cfg=6.0;negative"
    assert screen_basis(6.0, guidance, False, form, form) == CONDITIONAL_BRANCHES
    assert screen_basis(1.0, guidance, False, form, form) == "output (no CFG)"
    assert screen_basis(6.0, None, False, form, form) == "output (no CFG)"
    assert screen_basis(6.0, guidance, True, form, form) == "output (a packed latent's parts)"
    assert screen_basis(6.0, guidance, False, None, form).startswith("output (a CFG function")
    assert screen_basis(6.0, guidance, False, form, "cfg=4.0;negative").startswith("output (the donor's negative")
    assert screen_basis(6.0, guidance, False, form, None) == "output (the donor's unconditional branch is unknown)"

"""Latent reuse is off only under a mask that keeps part of the latent; a run from an input reuses from its own kind
(`carnator_core.reuse.input_start`), within a distance of its input."""

from __future__ import annotations

import math

import torch

from carnator_core.reuse.applicability import latent_reuse_refusal, starts_from_input
from carnator_core.reuse.input_start import MAX_INPUT_DISTANCE, input_distance, input_mismatch

LATENT = (1, 16, 2, 8, 8)


def test_a_run_from_pure_noise_over_the_full_schedule_does_not_start_from_an_input():
    assert not starts_from_input(None, 1.0, 1.0)
    assert not starts_from_input(torch.zeros(LATENT), 0.9995, 1.0)
    assert starts_from_input(torch.ones(LATENT), 1.0, 1.0)  # image-to-video, video-to-video, a refinement stage
    assert starts_from_input(None, 0.8, 1.0)  # denoise < 1


def test_only_a_mask_that_keeps_part_of_the_latent_turns_latent_reuse_off():
    assert latent_reuse_refusal(None) == ""
    assert latent_reuse_refusal(torch.ones(LATENT)) == ""  # LTX-2's refinement: ones everywhere denoise everything
    partial = torch.ones(LATENT)
    partial[:, :, 0] = 0.0  # a guide frame kept as given
    assert latent_reuse_refusal(partial) == ("denoise mask keeps part of the latent (inpainting or guide frames): "
                                             "latent reuse off")
    assert latent_reuse_refusal([torch.ones(LATENT)]) == "denoise mask of type list: latent reuse off"


def test_a_donor_input_is_close_within_the_distance_and_of_the_same_shape():
    donor = torch.randn(LATENT, generator=torch.Generator().manual_seed(0))
    assert input_distance(donor, donor) == 0.0
    close = donor + 0.5 * MAX_INPUT_DISTANCE * donor
    assert input_mismatch(close, donor) is None
    assert input_mismatch(2 * donor, donor) == f"input farther than {MAX_INPUT_DISTANCE} from the donor's"
    assert input_mismatch(donor[..., :4], donor) == "input of another shape"
    assert input_mismatch(donor, None) == "no input recorded at its step 0"
    assert input_distance(torch.zeros(LATENT), torch.zeros(LATENT)) == 0.0
    assert math.isinf(input_distance(donor, torch.zeros(LATENT)))
    assert input_mismatch(torch.full(LATENT, float("nan")), donor) is not None

"""Latent reuse applies only to runs from pure noise over the full schedule; the reason says which rule refused."""

from __future__ import annotations

import torch

from carnator_core.reuse.applicability import latent_reuse_refusal

LATENT = (1, 16, 2, 8, 8)


def test_latent_reuse_applies_to_an_empty_latent_over_the_full_schedule():
    assert latent_reuse_refusal(None, None, 1.0, 1.0) == ""
    assert latent_reuse_refusal(None, torch.zeros(LATENT), 0.9995, 1.0) == ""


def test_each_other_start_is_refused_with_its_reason():
    assert latent_reuse_refusal(torch.ones(LATENT), None, 1.0, 1.0) == "denoise mask (inpainting): latent reuse off"
    assert latent_reuse_refusal(None, torch.ones(LATENT), 1.0, 1.0) == "input latent is not empty: latent reuse off"
    assert latent_reuse_refusal(None, None, 0.8, 1.0) == "denoise < 1: latent reuse off"
    # the first rule that applies gives the reason
    assert latent_reuse_refusal(torch.ones(LATENT), torch.ones(LATENT), 0.8, 1.0).startswith("denoise mask")

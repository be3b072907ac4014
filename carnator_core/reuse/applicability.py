"""Whether latent reuse applies to a request: only to text-to-video runs from pure noise over the full schedule.

A resumed donor state stands for the steps the donor took from its own initial noise; a request that starts from
something else (an input latent, an inpainting mask, a partial schedule) asks for another computation. Sparsity
reuse is unaffected.
"""

from __future__ import annotations

import torch


def latent_reuse_refusal(denoise_mask: torch.Tensor | None, latent_image: torch.Tensor | None, first_sigma: float,
                         sigma_max: float) -> str:
    """Why latent reuse does not apply to a request ("" when it does)."""
    if denoise_mask is not None:
        return "denoise mask (inpainting): latent reuse off"
    if latent_image is not None and torch.count_nonzero(latent_image) > 0:
        return "input latent is not empty: latent reuse off"
    if first_sigma < sigma_max * 0.999:
        return "denoise < 1: latent reuse off"
    return ""

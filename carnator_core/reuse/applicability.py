"""Whether latent reuse applies to a request, and from which donors.

A resumed donor state stands for the steps the donor took from its own first state. A text-to-video run starts from
pure noise over the full schedule, so its donors are runs that started from pure noise. A run that starts from an
input (a non-empty latent: a refinement or super-resolution stage after an upsampler, image-to-video, video-to-video;
or a partial schedule) takes only donors that also started from an input, of the same stage, whose input lies
close to its own (`carnator_core.reuse.input_start`). A denoise mask that keeps part of the latent fixed (inpainting,
guide frames) asks for another computation at every step: latent reuse is off there. Sparsity reuse is unaffected.
"""

from __future__ import annotations

import torch


def latent_reuse_refusal(denoise_mask: object | None) -> str:
    """Why latent reuse does not apply to a request ("" when it does). A mask of ones everywhere denoises the whole
    latent, as no mask does (LTX-2's refinement stage carries one)."""
    if denoise_mask is None:
        return ""
    if not isinstance(denoise_mask, torch.Tensor):
        return f"denoise mask of type {type(denoise_mask).__name__}: latent reuse off"
    if not bool((denoise_mask == 1).all()):
        return "denoise mask keeps part of the latent (inpainting or guide frames): latent reuse off"
    return ""


def starts_from_input(latent_image: torch.Tensor | None, first_sigma: float, sigma_max: float) -> bool:
    """Whether the run starts from an input rather than pure noise: a non-empty latent, or part of the schedule."""
    if latent_image is not None and torch.count_nonzero(latent_image) > 0:
        return True
    return first_sigma < sigma_max * 0.999

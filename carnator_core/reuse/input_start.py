"""Runs that start from an input: which donors' states can continue them.

A refinement or super-resolution stage (LTX-2's second pass after its latent upsampler, HunyuanVideo 1.5's 1080p
stage), an image-to-video or a video-to-video run starts from an input latent mixed with noise, often over part of the
schedule. Between requests that differ by a few words, that input differs a little and the noise is the same. Such a
run takes as donors only the same stage of earlier runs that also started from an input (model, grid, sigmas and noise
in the hard key and noise fingerprint), whose input lies within `MAX_INPUT_DISTANCE` of its own. The donor is then
screened on the run's own first evaluation and resumed from its state corrected by what the two first states and the
two first predictions differ by (`carnator_core.reuse.start_difference`), where the model verifies it.

The distance is the relative L2 distance of the inputs, both rounded as the store rounds the donor's: a hard filter
on what no model call can change, before the model is asked.

An image the conditioning carries (`concat_latent_image`: image-to-video's start image, HunyuanVideo 1.5's upscaled
video for its super-resolution stage) is an input of the same kind, whether the run starts from it or from pure
noise: such a run takes as donors only runs guided by an image within the same distance of its own.
"""

from __future__ import annotations

import torch

INPUT_START = "input_start"  # the entry extra that marks a run from an input
INPUT_NOTE = "starts from an input latent: reuses the same stage of runs from a close input"  # in its report
GUIDE_IMAGE = "guide_image"  # the entry extra that marks a run guided by an image in its conditioning
GUIDE_NOTE = "guided by an image in its conditioning: reuses runs guided by a close image"  # in its report

# Inputs further apart than this are other inputs, not an edit of the same one: the donor is skipped with the reason.
# The screen and the probe decide within it. The bound is the largest at which every resume they accepted kept its
# quality (`python -m carnator_core.bench inputs`, docs/measurements.md "The input distance bound").
MAX_INPUT_DISTANCE = 0.4


def input_distance(new: torch.Tensor, donor: torch.Tensor) -> float:
    """|new - donor| / |donor| in float32 after float16 rounding; 0 for two empty inputs, inf against an empty one."""
    new, donor = new.detach().to("cpu", torch.float16).float(), donor.detach().to("cpu", torch.float16).float()
    scale = float(torch.linalg.vector_norm(donor))
    difference = float(torch.linalg.vector_norm(new - donor))
    if scale <= 0.0:
        return 0.0 if difference <= 0.0 else float("inf")
    return difference / scale


def input_mismatch(new: torch.Tensor, donor: torch.Tensor | None, what: str = "input") -> str | None:
    """Why a donor's input (`what`: the input latent, or the conditioning's image) rules it out for a run from `new`
    (None when it may continue it)."""
    if donor is None:
        return f"no {what} recorded at its step 0"
    if tuple(donor.shape) != tuple(new.shape):
        return f"{what} of another shape"
    distance = input_distance(new, donor)
    if not distance <= MAX_INPUT_DISTANCE:  # NaN fails
        return f"{what} farther than {MAX_INPUT_DISTANCE} from the donor's"
    return None

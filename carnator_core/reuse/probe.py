"""Latent probe: does the new request's model steer a donor's stored state like the donor did?

At a donor checkpoint (x_k, sigma_k, x0_k, guidance_k) the new request's own model, with its
own conditioning and CFG, predicts x0_new and guidance_new. Three signals come out:

- raw agreement      1 - |x0_new - x0_donor| / |x0_donor - x_k|. Late in the schedule every
                     prompt's x0 converges on x_k, so it rises with depth whatever the prompt:
                     it is reported, not trusted alone.
- guidance cosine    cos(guidance_new, guidance_donor), guidance = x0_cond - x0_uncond: whether
                     the new prompt pushes the state in the donor prompt's direction.
- structure agreement the raw agreement after removing per-frame, per-channel means, so a
                     global colour or style change (fixable late) does not hide a layout or
                     motion change (not fixable late), and vice versa.

On a packed latent (`carnator_core.reuse.packed_latent`: LTX-2's video and audio) the signals above are the first
part's (the video), and the structure agreement of every other part is reported beside them: a resume needs each to
pass, since a prompt can change the sound and leave the picture alone.

They come out as `ProbeSignals` (`carnator_core.judging.probe_signals`); `ProbeThresholds`
(`carnator_core.judging.probe_thresholds`) turns them into a depth-dependent decision; its defaults come from the probe
calibration (`python -m carnator_core.bench probe`, docs/measurements.md "Probe calibration").
"""

from __future__ import annotations

import torch

from carnator_core.judging.probe_signals import ProbeSignals
from carnator_core.reuse.packed_latent import PackedShapes, unpack


def _remove_frame_channel_means(tensor: torch.Tensor) -> torch.Tensor:
    """Subtract the mean over the spatial axes of every (batch, channel, frame)."""
    if tensor.ndim < 4:
        return tensor - tensor.mean()
    spatial = tuple(range(3, tensor.ndim)) if tensor.ndim >= 5 else tuple(range(2, tensor.ndim))
    return tensor - tensor.mean(dim=spatial, keepdim=True)


def _agreement(x0_new: torch.Tensor, x0_donor: torch.Tensor, state: torch.Tensor) -> float:
    scale = torch.linalg.vector_norm(x0_donor - state)
    if not torch.isfinite(scale) or scale <= 1e-12:
        return float("nan")
    return float(1.0 - torch.linalg.vector_norm(x0_new - x0_donor) / scale)


GUIDANCE_DOWNSAMPLE = 2  # guidance is compared by cosine: half spatial resolution is plenty to store


def downsample_guidance(guidance: torch.Tensor, size: tuple[int, ...] | None = None) -> torch.Tensor:
    """Average-pool a guidance field spatially (by GUIDANCE_DOWNSAMPLE, or to `size`).

    Recording stores guidance this way, and probing pools the live guidance the same way
    before comparing, so an identical request compares equal (upsampling the stored field
    instead would lose its high frequencies and understate agreement).
    """
    if guidance.ndim not in (4, 5):
        return guidance.float()
    spatial = tuple(guidance.shape[2:])
    if size is None:
        size = spatial[:-2] + tuple(-(-d // GUIDANCE_DOWNSAMPLE) for d in spatial[-2:])
    pool = torch.nn.functional.adaptive_avg_pool3d if guidance.ndim == 5 else torch.nn.functional.adaptive_avg_pool2d
    return pool(guidance.float(), size)


def _structure_agreement(x0_new: torch.Tensor, x0_donor: torch.Tensor, state: torch.Tensor) -> float:
    return _agreement(_remove_frame_channel_means(x0_new), _remove_frame_channel_means(x0_donor),
                      _remove_frame_channel_means(state))


def conditional_agreement(state: torch.Tensor, x0_new: torch.Tensor, x0_donor: torch.Tensor,
                          guidance_new: torch.Tensor, cfg_scale: float) -> float:
    """The structure agreement of the two requests' conditional branches at one state.

    Why: with CFG the output is uncond + cfg x (cond - uncond), and two requests with the same negative prompt share
    the unconditional branch at one state, so their outputs differ by cfg times what their conditional branches
    differ by: the output's agreement falls with the guidance scale for one and the same pair of prompts, while the
    conditional branches' stays where it is at cfg 1. Both branches come from the live request alone: its own
    conditional prediction is x0 - (cfg - 1) x guidance, the donor's that less the outputs' difference over cfg."""
    conditional_new = x0_new - (cfg_scale - 1.0) * guidance_new
    return _structure_agreement(conditional_new, conditional_new - (x0_new - x0_donor) / cfg_scale, state)


GUIDANCE_FORM = "guidance_form"  # the entry extra that holds the run's guidance form (`ReuseRun.guidance_form`)
CONDITIONAL_BRANCHES = "conditional branches"


def screen_basis(cfg_scale: float, guidance_new: torch.Tensor | None, packed: bool, live_form: str | None,
                 donor_form: object) -> str:
    """What the step-0 screen judges a donor on: its conditional branches (`conditional_agreement`), or the guided
    output and why. The conditional branches hold only where the two outputs share their unconditional branch and
    both are uncond + cfg x (cond - uncond): the same negative conditioning and CFG scale, no CFG function."""
    if guidance_new is None or cfg_scale <= 1.0:
        return "output (no CFG)"
    if packed:
        return "output (a packed latent's parts)"
    if live_form is None:
        return "output (a CFG function or the guider shapes the output)"
    if donor_form != live_form:
        unknown = not isinstance(donor_form, str)
        return "output (the donor's unconditional branch is unknown)" if unknown else \
            "output (the donor's negative prompt, CFG scale or CFG function differs)"
    return CONDITIONAL_BRANCHES


def probe_signals(depth: float, state: torch.Tensor, x0_new: torch.Tensor, x0_donor: torch.Tensor,
                  guidance_new: torch.Tensor | None, guidance_donor: torch.Tensor | None,
                  packed: PackedShapes | None = None, corrected: bool = False) -> ProbeSignals:
    """All signals of one probe, in fp32. NaN anywhere makes the probe fail (NaN never passes). With `packed`, the
    tensors are those latents packed: the signals are the first part's, and each other part's structure agreement
    is added (guidance, stored packed, is compared whole)."""
    state, x0_new, x0_donor = state.float(), x0_new.float(), x0_donor.float()
    others: tuple[float, ...] = ()
    if packed is not None:
        parts = list(zip(*(unpack(t, packed) for t in (x0_new, x0_donor, state)), strict=True))
        others = tuple(_structure_agreement(*part) for part in parts[1:])
        x0_new, x0_donor, state = parts[0]
    raw = _agreement(x0_new, x0_donor, state)
    structure = _structure_agreement(x0_new, x0_donor, state)
    cosine = None
    if guidance_new is not None and guidance_donor is not None:
        donor = guidance_donor.float()
        new = downsample_guidance(guidance_new, tuple(donor.shape[2:])) if donor.ndim in (4, 5) else guidance_new
        if new.shape == donor.shape:
            cosine = float(torch.nn.functional.cosine_similarity(new.reshape(-1).float(), donor.reshape(-1), dim=0))
    return ProbeSignals(depth=depth, raw_agreement=raw, structure_agreement=structure, guidance_cosine=cosine,
                        other_parts_agreement=others, corrected=corrected)

"""The demo model's own flow sampler, outside ComfyUI: what training evaluates and the benchmarks calibrate with.

It follows ComfyUI's schedule (simple scheduler, shifted sigmas) and Euler steps, so its outputs match a
KSampler run of the same model closely enough to rank prompts and probe signals without a host.
"""

from __future__ import annotations

import torch

from carnator_core.demo.wan_model import WanT2V


def shifted_sigma(u: torch.Tensor, shift: float) -> torch.Tensor:
    """ComfyUI's time_snr_shift: the sigma a flow model with this shift assigns to timestep fraction u."""
    return shift * u / (1 + (shift - 1) * u)


@torch.no_grad()
def sample(model: WanT2V, context: torch.Tensor, uncond: torch.Tensor | None, noise: torch.Tensor,
           steps: int = 30, shift: float = 3.0, cfg_scale: float = 1.0) -> torch.Tensor:
    """Plain Euler flow sampler on ComfyUI's schedule (simple scheduler, shifted sigmas); returns denoised x0."""
    sigmas = [float(shifted_sigma(torch.tensor(1 - i / steps), shift)) for i in range(steps)] + [0.0]
    x = noise
    for s, s_next in zip(sigmas[:-1], sigmas[1:], strict=True):
        t = torch.full((x.shape[0],), s * 1000, device=x.device)
        v = model(x, t, context)
        if uncond is not None and cfg_scale != 1.0:
            u = model(x, t, uncond)
            v = u + cfg_scale * (v - u)
        x = x + (s_next - s) * v
    return x

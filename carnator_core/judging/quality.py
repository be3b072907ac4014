"""PSNR and SSIM of decoded clips against the same-seed plain output (sparsity reuse must not change the picture),
and the detail a clip keeps beside it.

Frames are tiny (the demo clip is 16 x 16 latent pixels), so SSIM uses a 7-tap Gaussian window (sigma 1.5)
instead of the usual 11 taps, computed per frame and channel over the valid region and averaged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

PSNR_IDENTICAL = 100.0  # dB reported for bit-identical clips (the true value is infinite)
_C1, _C2 = 0.01**2, 0.03**2  # SSIM constants for data range 1


def mse(clip: torch.Tensor, reference: torch.Tensor) -> float:
    return float(F.mse_loss(clip.float(), reference.float()))


def psnr_from_mse(error: float) -> float:
    """PSNR in dB for values in [0, 1]; pass the mean MSE of several clips for the PSNR of all of them together
    (averaging per-clip PSNR would let a few identical clips, at 'infinite' dB, hide the ones that differ)."""
    return PSNR_IDENTICAL if error <= 0.0 else min(PSNR_IDENTICAL, 10 * math.log10(1.0 / error))


def mse_from_psnr(psnr_db: float) -> float:
    """The mean squared error a PSNR stands for (values in [0, 1]); 0 for an identical clip."""
    return 0.0 if psnr_db >= PSNR_IDENTICAL else 10 ** (-psnr_db / 10)


def _window(size: int = 7, sigma: float = 1.5) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float32) - (size - 1) / 2
    g = torch.exp(-x * x / (2 * sigma * sigma))
    g = g / g.sum()
    return (g[:, None] * g[None, :])[None, None]


def ssim(clip: torch.Tensor, reference: torch.Tensor) -> float:
    """Mean structural similarity of clips [C, F, H, W] (or [..., H, W]) with values in [0, 1]."""
    a = clip.float().reshape(-1, 1, *clip.shape[-2:])
    b = reference.float().reshape(-1, 1, *reference.shape[-2:])
    window = _window(min(7, a.shape[-1], a.shape[-2]))
    mu_a, mu_b = F.conv2d(a, window), F.conv2d(b, window)
    var_a = F.conv2d(a * a, window) - mu_a**2
    var_b = F.conv2d(b * b, window) - mu_b**2
    cov = F.conv2d(a * b, window) - mu_a * mu_b
    score = ((2 * mu_a * mu_b + _C1) * (2 * cov + _C2)) / ((mu_a**2 + mu_b**2 + _C1) * (var_a + var_b + _C2))
    return float(score.mean())


def detail(clip: torch.Tensor) -> float:
    """High-frequency energy of clips [..., H, W]: the mean squared Laplacian over every frame and channel. It needs
    no reference: a run with fewer steps blurs fine detail away, a resume keeps its schedule's full-step detail."""
    frames = clip.float().reshape(-1, 1, *clip.shape[-2:])
    laplacian = torch.tensor([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]])[None, None]
    return float(F.conv2d(frames, laplacian).pow(2).mean()) if min(frames.shape[-2:]) >= 3 else 0.0


def detail_ratio(clip: torch.Tensor, reference: torch.Tensor) -> float:
    """The detail `clip` keeps against `reference` (1: as much; a flat reference counts as matched)."""
    wanted = detail(reference)
    return 1.0 if wanted <= 0.0 else detail(clip) / wanted


def latent_quality(latent: torch.Tensor, plain: torch.Tensor) -> tuple[float, float]:
    """PSNR (dB) and SSIM of a latent against the plain latent, both scaled by the plain latent's range: latents have
    no fixed range, so the plain one's stands for [0, 1]."""
    low, high = plain.min(), plain.max()
    scale = (high - low).clamp_min(1e-6)
    a, b = (latent.float() - low) / scale, (plain.float() - low) / scale
    return psnr_from_mse(mse(a, b)), ssim(a, b)

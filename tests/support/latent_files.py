"""LATENT files as ComfyUI's LoadLatent reads them, for graphs that start from a given latent."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file


def save_latent(path: Path, latent: torch.Tensor) -> None:
    """`latent` as a .latent file LoadLatent loads unscaled (the format-version marker says so)."""
    save_file({"latent_tensor": latent.contiguous(), "latent_format_version_0": torch.tensor([])}, str(path))


def write_retouched_videos(directory: Path, prefix: str, shape: tuple[int, ...]) -> None:
    """`{prefix}_original.latent`, `{prefix}_retouched.latent` (5 % of it changed, relative L2) and
    `{prefix}_other.latent` (an unrelated video) in `directory`: a close input and a far one."""
    generator = torch.Generator().manual_seed(0)
    original = torch.randn(shape, generator=generator)
    videos = {"original": original, "retouched": original + 0.05 * torch.randn(shape, generator=generator),
              "other": torch.randn(shape, generator=generator)}
    for name, latent in videos.items():
        save_latent(directory / f"{prefix}_{name}.latent", latent)

"""A calibration run's output as calibration compares it, and how close it stays to the plain run's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from carnator_core.judging.quality import detail_ratio, latent_quality, mse, psnr_from_mse, ssim


@dataclass
class Clip:
    """A run's output as calibration compares it: decoded frames [F, C, H, W] in [0, 1] where the graph decodes,
    else None; the (video) latent; and an audio+video run's audio latent, else None."""

    latent: torch.Tensor
    frames: torch.Tensor | None
    audio: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        optional = {"frames": self.frames, "audio": self.audio}
        return {"latent": self.latent, **{name: tensor for name, tensor in optional.items() if tensor is not None}}

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(self.tensors(), str(path))

    @classmethod
    def load(cls, path: Path) -> Clip:
        tensors = load_file(str(path))
        return cls(latent=tensors["latent"], frames=tensors.get("frames"), audio=tensors.get("audio"))


def quality(clip: Clip, plain: Clip) -> tuple[float, float]:
    """PSNR (dB) and SSIM of a clip against the plain clip: on decoded frames where there are any, else on the
    latents scaled by the plain latent's range; with audio, the lower of the video's and the audio latent's, so that
    a resume is good only where both are."""
    if clip.frames is not None and plain.frames is not None and clip.frames.shape == plain.frames.shape:
        video = psnr_from_mse(mse(clip.frames, plain.frames)), ssim(clip.frames, plain.frames)
    else:
        video = latent_quality(clip.latent, plain.latent)
    if clip.audio is None or plain.audio is None:
        return video
    audio = latent_quality(clip.audio, plain.audio)
    return min(video[0], audio[0]), min(video[1], audio[1])


def detail(clip: Clip, plain: Clip) -> float:
    """The detail a clip keeps against the plain clip (`judging.quality.detail_ratio`): on decoded frames where there
    are any, else on the latents; with audio, the video's."""
    if clip.frames is not None and plain.frames is not None and clip.frames.shape == plain.frames.shape:
        return detail_ratio(clip.frames, plain.frames)
    return detail_ratio(clip.latent, plain.latent)

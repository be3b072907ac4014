"""A small preview image of a generation, stored with its entry for the store panel.

Made from a latent frame with the model's latent-to-RGB preview factors (the same linear map
ComfyUI's fast latent previews use), so recording never runs a VAE. PNG bytes, never pickle.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch
from PIL import Image

MAX_SIDE = 160


def preview_png(frame: torch.Tensor, rgb_factors: list[list[float]], rgb_bias: list[float] | None = None,
                max_side: int = MAX_SIDE) -> bytes:
    """PNG of one latent frame (C, H, W) mapped to RGB by `rgb_factors` (C x 3), upscaled to about `max_side`."""
    factors = torch.tensor(rgb_factors, dtype=torch.float32)
    bias = torch.tensor(rgb_bias, dtype=torch.float32) if rgb_bias is not None else None
    rgb = torch.nn.functional.linear(frame.detach().float().cpu().movedim(0, -1), factors.T, bias)
    pixels = ((rgb.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
    image = Image.fromarray(pixels, mode="RGB")
    scale = max(1, max_side // max(image.size))
    if scale > 1:
        image = image.resize((image.width * scale, image.height * scale), Image.NEAREST)
    elif max(image.size) > max_side:
        image.thumbnail((max_side, max_side))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


@dataclass(frozen=True)
class PreviewFrame:
    """What a preview is made of, kept until it is encoded off the sampling path: a CPU copy of one latent frame
    (C, H, W) and the model's latent-to-RGB factors."""

    frame: torch.Tensor
    rgb_factors: list[list[float]]
    rgb_bias: list[float] | None = None

    def png(self) -> bytes:
        return preview_png(self.frame, self.rgb_factors, self.rgb_bias)

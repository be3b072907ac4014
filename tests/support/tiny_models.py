"""Tiny random-weight text-to-video diffusion models that ComfyUI's own loader detects.

Each builder instantiates ComfyUI's real model class with the smallest config that
`comfy.model_detection` infers back from the weights, on the meta device, then fills every
tensor from a seeded generator. Taking the key set from the host's model class (not a
hand-written key list) keeps the files loadable when upstream adds or renames a layer, and
leaves no key for the loader to skip (a skipped key would stay uninitialised memory).

Requires ComfyUI to be importable and configured (the in-process host does that).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file


@dataclass(frozen=True)
class TinyModelSpec:
    """What a tiny model file is and what a test needs to drive it."""

    family: str  # "wan", "hunyuan_video" or "ltxv"
    filename: str
    model_config_class: str  # class name in comfy.supported_models that detection must pick
    text_dim: int  # width of the CONDITIONING tensor the model consumes
    latent_channels: int
    pooled_dim: int | None = None  # width of "pooled_output" when the model needs one


WAN = TinyModelSpec("wan", "tiny_wan21_t2v.safetensors", "WAN21_T2V", text_dim=4096, latent_channels=16)
HUNYUAN_VIDEO = TinyModelSpec(
    "hunyuan_video", "tiny_hunyuan_video_t2v.safetensors", "HunyuanVideo", text_dim=4096, latent_channels=16, pooled_dim=768
)
LTXV = TinyModelSpec("ltxv", "tiny_ltxv_t2v.safetensors", "LTXV", text_dim=4096, latent_channels=128)
SPECS: dict[str, TinyModelSpec] = {s.family: s for s in (WAN, HUNYUAN_VIDEO, LTXV)}


def _wan_module() -> torch.nn.Module:
    """Wan 2.1 T2V: head size is fixed at 128 by detection (num_heads = dim // 128)."""
    from comfy.ldm.wan.model import WanModel

    return WanModel(
        model_type="t2v", patch_size=(1, 2, 2), in_dim=16, dim=128, ffn_dim=256, freq_dim=256,
        text_dim=4096, out_dim=16, num_heads=1, num_layers=2, device="meta", operations=_ops(),
    )


# HunyuanVideoParams fields that newer hosts require, with the values detection gives a plain T2V model.
_HUNYUAN_VIDEO_PLAIN_T2V = {"use_cond_type_embedding": False, "vision_in_dim": None, "meanflow_sum": False}


def _hunyuan_video_module() -> torch.nn.Module:
    """HunyuanVideo T2V: detection fixes head size 128 (axes 16+56+56), CLIP-L pooled vector and guidance input.

    Optional fields are passed only where the host's HunyuanVideoParams declares them (it grows over releases).
    """
    import dataclasses

    from comfy.ldm.hunyuan_video.model import HunyuanVideo, HunyuanVideoParams

    declared = {field.name for field in dataclasses.fields(HunyuanVideoParams)}
    extra = {name: value for name, value in _HUNYUAN_VIDEO_PLAIN_T2V.items() if name in declared}
    return HunyuanVideo(
        in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096, hidden_size=128, mlp_ratio=4.0,
        num_heads=1, depth=1, depth_single_blocks=1, axes_dim=[16, 56, 56], theta=256, patch_size=[1, 2, 2],
        qkv_bias=True, guidance_embed=True, byt5=False, meanflow=False, device="meta", operations=_ops(), **extra,
    )


def _ltxv_module() -> torch.nn.Module:
    """LTX-Video: detection fixes 32 heads and reads head size from attn2.to_k; text projection takes 4096."""
    from comfy.ldm.lightricks.model import LTXVModel

    return LTXVModel(
        in_channels=128, cross_attention_dim=128, attention_head_dim=4, num_attention_heads=32,
        caption_channels=4096, num_layers=2, device="meta", operations=_ops(),
    )


_MODULES = {"wan": _wan_module, "hunyuan_video": _hunyuan_video_module, "ltxv": _ltxv_module}


def _ops():
    import comfy.ops

    return comfy.ops.disable_weight_init


def _fill(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """Norm scales 1, vectors small, matrices scaled by fan-in: activations stay O(1) through every layer."""
    if len(shape) == 1 and ("norm" in name or name.endswith(".scale")):
        return torch.ones(shape)
    if len(shape) < 2 or "modulation" in name or "scale_shift_table" in name:
        return torch.randn(shape, generator=generator) * 0.02
    fan_in = shape[1:].numel()
    return torch.randn(shape, generator=generator) / fan_in**0.5


def tiny_state_dict(family: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """The full state dict of a tiny `family` model, identical for identical seeds."""
    module = _MODULES[family]()
    generator = torch.Generator().manual_seed(seed)
    shapes = {name: t.shape for name, t in module.state_dict().items()}
    return {name: _fill(name, shapes[name], generator).contiguous() for name in sorted(shapes)}


def write_tiny_model(family: str, directory: Path, seed: int = 0, filename: str | None = None) -> Path:
    """Write a tiny `family` model as safetensors into `directory` (e.g. models/diffusion_models)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (filename or SPECS[family].filename)
    save_file(tiny_state_dict(family, seed), str(path))
    return path


def write_all(directory: Path, seed: int = 0) -> dict[str, Path]:
    """Write the Wan, HunyuanVideo and LTX-Video tiny models; returns family -> path."""
    return {family: write_tiny_model(family, directory, seed) for family in SPECS}

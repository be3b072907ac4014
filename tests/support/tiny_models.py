"""Tiny random-weight text-to-video diffusion models that ComfyUI's own loader detects.

Each builder instantiates ComfyUI's real model class with the smallest config that
`comfy.model_detection` infers back from the weights, on the meta device, then fills every
tensor from a seeded generator. Taking the key set from the host's model class (not a
hand-written key list) keeps the files loadable when upstream adds or renames a layer, and
leaves no key for the loader to skip (a skipped key would stay uninitialised memory).

`SPECS` are the models every host has (the `tiny_models` fixture writes them all); `CURRENT_SPECS` are models of
newer hosts (Wan 2.2 TI2V 5B, HunyuanVideo 1.5, LTX-2 audio+video), written one at a time on first use, and only
where the host has the model config class (`host_lacks`). `WAN_I2V` and the Wan 2.1 VAE (`WAN21_VAE`) are written by
the image-to-video test that needs them; the LTX VAE (`LTX_VAE`) and LTX-2's latent upsamplers (`LTX2_UPSAMPLERS`) by
the servers that run the LTX-2 workflow's two stages.

Requires ComfyUI to be importable and configured (the in-process host does that).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file


@dataclass(frozen=True)
class TinyModelSpec:
    """What a tiny model file is and what a test needs to drive it."""

    family: str  # "wan", "hunyuan_video", "ltxv"; "wan22", "hunyuan_video15", "ltxav"
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

WAN22 = TinyModelSpec("wan22", "tiny_wan22_ti2v.safetensors", "WAN22_T2V", text_dim=4096, latent_channels=48)
HUNYUAN_VIDEO15 = TinyModelSpec(
    "hunyuan_video15", "tiny_hunyuan_video15_t2v.safetensors", "HunyuanVideo15", text_dim=4096, latent_channels=32
)
# text_dim: LTX-2 takes its text already through the embeddings connectors, video and audio halves side by side.
LTXAV = TinyModelSpec("ltxav", "tiny_ltx2_av.safetensors", "LTXAV", text_dim=4096, latent_channels=128)
# HunyuanVideo 1.5's super-resolution model: the 1.5 transformer taking the upscaled video in its conditioning
HUNYUAN_VIDEO15_SR = TinyModelSpec("hunyuan_video15_sr", "tiny_hunyuan_video15_sr.safetensors",
                                   "HunyuanVideo15_SR_Distilled", text_dim=4096, latent_channels=32)
CURRENT_SPECS: dict[str, TinyModelSpec] = {s.family: s for s in (WAN22, HUNYUAN_VIDEO15, LTXAV, HUNYUAN_VIDEO15_SR)}


def host_lacks(spec: TinyModelSpec) -> str:
    """Why this host cannot load `spec` ("" when it can): its model config class is not in comfy.supported_models."""
    import comfy.supported_models

    if hasattr(comfy.supported_models, spec.model_config_class):
        return ""
    return f"this ComfyUI has no comfy.supported_models.{spec.model_config_class} (the {spec.family} model)"


def _wan_module(channels: int = 16, image_channels: int = 0) -> torch.nn.Module:
    """Wan T2V (2.1: 16 latent channels; 2.2 TI2V 5B: 48, its VAE's), or with `image_channels` taken beside the
    latent (image-to-video): detection fixes head size 128 (num_heads = dim // 128)."""
    from comfy.ldm.wan.model import WanModel

    return WanModel(
        model_type="t2v", patch_size=(1, 2, 2), in_dim=channels + image_channels, dim=128, ffn_dim=256, freq_dim=256,
        text_dim=4096, out_dim=channels, num_heads=1, num_layers=2, device="meta", operations=_ops(),
    )


# HunyuanVideo T2V: detection fixes head size 128 (axes 16+56+56); 1.0 has the CLIP-L pooled vector and guidance
# input. HunyuanVideoParams fields that newer hosts require get the values detection gives a 1.0 model.
_HUNYUAN_VIDEO_T2V = {
    "in_channels": 16, "out_channels": 16, "vec_in_dim": 768, "context_in_dim": 4096, "hidden_size": 128,
    "mlp_ratio": 4.0, "num_heads": 1, "depth": 1, "depth_single_blocks": 1, "axes_dim": [16, 56, 56], "theta": 256,
    "patch_size": [1, 2, 2], "qkv_bias": True, "guidance_embed": True, "byt5": False, "meanflow": False,
    "use_cond_type_embedding": False, "vision_in_dim": None, "meanflow_sum": False,
}
# HunyuanVideo 1.5 T2V: 32-channel latent plus the image-condition channels and mask (65 in), patch 1, double blocks
# only, no pooled vector or guidance input, the SigLIP vision input (1152, which detection requires) and the
# condition-type embedding. Its ByT5 glyph input is optional to detection and left out (the tests pass no ByT5 text).
_HUNYUAN_VIDEO15_T2V = {
    **_HUNYUAN_VIDEO_T2V, "in_channels": 65, "out_channels": 32, "vec_in_dim": None, "depth": 2,
    "depth_single_blocks": 0, "patch_size": [1, 1, 1], "guidance_embed": False, "use_cond_type_embedding": True,
    "vision_in_dim": 1152, "meanflow_sum": True,
}
# Its super-resolution model: the latent, then the low-resolution video, its mask and a second mask (98 in), which
# is how detection tells it from the T2V model.
_HUNYUAN_VIDEO15_SR = {**_HUNYUAN_VIDEO15_T2V, "in_channels": 98}


def _hunyuan_video_module(params: dict) -> torch.nn.Module:
    """HunyuanVideo with `params`; fields the host's HunyuanVideoParams does not declare (it grows over releases)
    are left out."""
    from comfy.ldm.hunyuan_video.model import HunyuanVideo, HunyuanVideoParams

    declared = {field.name for field in dataclasses.fields(HunyuanVideoParams)}
    return HunyuanVideo(**{name: value for name, value in params.items() if name in declared}, device="meta",
                        operations=_ops())


def _ltxv_module() -> torch.nn.Module:
    """LTX-Video: detection fixes 32 heads and reads head size from attn2.to_k; text projection takes 4096."""
    from comfy.ldm.lightricks.model import LTXVModel

    return LTXVModel(
        in_channels=128, cross_attention_dim=128, attention_head_dim=4, num_attention_heads=32,
        caption_channels=4096, num_layers=2, device="meta", operations=_ops(),
    )


# LTX-2's transformer settings that detection cannot read from the weights; like the released checkpoints, the file
# carries them in its safetensors metadata ("config" -> "transformer"). Audio stream 8 heads x 8; text arrives
# processed (2 x caption_channels wide), so the embeddings connectors are present but small.
_LTXAV_TRANSFORMER = {
    "audio_num_attention_heads": 8, "audio_attention_head_dim": 8, "audio_cross_attention_dim": 64,
    "caption_channels": 2048, "connector_num_attention_heads": 1, "connector_attention_head_dim": 16,
    "connector_num_layers": 1,
}


def _ltxav_module() -> torch.nn.Module:
    """LTX-2 audio+video: video stream as detection reads it (32 heads, head size from attn2.to_k), 2 blocks."""
    from comfy.ldm.lightricks.av_model import LTXAVModel

    return LTXAVModel(
        in_channels=128, cross_attention_dim=128, attention_head_dim=4, num_attention_heads=32, num_layers=2,
        device="meta", operations=_ops(), **_LTXAV_TRANSFORMER,
    )


def _wan21_vae_module() -> torch.nn.Module:
    """The Wan 2.1 VAE at the width every host's loader builds (96): the one VAE image-to-video encodes its start
    image with at 16 latent channels; random weights."""
    from comfy.ldm.wan.vae import WanVAE

    with torch.device("meta"):
        return WanVAE(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                      temperal_downsample=[False, True, True], dropout=0.0)


# ComfyUI's models/vae: the Wan 2.1 VAE (`write_tiny_model("wan21_vae", ...)`)
WAN21_VAE = "tiny_wan21_vae.safetensors"
# Wan image-to-video (the 2.2 14B I2V experts' shape): 16 latent channels plus the start image's 16 and a 4-channel
# mask in (36), no CLIP vision input; detection reads it as a Wan model with image channels in its conditioning
WAN_I2V = TinyModelSpec("wan_i2v", "tiny_wan_i2v.safetensors", "WAN21_T2V", text_dim=4096, latent_channels=16)


def _hunyuan_video15_upsampler_module() -> torch.nn.Module:
    """HunyuanVideo 1.5's latent upsampler of the residual-convolution kind (the loader tells the kinds apart by their
    keys and reads the sizes from the weights): 32 latent channels in and out, 8 hidden, one block."""
    from comfy.ldm.hunyuan_video.upsampler import SRModel3DV2

    return SRModel3DV2(in_channels=32, out_channels=32, hidden_channels=8, num_blocks=1)


# ComfyUI's models/latent_upscale_models: two tiny HunyuanVideo 1.5 latent upsamplers, other weights (written with
# seeds 0 and 1), as two upsampler files a workflow may switch between
HUNYUAN_VIDEO15_UPSAMPLERS = ("tiny_hunyuan_video15_latent_upsampler.safetensors",
                              "tiny_hunyuan_video15_latent_upsampler_other.safetensors")

# The LTX video VAE as the loader builds it from the "vae" config in a file's metadata: 128 latent channels, one
# residual block each way at 32 channels. Only its per-channel latent statistics are read at test size (LTX-2's
# latent upsampler un-normalises and re-normalises with them); nothing is encoded or decoded with it.
_LTX_VAE = {"dims": 3, "latent_channels": 128, "blocks": [["res_x", 1]], "encoder_base_channels": 32,
            "decoder_base_channels": 32, "patch_size": 4, "norm_layer": "pixel_norm", "latent_log_var": "uniform",
            "causal_decoder": False}
# LTX-2's spatial latent upsampler (x2) as the loader builds it from the "config" in a file's metadata: 128 latent
# channels, 32 hidden, one residual block before and after the upsampling
_LTX2_UPSAMPLER = {"_class_name": "LatentUpsampler", "in_channels": 128, "mid_channels": 32,
                   "num_blocks_per_stage": 1, "dims": 3, "spatial_upsample": True, "temporal_upsample": False}


def _ltx_vae_module() -> torch.nn.Module:
    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE

    with torch.device("meta"):
        return VideoVAE(config=_LTX_VAE)


def _ltx2_upsampler_module() -> torch.nn.Module:
    import comfy.ops
    from comfy.ldm.lightricks.latent_upsampler import LatentUpsampler

    with torch.device("meta"):
        return LatentUpsampler.from_config(_LTX2_UPSAMPLER, operations=comfy.ops.disable_weight_init)


# ComfyUI's models/vae: the LTX video VAE LTX-2's checkpoint carries (`write_tiny_model("ltx_vae", ...)`)
LTX_VAE = "tiny_ltx_vae.safetensors"
# ComfyUI's models/latent_upscale_models: two tiny LTX-2 spatial upsamplers, other weights (seeds 0 and 1); the first
# under the file name the shipped LTX-2 workflow loads
LTX2_UPSAMPLERS = ("ltx-2-spatial-upscaler-x2-1.0.safetensors", "tiny_ltx2_spatial_upscaler_other.safetensors")

_MODULES = {
    "wan": _wan_module, "hunyuan_video": functools.partial(_hunyuan_video_module, _HUNYUAN_VIDEO_T2V),
    "ltxv": _ltxv_module, "wan22": functools.partial(_wan_module, 48),
    "hunyuan_video15": functools.partial(_hunyuan_video_module, _HUNYUAN_VIDEO15_T2V), "ltxav": _ltxav_module,
    "hunyuan_video15_sr": functools.partial(_hunyuan_video_module, _HUNYUAN_VIDEO15_SR),
    "hunyuan_video15_upsampler": _hunyuan_video15_upsampler_module,
    "wan_i2v": functools.partial(_wan_module, 16, 20), "wan21_vae": _wan21_vae_module,
    "ltx_vae": _ltx_vae_module, "ltx2_upsampler": _ltx2_upsampler_module,
}
_METADATA = {"ltxav": {"config": json.dumps({"transformer": _LTXAV_TRANSFORMER})},
             "ltx_vae": {"config": json.dumps({"vae": _LTX_VAE})},
             "ltx2_upsampler": {"config": json.dumps(_LTX2_UPSAMPLER)}}
# Tensors that start at 1: the Wan VAE's RMS norm scales (`gamma`, one per channel), so that its encoding keeps its
# input's differences; the LTX VAE's per-channel latent deviations, which latents are divided by
_STARTING_AT_ONE = {"wan21_vae": ".gamma", "ltx_vae": "std-of-means"}


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
    ones = _STARTING_AT_ONE.get(family)
    return {name: (torch.ones(shapes[name]) if ones and name.endswith(ones) else _fill(name, shapes[name], generator))
            .contiguous() for name in sorted(shapes)}


def write_tiny_model(family: str, directory: Path, seed: int = 0, filename: str | None = None) -> Path:
    """Write a tiny `family` model as safetensors into `directory` (e.g. models/diffusion_models; a family that is not
    a diffusion model, such as an upsampler, needs its `filename`)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (filename or {**SPECS, **CURRENT_SPECS, WAN_I2V.family: WAN_I2V}[family].filename)
    save_file(tiny_state_dict(family, seed), str(path), metadata=_METADATA.get(family))
    return path


def write_ltx2_stage_models(models: Path) -> None:
    """What LTX-2's workflow reads between its stages, into ComfyUI's `models` directory: the LTX VAE (vae/) and both
    latent upsamplers (latent_upscale_models/)."""
    write_tiny_model("ltx_vae", models / "vae", filename=LTX_VAE)
    for seed, filename in enumerate(LTX2_UPSAMPLERS):
        write_tiny_model("ltx2_upsampler", models / "latent_upscale_models", seed=seed, filename=filename)


def write_all(directory: Path, seed: int = 0) -> dict[str, Path]:
    """Write the Wan, HunyuanVideo and LTX-Video tiny models; returns family -> path."""
    return {family: write_tiny_model(family, directory, seed) for family in SPECS}

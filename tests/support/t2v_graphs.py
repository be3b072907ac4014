"""API-format prompts shaped like ComfyUI's official text-to-video templates, at test size.

- Wan 2.1:      UNETLoader -> ModelSamplingSD3 -> KSampler                        (EmptyHunyuanLatentVideo)
- HunyuanVideo: UNETLoader -> ModelSamplingSD3 -> BasicGuider(FluxGuidance) -> SamplerCustomAdvanced
- LTX-Video:    UNETLoader -> SamplerCustom with LTXVConditioning and LTXVScheduler (EmptyLTXVLatentVideo)
- Wan I2V:      the Wan 2.1 chain on WanImageToVideo, a plain start frame encoded by the Wan 2.1 VAE

and, for the models of newer hosts (`CURRENT_GRAPHS`), the templates of Wan 2.2 TI2V 5B, HunyuanVideo 1.5 and LTX-2:

- Wan 2.2 5B:   the Wan 2.1 chain on a 48-channel Wan22ImageToVideoLatent (no start image: the VAE it takes is
                not read, so the pixel-space VAE stands in for Wan 2.2's)
- HunyuanVideo 1.5: SamplerCustomAdvanced with CFGGuider (positive and negative) on EmptyHunyuanVideo15Latent
- LTX-2:        the LTX-Video chain on LTXVConcatAVLatent(video, audio), split again by LTXVSeparateAVLatent; the
                empty audio latent is a LoadLatent of `LTX2_AUDIO_LATENT` (a file of zeros, as LTXVEmptyLatentAudio
                makes, shaped `ltx2_audio_latent_shape`), since there is no audio VAE at test size

Text encoders are replaced by the harness pack's `HarnessTextConditioning`; every graph ends in
`HarnessLatentStats` so the executor and /history report the sampled latent. Node ids are names,
so a test can splice a Carnator node in: `g[SAMPLER]["inputs"]["model"] = ["carnator_node", 0]`.
"""

from __future__ import annotations

import math

MODEL = "model"  # UNETLoader
POSITIVE = "positive"
NEGATIVE = "negative"
LATENT = "latent"  # empty latent video
SAMPLER = "sampler"  # the node whose output 0 is the sampled LATENT
STATS = "stats"  # HarnessLatentStats (output node)


def _node(class_type: str, **inputs) -> dict:
    return {"class_type": class_type, "inputs": inputs}


def _text(text: str, family: str, seed: int) -> dict:
    return _node("HarnessTextConditioning", text=text, family=family, seed=seed)


def wan_t2v(
    unet_name: str, *, text: str = "a red ball rolls left", negative: str = "blurry", width: int = 64,
    height: int = 64, length: int = 5, batch_size: int = 1, steps: int = 2, cfg: float = 5.0, seed: int = 0,
    sampler_name: str = "uni_pc", scheduler: str = "simple", shift: float = 8.0,
) -> dict:
    """Wan 2.1 T2V template: KSampler with CFG over a shifted flow model."""
    return {
        MODEL: _node("UNETLoader", unet_name=unet_name, weight_dtype="default"),
        "model_sampling": _node("ModelSamplingSD3", model=[MODEL, 0], shift=shift),
        POSITIVE: _text(text, "wan", 0),
        NEGATIVE: _text(negative, "wan", 0),
        LATENT: _node("EmptyHunyuanLatentVideo", width=width, height=height, length=length, batch_size=batch_size),
        SAMPLER: _node(
            "KSampler", model=["model_sampling", 0], seed=seed, steps=steps, cfg=cfg, sampler_name=sampler_name,
            scheduler=scheduler, positive=[POSITIVE, 0], negative=[NEGATIVE, 0], latent_image=[LATENT, 0], denoise=1.0,
        ),
        STATS: _node("HarnessLatentStats", latent=[SAMPLER, 0]),
    }


def hunyuan_video_t2v(
    unet_name: str, *, text: str = "a red ball rolls left", width: int = 64, height: int = 64, length: int = 5,
    batch_size: int = 1, steps: int = 2, guidance: float = 6.0, seed: int = 0, sampler_name: str = "euler",
    scheduler: str = "simple", shift: float = 7.0,
) -> dict:
    """HunyuanVideo T2V template: guidance-distilled, no negative; SamplerCustomAdvanced with BasicGuider."""
    return {
        MODEL: _node("UNETLoader", unet_name=unet_name, weight_dtype="default"),
        "model_sampling": _node("ModelSamplingSD3", model=[MODEL, 0], shift=shift),
        POSITIVE: _text(text, "hunyuan_video", 0),
        "guidance": _node("FluxGuidance", conditioning=[POSITIVE, 0], guidance=guidance),
        "guider": _node("BasicGuider", model=["model_sampling", 0], conditioning=["guidance", 0]),
        "noise": _node("RandomNoise", noise_seed=seed),
        "ksampler_select": _node("KSamplerSelect", sampler_name=sampler_name),
        "sigmas": _node("BasicScheduler", model=["model_sampling", 0], scheduler=scheduler, steps=steps, denoise=1.0),
        LATENT: _node("EmptyHunyuanLatentVideo", width=width, height=height, length=length, batch_size=batch_size),
        SAMPLER: _node(
            "SamplerCustomAdvanced", noise=["noise", 0], guider=["guider", 0], sampler=["ksampler_select", 0],
            sigmas=["sigmas", 0], latent_image=[LATENT, 0],
        ),
        STATS: _node("HarnessLatentStats", latent=[SAMPLER, 0]),
    }


def ltxv_t2v(
    unet_name: str, *, text: str = "a red ball rolls left", negative: str = "blurry", width: int = 64,
    height: int = 64, length: int = 9, batch_size: int = 1, steps: int = 2, cfg: float = 3.0, seed: int = 0,
    sampler_name: str = "euler", frame_rate: float = 25.0,
) -> dict:
    """LTX-Video T2V template: SamplerCustom with CFG, LTXVConditioning and the token-count-aware LTXVScheduler."""
    return {
        MODEL: _node("UNETLoader", unet_name=unet_name, weight_dtype="default"),
        POSITIVE: _text(text, "ltxv", 0),
        NEGATIVE: _text(negative, "ltxv", 0),
        "conditioning": _node("LTXVConditioning", positive=[POSITIVE, 0], negative=[NEGATIVE, 0], frame_rate=frame_rate),
        LATENT: _node("EmptyLTXVLatentVideo", width=width, height=height, length=length, batch_size=batch_size),
        "ksampler_select": _node("KSamplerSelect", sampler_name=sampler_name),
        "sigmas": _node(
            "LTXVScheduler", steps=steps, max_shift=2.05, base_shift=0.95, stretch=True, terminal=0.1, latent=[LATENT, 0]
        ),
        SAMPLER: _node(
            "SamplerCustom", model=[MODEL, 0], add_noise=True, noise_seed=seed, cfg=cfg, positive=["conditioning", 0],
            negative=["conditioning", 1], sampler=["ksampler_select", 0], sigmas=["sigmas", 0], latent_image=[LATENT, 0],
        ),
        STATS: _node("HarnessLatentStats", latent=[SAMPLER, 0]),
    }


GRAPHS = {"wan": wan_t2v, "hunyuan_video": hunyuan_video_t2v, "ltxv": ltxv_t2v}


def wan22_ti2v(unet_name: str, *, width: int = 64, height: int = 64, length: int = 5, **options) -> dict:
    """Wan 2.2 TI2V 5B text-to-video template: `wan_t2v`'s sampler on a 48-channel latent (16x spatial)."""
    graph = wan_t2v(unet_name, **options)
    graph["vae"] = _node("VAELoader", vae_name="pixel_space")
    graph[LATENT] = _node("Wan22ImageToVideoLatent", vae=["vae", 0], width=width, height=height, length=length,
                          batch_size=1)
    return graph


def wan_i2v(unet_name: str, vae_name: str, *, start_color: int, width: int = 64, height: int = 64, length: int = 5,
            **options) -> dict:
    """Wan image-to-video template (the 2.2 14B I2V shape, one model): `wan_t2v`'s sampler, its conditioning and
    empty latent from WanImageToVideo, which encodes the start image (a plain `start_color` frame) with the Wan VAE
    into the conditioning's `concat_latent_image`."""
    graph = wan_t2v(unet_name, width=width, height=height, length=length, **options)
    graph["vae"] = _node("VAELoader", vae_name=vae_name)
    graph["start_image"] = _node("EmptyImage", width=width, height=height, batch_size=1, color=start_color)
    graph["image_to_video"] = _node("WanImageToVideo", positive=[POSITIVE, 0], negative=[NEGATIVE, 0], vae=["vae", 0],
                                    width=width, height=height, length=length, batch_size=1,
                                    start_image=["start_image", 0])
    del graph[LATENT]
    graph[SAMPLER]["inputs"].update(positive=["image_to_video", 0], negative=["image_to_video", 1],
                                    latent_image=["image_to_video", 2])
    return graph


def hunyuan_video15_t2v(unet_name: str, *, negative: str = "blurry", cfg: float = 6.0, **options) -> dict:
    """HunyuanVideo 1.5 T2V template: CFG with a negative (no guidance distillation) on a 32-channel latent
    (16x spatial); otherwise `hunyuan_video_t2v`'s SamplerCustomAdvanced chain."""
    graph = hunyuan_video_t2v(unet_name, **options)
    del graph["guidance"]
    graph[NEGATIVE] = _text(negative, "hunyuan_video", 0)
    graph["guider"] = _node("CFGGuider", model=["model_sampling", 0], positive=[POSITIVE, 0],
                            negative=[NEGATIVE, 0], cfg=cfg)
    graph[LATENT]["class_type"] = "EmptyHunyuanVideo15Latent"
    return graph


def hunyuan_video15_sr(unet_name: str, *, low_resolution: str, **options) -> dict:
    """HunyuanVideo 1.5's super-resolution stage as the 720p template's (bypassed) group builds it, on a loaded
    low-resolution latent (`low_resolution`, in ComfyUI's input directory): HunyuanVideo15SuperResolution puts it into
    the conditioning, and the SR model samples from noise at shift 2, cfg 1."""
    graph = hunyuan_video15_t2v(unet_name, **{"cfg": 1.0, "shift": 2.0, **options})
    graph["low_resolution"] = _node("LoadLatent", latent=low_resolution)
    graph["super_resolution"] = _node("HunyuanVideo15SuperResolution", positive=[POSITIVE, 0], negative=[NEGATIVE, 0],
                                      latent=["low_resolution", 0], noise_augmentation=0.7)
    graph["guider"]["inputs"].update(positive=["super_resolution", 0], negative=["super_resolution", 1])
    graph[SAMPLER]["inputs"]["latent_image"] = ["super_resolution", 2]
    del graph[LATENT]
    return graph


LTX2_AUDIO_LATENT = "tiny_ltx2_audio.latent"  # in ComfyUI's input directory


def ltx2_audio_latent_shape(length: int = 9, frame_rate: float = 25.0, batch_size: int = 1) -> tuple[int, ...]:
    """What LTXVEmptyLatentAudio gives for `length` video frames with LTX-2's audio VAE: 8 channels x 16 frequency
    bins, 25 latents per second."""
    return batch_size, 8, math.ceil(length / frame_rate * 25), 16


def ltx2_av_t2v(unet_name: str, *, audio_latent: str = LTX2_AUDIO_LATENT, **options) -> dict:
    """LTX-2 audio+video T2V template: `ltxv_t2v`'s sampler on the video and audio latents packed into one; STATS
    reports the video half."""
    graph = ltxv_t2v(unet_name, **options)
    graph["audio_latent"] = _node("LoadLatent", latent=audio_latent)
    graph["av_latent"] = _node("LTXVConcatAVLatent", video_latent=[LATENT, 0], audio_latent=["audio_latent", 0])
    graph[SAMPLER]["inputs"]["latent_image"] = ["av_latent", 0]
    graph["separate"] = _node("LTXVSeparateAVLatent", av_latent=[SAMPLER, 0])
    graph[STATS] = _node("HarnessLatentStats", latent=["separate", 0])
    return graph


CURRENT_GRAPHS = {"wan22": wan22_ti2v, "hunyuan_video15": hunyuan_video15_t2v, "ltxav": ltx2_av_t2v}


HIGH_NOISE = "high_noise"  # KSamplerAdvanced of the high-noise expert (stage 1)
LOW_NOISE = SAMPLER  # KSamplerAdvanced of the low-noise expert (stage 2): its output is the request's latent


def wan22_14b_t2v(high_noise_unet: str, low_noise_unet: str, *, text: str = "a red ball rolls left",
                  negative: str = "blurry", width: int = 64, height: int = 64, length: int = 5, steps: int = 4,
                  boundary: int = 2, cfg: float = 1.0, seed: int = 0, sampler_name: str = "euler",
                  scheduler: str = "simple", shift: float = 5.0) -> dict:
    """Wan 2.2 14B T2V template: a high-noise and a low-noise expert, each UNETLoader -> ModelSamplingSD3, and two
    KSamplerAdvanced. The first runs steps 0 -> `boundary` adding the noise and returning it with leftover noise, the
    second continues to `steps` without adding noise (the lightx2v 4-step graph: steps 4, boundary 2, cfg 1). Each
    expert's chain ends in a `HarnessCountCalls`, so a test counts the forwards of each."""
    def sampler(model: str, latent: list, first: bool) -> dict:
        return _node("KSamplerAdvanced", model=[model, 0], add_noise="enable" if first else "disable",
                     noise_seed=seed, steps=steps, cfg=cfg, sampler_name=sampler_name, scheduler=scheduler,
                     positive=[POSITIVE, 0], negative=[NEGATIVE, 0], latent_image=latent,
                     start_at_step=0 if first else boundary, end_at_step=boundary if first else 10000,
                     return_with_leftover_noise="enable" if first else "disable")

    return {
        "high_noise_model": _node("UNETLoader", unet_name=high_noise_unet, weight_dtype="default"),
        "low_noise_model": _node("UNETLoader", unet_name=low_noise_unet, weight_dtype="default"),
        "high_noise_shift": _node("ModelSamplingSD3", model=["high_noise_model", 0], shift=shift),
        "low_noise_shift": _node("ModelSamplingSD3", model=["low_noise_model", 0], shift=shift),
        # counts each expert's forwards (HarnessCountCalls: `model_calls["high_noise"]` / `["low_noise"]`)
        "high_noise_sampling": _node("HarnessCountCalls", model=["high_noise_shift", 0], label="high_noise"),
        "low_noise_sampling": _node("HarnessCountCalls", model=["low_noise_shift", 0], label="low_noise"),
        POSITIVE: _text(text, "wan", 0),
        NEGATIVE: _text(negative, "wan", 0),
        LATENT: _node("EmptyHunyuanLatentVideo", width=width, height=height, length=length, batch_size=1),
        HIGH_NOISE: sampler("high_noise_sampling", [LATENT, 0], first=True),
        LOW_NOISE: sampler("low_noise_sampling", [HIGH_NOISE, 0], first=False),
        STATS: _node("HarnessLatentStats", latent=[LOW_NOISE, 0]),
    }

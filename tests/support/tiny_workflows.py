"""The shipped API-format workflows (workflows/api/) made runnable on the tiny test models.

The shipped workflows name the official models (Wan 2.1 1.3B, Wan 2.2 14B and 5B, HunyuanVideo 720p, HunyuanVideo 1.5
720p, LTX-Video 2B, LTX-2 19B) with their text encoders, VAEs, LoRAs and latent upscalers, or the embedded demo model.
The tests run them on the random-weight tiny models instead, changing only what cannot exist at test size, by node
type:

- UNETLoader / CheckpointLoaderSimple        -> UNETLoader of the tiny model of the workflow's family; a loader of a
                                                low-noise expert (Wan 2.2 14B: "low_noise" in its file name) loads
                                                `low_noise_unet`, a second tiny model of the family (other weights);
                                                a super-resolution model's loader (HunyuanVideo 1.5's, "_sr_" in its
                                                file name) loads the tiny HunyuanVideo 1.5 SR model; what reads
                                                a checkpoint's VAE reads a VAELoader of the tiny LTX VAE (LTX-2's
                                                latent upsampler reads its latent statistics)
- LoraLoaderModelOnly                         -> removed, its model input linked through to its consumers (the
                                                lightx2v LoRA files have no tiny counterpart)
- CLIPLoader, DualCLIPLoader,                 -> removed (no text encoders at test size)
  LTXAVTextEncoderLoader
- VAELoader                                   -> the pixel-space VAE (Wan22ImageToVideoLatent takes a VAE and reads
                                                it only for a start image, which the shipped workflows leave out)
- CLIPTextEncode(text, clip)                  -> HarnessTextConditioning(text, family): same text, same socket
- LTXVAudioVAELoader, LTXVAudioVAEDecode      -> removed (no audio VAE at test size)
- LTXVEmptyLatentAudio                        -> LoadLatent of `LTX2_AUDIO_LATENT` (zeros shaped as LTX-2's empty
                                                audio latent for the test video length; the test writes it into
                                                ComfyUI's input directory)
- LatentUpscaleModelLoader                    -> the first tiny latent upsampler of the model's family (HunyuanVideo
                                                1.5's, LTX-2's): LTX-2's refinement samples twice the first stage's
                                                width and height, as shipped
- HunyuanVideo15LatentUpscaleWithModel        -> upscales the tiny video to twice its width and height: the SR stage
                                                samples 4x the first stage's tokens
- VAEDecode(Tiled), CreateVideo, SaveVideo    -> removed; HarnessLatentStats reads each sampler's latent (a packed
                                                audio+video latent: the video latent LTXVSeparateAVLatent unpacks)
- empty latent video size and step counts     -> small (seconds on a CPU); KSamplerAdvanced keeps its shipped steps
                                                and hand-over step (Wan 2.2 14B: 4 steps, experts split at 2), and
                                                so does a scheduler whose sigmas SplitSigmas splits (HunyuanVideo
                                                1.5's super-resolution: 8 steps, split at 4)
- optional `reuse` overrides                  -> set on every Carnator reuse node (e.g. probe thresholds: a
                                                 random-weight model has no semantics, so near-duplicate
                                                 prompts need lower structure thresholds to pass its probe)

Everything else — Carnator nodes, samplers, schedulers (LTX-2's ManualSigmas too), guiders, LTX-2's latent upsampler,
concatenation, separation and guide cropping, the demo text encoder and decoder (they work on any Wan-family
latent), primitives, links — runs as shipped. A shipped workflow's bypassed nodes (HunyuanVideo 1.5's 1080p
super-resolution group and EasyCache, LTX-2's camera LoRAs) are not in its API twin, as the frontend leaves them
out of what it queues. `GROUP_ENABLED` twins are a workflow as queued with one of those groups enabled.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from carnator_core.demo.graphs import latent_size
from carnator_core.lookup.prompt_text import is_link
from support.t2v_graphs import LTX2_AUDIO_LATENT
from support.tiny_models import HUNYUAN_VIDEO15_SR, HUNYUAN_VIDEO15_UPSAMPLERS, LTX2_UPSAMPLERS, LTX_VAE

WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"
FAMILY = {  # shipped workflow -> tiny model family it runs on
    "carnator_wan21_t2v": "wan",
    "carnator_hunyuan_video_t2v": "hunyuan_video",
    "carnator_ltxv_t2v": "ltxv",
    "carnator_demo_cpu": "wan",
    "carnator_explicit_control": "wan",
    "carnator_calibrate_demo": "wan",
    "carnator_wan22_14b_t2v": "wan",
    "carnator_wan22_5b_ti2v": "wan22",
    "carnator_hunyuan_video15_720p_t2v": "hunyuan_video15",
    "carnator_ltx2_t2v": "ltxav",
}
# API twins of a shipped UI workflow with a group its template bypasses enabled, as the user enables it (the group's
# EasyCache stays bypassed, as the template's note keeps it): twin -> (UI workflow, group title, tiny models besides
# the workflow's family)
GROUP_ENABLED = {
    "carnator_hunyuan_video15_720p_t2v_sr": ("carnator_hunyuan_video15_720p_t2v", "Video Upscale 1080P",
                                             (HUNYUAN_VIDEO15_SR.family,)),
}
SAMPLERS = ("KSampler", "KSamplerAdvanced", "SamplerCustom", "SamplerCustomAdvanced", "CarnatorKSampler")
REUSE_NODES = ("CarnatorReuse", "CarnatorKSampler", "CarnatorReuseSampler")
_REMOVED = ("CLIPLoader", "DualCLIPLoader", "LTXAVTextEncoderLoader", "LTXVAudioVAELoader", "LTXVAudioVAEDecode",
            "VAEDecode", "VAEDecodeTiled", "CreateVideo", "SaveVideo")
# removed; what reads its output reads this input's source
_PASSED_THROUGH = {"LoraLoaderModelOnly": "model"}
_CHECKPOINT_VAE = 2  # CheckpointLoaderSimple's VAE output
SUPER_RESOLUTION = "_sr_"  # in the file name of a super-resolution model
_LATENT_SIZE = {"EmptyHunyuanLatentVideo": (64, 64, 5), "EmptyLTXVLatentVideo": (64, 64, 9),
                "Wan22ImageToVideoLatent": (64, 64, 5), "EmptyHunyuanVideo15Latent": (64, 64, 5)}
# tiny model family -> HarnessTextConditioning family (its text encoder)
_TEXT_FAMILY = {"wan22": "wan", "hunyuan_video15": "hunyuan_video", "ltxav": "ltxv"}
_STEPS = {"KSampler": "steps", "CarnatorKSampler": "steps", "BasicScheduler": "steps", "LTXVScheduler": "steps"}


DEMO_WEIGHTS = "carnator_demo_wan21_t2v.safetensors"


def api_workflow(name: str) -> dict:
    return json.loads((WORKFLOWS / "api" / f"{name}.json").read_text())


def twin_families(name: str) -> tuple[str, ...]:
    """The tiny model families API twin `name` loads, its workflow's family first."""
    if name in GROUP_ENABLED:
        workflow, _, others = GROUP_ENABLED[name]
        return (FAMILY[workflow], *others)
    return (FAMILY[name],)


def on_tiny_models(graph: dict, family: str, unet_name: str, *, low_noise_unet: str | None = None, steps: int = 4,
                   reuse: dict | None = None) -> dict:
    """A copy of an API-format workflow that runs on the tiny `family` model (see the module docstring)."""
    graph = _passed_through(copy.deepcopy(graph))
    checkpoints = [node_id for node_id, node in graph.items() if node["class_type"] == "CheckpointLoaderSimple"]
    split = {node["inputs"]["sigmas"][0] for node in graph.values() if node["class_type"] == "SplitSigmas"}
    for node_id, node in list(graph.items()):
        tiny = _on_tiny_model(node, family, unet_name, low_noise_unet)
        if tiny is None:
            del graph[node_id]
            continue
        graph[node_id] = tiny
        kind, inputs = node["class_type"], tiny["inputs"]
        if kind in _STEPS and node_id not in split:
            inputs[_STEPS[kind]] = steps
        if kind in REUSE_NODES and reuse:
            inputs.update(reuse)
    _with_tiny_vae(graph, checkpoints)
    unpacked = {node["inputs"]["av_latent"][0]: node_id for node_id, node in graph.items()
                if node["class_type"] == "LTXVSeparateAVLatent"}  # sampler -> the node unpacking its output
    for node_id in [n for n, node in graph.items() if node["class_type"] in SAMPLERS]:
        latent = [unpacked[node_id], 0] if node_id in unpacked else [node_id, 0]
        graph[f"stats_{node_id}"] = {"class_type": "HarnessLatentStats", "inputs": {"latent": latent}}
    for node_id, node in graph.items():
        for name, value in node["inputs"].items():
            if is_link(value) and value[0] not in graph:
                raise ValueError(f"node {node_id}.{name} links to removed node {value[0]}: extend on_tiny_models")
    return graph


def _on_tiny_model(node: dict, family: str, unet_name: str, low_noise_unet: str | None) -> dict | None:
    """The node as it runs on the tiny model (None: removed); loaders, encoders and latent sizes replaced."""
    kind, inputs = node["class_type"], node["inputs"]
    if kind in _REMOVED:
        return None
    if kind in ("UNETLoader", "CheckpointLoaderSimple"):
        return {"class_type": "UNETLoader", "inputs": {"unet_name": _tiny_unet(inputs, unet_name, low_noise_unet),
                                                       "weight_dtype": "default"}}
    if kind == "VAELoader":
        inputs["vae_name"] = "pixel_space"
    elif kind == "CLIPTextEncode":
        return {"class_type": "HarnessTextConditioning",
                "inputs": {"text": inputs["text"], "family": _TEXT_FAMILY.get(family, family), "seed": 0}}
    elif kind == "LatentUpscaleModelLoader":
        inputs["model_name"] = (HUNYUAN_VIDEO15_UPSAMPLERS if "hunyuanvideo15" in inputs["model_name"]
                                else LTX2_UPSAMPLERS)[0]
    elif kind == "HunyuanVideo15LatentUpscaleWithModel":
        width, height, _ = _LATENT_SIZE["EmptyHunyuanVideo15Latent"]
        inputs["width"], inputs["height"] = 2 * width, 2 * height
    elif kind == "LTXVEmptyLatentAudio":
        return {"class_type": "LoadLatent", "inputs": {"latent": LTX2_AUDIO_LATENT}}
    elif kind in _LATENT_SIZE:
        inputs["width"], inputs["height"], inputs["length"] = _LATENT_SIZE[kind]
    return node


def _passed_through(graph: dict) -> dict:
    """`graph` without its `_PASSED_THROUGH` nodes, each consumer of one linked to that node's own source."""
    sources = {node_id: node["inputs"][_PASSED_THROUGH[node["class_type"]]] for node_id, node in graph.items()
               if node["class_type"] in _PASSED_THROUGH}
    for node_id in sources:
        del graph[node_id]
    for node in graph.values():
        for name, value in node["inputs"].items():
            while is_link(value) and value[0] in sources:
                value = sources[value[0]]
            node["inputs"][name] = value
    return graph


def _with_tiny_vae(graph: dict, checkpoints: list[str]) -> None:
    """Lead every link to a `checkpoints` node's VAE output (each now a UNETLoader, whose only output is the model) to
    a VAELoader of the tiny LTX VAE beside it."""
    for node_id in checkpoints:
        vae = f"{node_id}_vae"
        for consumer in list(graph.values()):
            for name, value in consumer["inputs"].items():
                if is_link(value) and value[0] == node_id and value[1] == _CHECKPOINT_VAE:
                    consumer["inputs"][name] = [vae, 0]
                    graph[vae] = {"class_type": "VAELoader", "inputs": {"vae_name": LTX_VAE}}


def _tiny_unet(inputs: dict, unet_name: str, low_noise_unet: str | None) -> str:
    """The tiny model a shipped loader loads: `low_noise_unet` for a low-noise expert, the tiny SR model for a
    super-resolution model, `unet_name` otherwise."""
    if SUPER_RESOLUTION in inputs.get("unet_name", ""):
        return HUNYUAN_VIDEO15_SR.filename
    if "low_noise" not in inputs.get("unet_name", ""):
        return unet_name
    if low_noise_unet is None:
        raise ValueError(f"{inputs['unet_name']} is a low-noise expert: pass on_tiny_models a low_noise_unet")
    return low_noise_unet


def on_demo_model(graph: dict, prompt: str) -> dict:
    """A copy of a Wan-family API workflow on the embedded demo model, its sampler settings kept as shipped.

    The loader loads the demo weights, text encoders become CarnatorDemoTextEncode (the positive prompt set to
    `prompt`), the latent takes the demo clip's size, VAEDecode becomes CarnatorDemoDecode, and every Carnator
    reuse node is told the prompt. Returns the graph with a SaveLatent ("save") and a CarnatorReport
    ("report") on the first sampler's output.
    """
    graph = copy.deepcopy(graph)
    sampler = next(node_id for node_id, node in graph.items() if node["class_type"] in SAMPLERS)
    positive = graph[sampler]["inputs"]["positive"][0]
    for node_id, node in list(graph.items()):
        kind, inputs = node["class_type"], node["inputs"]
        if kind in ("CLIPLoader", "VAELoader", "CreateVideo", "SaveVideo"):
            del graph[node_id]
        elif kind == "UNETLoader":
            inputs["unet_name"] = DEMO_WEIGHTS
        elif kind == "CLIPTextEncode":
            text = prompt if node_id == positive else inputs["text"]
            graph[node_id] = {"class_type": "CarnatorDemoTextEncode", "inputs": {"text": text}}
        elif kind == "EmptyHunyuanLatentVideo":
            inputs.update(latent_size())
        elif kind == "VAEDecode":
            graph[node_id] = {"class_type": "CarnatorDemoDecode", "inputs": {"samples": inputs["samples"], "scale": 8}}
        elif kind in REUSE_NODES:
            inputs["prompt"] = prompt
    graph["save"] = {"class_type": "SaveLatent", "inputs": {"samples": [sampler, 0], "filename_prefix": "demo"}}
    graph["report"] = {"class_type": "CarnatorReport", "inputs": {"samples": [sampler, 0]}}
    return graph

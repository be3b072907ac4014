"""Nodes for the embedded demo model: text encoding and latent decoding without a VAE or a big text encoder."""

from __future__ import annotations

import os

import folder_paths
from comfy_api.latest import io

from carnator_core.demo import text as demo_text
from carnator_core.demo import world
from carnator_core.demo.clip_oracle import DEMO_DECODER, register_demo_oracle

WEIGHTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "carnator_core", "demo",
                           "weights")


def register_demo() -> None:
    """The demo's parts beyond its nodes: the stock UNETLoader lists the shipped demo weights
    (carnator_demo_*.safetensors), and the calibration judges the demo model's clips by its world's oracle."""
    if WEIGHTS_DIR not in folder_paths.get_folder_paths("diffusion_models"):
        folder_paths.add_model_folder_path("diffusion_models", WEIGHTS_DIR)
    register_demo_oracle()


class CarnatorDemoTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorDemoTextEncode",
            display_name="Carnator Demo Text Encode",
            category="Carnator/demo",
            description="Conditioning for the embedded demo model: MiniLM token embeddings padded to Wan's width.",
            inputs=[io.String.Input("text", multiline=True, default="a red circle moving left on a black background",
                                    tooltip="Prompt for the demo world: one shape (circle/ball, square/box, "
                                            "triangle), a colour, a motion and a background.")],
            outputs=[io.Conditioning.Output(display_name="CONDITIONING")],
        )

    @classmethod
    def execute(cls, text: str) -> io.NodeOutput:
        return io.NodeOutput([[demo_text.encode_prompts([text]), {}]])


class CarnatorDemoDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=DEMO_DECODER,
            display_name="Carnator Demo Decode",
            category="Carnator/demo",
            description="Frames of a demo-model latent through the demo world's fixed latent-to-RGB map (no VAE).",
            inputs=[io.Latent.Input("samples", tooltip="Latent sampled by the demo model."),
                    io.Int.Input("scale", default=8, min=1, max=32,
                                 tooltip="Pixel upscale for viewing (8 matches a real VAE's spatial factor).")],
            outputs=[io.Image.Output(display_name="IMAGE")],
        )

    @classmethod
    def execute(cls, samples, scale: int = 8) -> io.NodeOutput:
        latent = samples["samples"].float()
        if latent.ndim != 5 or latent.shape[1] != 16:
            raise ValueError(f"Carnator Demo Decode: expected a Wan video latent (B, 16, F, H, W), got "
                             f"{tuple(latent.shape)}")
        rgb = world.decode(world.from_raw(latent))  # (B, 3, F, H, W) in [0, 1]
        frames = rgb.permute(0, 2, 3, 4, 1).reshape(-1, rgb.shape[3], rgb.shape[4], 3)
        if scale > 1:
            frames = frames.repeat_interleave(scale, dim=1).repeat_interleave(scale, dim=2)
        return io.NodeOutput(frames.contiguous())

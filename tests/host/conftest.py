"""Fixtures shared by the in-process host tests."""

from __future__ import annotations

import tarfile
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.quantized_models import DEMO_SOURCE, GGUF_PACK, write_gguf


@pytest.fixture(scope="session")
def wan_lora(comfy, tiny_models) -> str:
    """A LoRA on every attention projection of the tiny Wan model, in the generic lora_up/lora_down format."""
    from comfy.sd import load_diffusion_model

    patcher = load_diffusion_model(str(tiny_models["wan"].path))
    generator = torch.Generator().manual_seed(1)
    lora = {}
    for name, weight in patcher.model.diffusion_model.state_dict().items():
        if ".self_attn." in name and name.endswith(".weight") and weight.ndim == 2:
            stem = f"diffusion_model.{name[: -len('.weight')]}"
            lora[f"{stem}.lora_down.weight"] = torch.randn(4, weight.shape[1], generator=generator) * 0.1
            lora[f"{stem}.lora_up.weight"] = torch.randn(weight.shape[0], 4, generator=generator) * 0.1
    directory = comfy.base_dir / "models" / "loras"
    directory.mkdir(parents=True, exist_ok=True)
    save_file(lora, str(directory / "tiny_wan_lora.safetensors"))
    return "tiny_wan_lora.safetensors"


@pytest.fixture(scope="session")
def wan_low_noise(comfy, tiny_models) -> str:
    """A second tiny Wan model (other weights), the low-noise expert of the two-expert graphs."""
    from support.tiny_models import write_tiny_model

    directory = comfy.base_dir / "models" / "diffusion_models"
    return write_tiny_model("wan", directory, seed=1, filename="tiny_wan_low_noise.safetensors").name


@pytest.fixture(scope="session")
def gguf_loader(comfy) -> Callable[[str], str]:
    """city96's ComfyUI-GGUF in the host's custom_nodes; returns a factory: quantization type -> GGUF file name."""
    pytest.importorskip("gguf", reason="the `gguf` package is not installed (pyproject extra `test`)")
    if not GGUF_PACK.exists():
        pytest.skip(f"no ComfyUI-GGUF pack at {GGUF_PACK}")
    custom_nodes = comfy.base_dir / "custom_nodes"
    with tarfile.open(GGUF_PACK) as archive:
        archive.extractall(custom_nodes, filter="data")
    comfy.load_custom_node(custom_nodes / "ComfyUI-GGUF")
    directory = comfy.base_dir / "models" / "diffusion_models"

    def model(quantization: str) -> str:
        target = directory / f"carnator_demo_{quantization.lower()}.gguf"
        if not target.exists():
            write_gguf(DEMO_SOURCE, target, quantization)
        return target.name

    return model


@pytest.fixture(scope="session")
def demo_lora(comfy) -> str:
    """A small LoRA on the demo model's self-attention projections, in the generic lora_up/lora_down format."""
    generator = torch.Generator().manual_seed(3)
    lora = {}
    for name, weight in load_file(str(DEMO_SOURCE)).items():
        if ".self_attn." in name and name.endswith(".weight") and weight.ndim == 2:
            stem = f"diffusion_model.{name.removesuffix('.weight')}"
            lora[f"{stem}.lora_down.weight"] = torch.randn(4, weight.shape[1], generator=generator) * 0.05
            lora[f"{stem}.lora_up.weight"] = torch.randn(weight.shape[0], 4, generator=generator) * 0.05
    directory = comfy.base_dir / "models" / "loras"
    directory.mkdir(parents=True, exist_ok=True)
    save_file(lora, str(directory / "carnator_demo_lora.safetensors"))
    return "carnator_demo_lora.safetensors"

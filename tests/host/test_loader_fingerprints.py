"""Fingerprints of GGUF and fp8 models as their loaders load them, and damaged files (real ComfyUI in-process)."""

from __future__ import annotations

import sys

import pytest
from support.comfy_host import PACK_NAME, PromptFailed
from support.quantized_models import DEMO_SOURCE, DEMO_WEIGHTS, write_scaled_fp8

from carnator_core.demo.graphs import LOADER, base_graph, with_reuse


@pytest.fixture(scope="module")
def host(comfy):
    return sys.modules[f"{comfy.base_dir / 'custom_nodes' / PACK_NAME}.nodes.host"]


def _gguf(comfy, name: str):
    return comfy.call_node("UnetLoaderGGUF", unet_name=name)[0]


def test_quantizations_of_one_model_are_three_models_and_each_is_stable(comfy, gguf_loader, host, fresh_process_state):
    """Q8_0, Q4_0 and the fp16 file of the demo model: three fingerprints; a reload gives the same one (the sample
    is of the file's stored blocks, so another process reads the same bytes)."""
    prints = {}
    for quantization in ("Q8_0", "Q4_0"):
        prints[quantization] = host.fingerprint(_gguf(comfy, gguf_loader(quantization)))
    prints["fp16"] = host.fingerprint(comfy.call_node("UNETLoader", unet_name=DEMO_WEIGHTS, weight_dtype="default")[0])
    assert len(set(prints.values())) == 3
    comfy.unload_models()
    fresh_process_state()
    assert host.fingerprint(_gguf(comfy, gguf_loader("Q8_0"))) == prints["Q8_0"]


def test_lora_on_a_gguf_model_changes_the_fingerprint_with_its_strength(comfy, gguf_loader, demo_lora, host,
                                                                         fresh_process_state):
    """city96's patcher applies a LoRA at dequantize time (the patches ride on the GGMLTensor, the stored blocks
    stay as loaded): the fingerprint reads the patcher's patches and strengths, and stays the same once loaded."""
    from comfy.model_management import load_models_gpu

    base = _gguf(comfy, gguf_loader("Q8_0"))
    plain = host.fingerprint(base)

    def lora(strength: float):
        return comfy.call_node("LoraLoaderModelOnly", model=base, lora_name=demo_lora, strength_model=strength)[0]

    half, full = lora(0.5), lora(1.0)
    prints = {plain, host.fingerprint(half), host.fingerprint(full)}
    assert len(prints) == 3
    expected = host.fingerprint(half)
    load_models_gpu([half])
    fresh_process_state()
    assert host.fingerprint(half) == expected
    comfy.unload_models()


def test_damaged_gguf_and_fp8_files_fail_in_their_loader(comfy, gguf_loader, tmp_path):
    """A truncated file fails where it fails without Carnator: in the loader node, before any Carnator code runs."""
    directory = comfy.base_dir / "models" / "diffusion_models"
    gguf_file = directory / gguf_loader("Q8_0")
    truncated = directory / "carnator_demo_truncated.gguf"
    truncated.write_bytes(gguf_file.read_bytes()[: gguf_file.stat().st_size // 2])
    fp8 = write_scaled_fp8(DEMO_SOURCE, tmp_path / "fp8.safetensors")
    damaged = directory / "carnator_demo_truncated_fp8.safetensors"
    damaged.write_bytes(fp8.read_bytes()[: fp8.stat().st_size // 2])
    for loader, graph in (("UnetLoaderGGUF", _gguf_graph(truncated.name)),
                          ("UNETLoader", base_graph(damaged.name, "a red ball", steps=2))):
        with pytest.raises(PromptFailed) as failure:
            comfy.run_prompt(comfy.complete(with_reuse(graph, "stores/damaged", "")))
        message = str(failure.value)
        assert loader in message.splitlines()[0], message  # the loader node raised, as it does without Carnator
        assert f"custom_nodes/{PACK_NAME}/" not in message, message


def _gguf_graph(name: str) -> dict:
    graph = base_graph(DEMO_WEIGHTS, "a red ball", steps=2)
    graph[LOADER] = {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": name}}
    return graph

"""The loaders people run Wan with, each with one CarnatorReuse node (demo model, real ComfyUI in-process).

For every loader a rewording with the same seed resumes, as the model's own probes decide, and an unrelated prompt
misses with exactly the output of the same graph without Carnator. The demo model is written in each format by
tests/support/quantized_models.py; GGUF files load through city96's ComfyUI-GGUF, unpacked into the host's
custom_nodes as a user's ComfyUI has it.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.quantized_models import DEMO_SOURCE, DEMO_WEIGHTS, write_quantization_metadata, write_scaled_fp8

from carnator_core.demo.graphs import LOADER, MODEL_CHAIN, REPORT, SAMPLER, base_graph, with_report, with_reuse
from carnator_core.reuse.recording import entry_writer

SCENE = "a purple triangle moving right on a gray background"
REWORDED = "a violet wedge drifting to the right over grey"
UNRELATED = "a yellow circle moving up on a black background"
OPTIONS = {"sparse_attention": "off"}
_stores = itertools.count()


def _run(comfy, graph: dict) -> tuple[torch.Tensor, dict | None]:
    """The sampled latent and the Carnator report (None for a graph without CarnatorReuse)."""
    comfy.unload_models()  # an identical prompt would otherwise be served from ComfyUI's cache
    run = comfy.run_prompt(comfy.complete(graph))
    entry_writer().flush()
    reports = json.loads(run.output(REPORT, 1))
    return run.output(SAMPLER)["samples"], reports[0] if reports else None


def _plain(prompt: str) -> dict:
    """The official Wan 2.1 template's sampler settings on the demo model."""
    graph = base_graph(DEMO_WEIGHTS, prompt, seed=11, steps=8, cfg=6.0, sampler_name="uni_pc")
    graph[MODEL_CHAIN]["inputs"]["shift"] = 8.0
    return graph


def _after_loader(graph: dict, node_id: str, class_type: str, **inputs) -> dict:
    """A model node between the loader and the model chain (a LoRA, TorchCompileModel)."""
    graph = copy.deepcopy(graph)
    graph[node_id] = {"class_type": class_type, "inputs": {"model": [LOADER, 0], **inputs}}
    graph[MODEL_CHAIN]["inputs"]["model"] = [node_id, 0]
    return graph


def _before_sampler(graph: dict, node_id: str, class_type: str, **inputs) -> dict:
    """A model node right before the sampler, after CarnatorReuse where the graph has one."""
    graph = copy.deepcopy(graph)
    graph[node_id] = {"class_type": class_type, "inputs": {"model": graph[SAMPLER]["inputs"]["model"], **inputs}}
    graph[SAMPLER]["inputs"]["model"] = [node_id, 0]
    return graph


def _fp8_file(comfy, name: str, write: Callable[[Path, Path], Path]) -> str:
    target = comfy.base_dir / "models" / "diffusion_models" / name
    if not target.exists():
        write(DEMO_SOURCE, target)
    return name


def _gguf(gguf_loader, quantization: str) -> Callable[[dict], dict]:
    def load(graph: dict) -> dict:
        graph = copy.deepcopy(graph)
        graph[LOADER] = {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": gguf_loader(quantization)}}
        return graph
    return load


def _unet(name: str, weight_dtype: str = "default") -> Callable[[dict], dict]:
    def load(graph: dict) -> dict:
        graph = copy.deepcopy(graph)
        graph[LOADER]["inputs"].update(unet_name=name, weight_dtype=weight_dtype)
        return graph
    return load


def _has_quantization_metadata() -> bool:
    import comfy.utils

    return hasattr(comfy.utils, "convert_old_quants")


def _check_loader(comfy, load: Callable[[dict], dict], compile_after: bool = False) -> tuple[dict, dict]:
    """Scene, then its rewording (must resume), then an unrelated prompt (must miss, bit-identical to plain)."""
    store = f"stores/loaders-{next(_stores)}"

    def reusing(prompt: str) -> dict:
        graph = with_reuse(load(_plain(prompt)), store, "", **OPTIONS)
        return _before_sampler(graph, "compile", "TorchCompileModel", backend="inductor") if compile_after else graph

    def plain(prompt: str) -> dict:
        graph = with_report(load(_plain(prompt)))
        return _before_sampler(graph, "compile", "TorchCompileModel", backend="inductor") if compile_after else graph

    _, scene = _run(comfy, reusing(SCENE))
    assert not scene["hit"], json.dumps(scene)
    _, reworded = _run(comfy, reusing(REWORDED))
    assert reworded["hit"] and reworded["skipped_steps"] > 0, json.dumps(reworded)
    expected, _ = _run(comfy, plain(UNRELATED))
    missed, unrelated = _run(comfy, reusing(UNRELATED))
    assert not unrelated["hit"] and unrelated["skipped_steps"] == 0, json.dumps(unrelated)
    assert torch.equal(missed, expected)
    print(f"\nrewording: {reworded['verdict']} skipped {reworded['skipped_steps']} | unrelated: "
          f"{unrelated['reason']} | bit-identical: {torch.equal(missed, expected)}")
    return reworded, unrelated


@pytest.mark.parametrize("quantization", ["Q8_0", "Q4_0"])
def test_gguf_rewording_resumes_and_unrelated_prompt_is_plain(comfy, gguf_loader, quantization):
    _check_loader(comfy, _gguf(gguf_loader, quantization))


def test_lora_on_a_gguf_model_resumes_and_unrelated_prompt_is_plain(comfy, gguf_loader, demo_lora):
    gguf = _gguf(gguf_loader, "Q8_0")
    _check_loader(comfy, lambda graph: _after_loader(gguf(graph), "lora", "LoraLoaderModelOnly", lora_name=demo_lora,
                                                     strength_model=0.5))


@pytest.mark.parametrize("weight_dtype", ["fp8_e4m3fn", "fp8_e4m3fn_fast"])
def test_unet_loader_fp8_weights_resume_and_unrelated_prompt_is_plain(comfy, weight_dtype):
    _check_loader(comfy, _unet(DEMO_WEIGHTS, weight_dtype))


def test_scaled_fp8_checkpoint_resumes_and_unrelated_prompt_is_plain(comfy):
    _check_loader(comfy, _unet(_fp8_file(comfy, "carnator_demo_fp8_scaled.safetensors", write_scaled_fp8)))


def test_quantization_metadata_checkpoint_resumes_and_unrelated_prompt_is_plain(comfy):
    if not _has_quantization_metadata():
        pytest.skip("this ComfyUI has no `_quantization_metadata` checkpoints (comfy.utils.convert_old_quants)")
    _check_loader(comfy, _unet(_fp8_file(comfy, "carnator_demo_fp8_mixed.safetensors", write_quantization_metadata)))


@pytest.mark.slow
def test_torch_compile_before_the_reuse_node(comfy):
    _check_loader(comfy, lambda graph: _after_loader(graph, "compile", "TorchCompileModel", backend="inductor"))


def test_torch_compile_after_the_reuse_node(comfy):
    _check_loader(comfy, lambda graph: graph, compile_after=True)


def test_a_q8_0_donor_never_serves_the_q4_model_of_the_same_weights(comfy, gguf_loader):
    """Another quantization is another model: the Q4_0 file finds no candidate in a store of Q8_0 generations, even
    for the very prompt and seed the Q8_0 model recorded (the hard key differs)."""
    store = f"stores/loaders-{next(_stores)}"
    q8, q4 = _gguf(gguf_loader, "Q8_0"), _gguf(gguf_loader, "Q4_0")
    _run(comfy, with_reuse(q8(_plain(SCENE)), store, "", **OPTIONS))
    _, report = _run(comfy, with_reuse(q4(_plain(SCENE)), store, "", **OPTIONS))
    assert not report["hit"] and report["reason"].startswith("no candidate"), json.dumps(report)
    assert report["filtered"] == {"other model": 1}, json.dumps(report)  # the Q8_0 entry, seen and refused
    assert report["candidates"] == [] and report["probes"] == [], json.dumps(report)

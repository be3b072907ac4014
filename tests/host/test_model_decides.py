"""Same-noise donors are judged by the model, not cut by text similarity (demo model, real ComfyUI in-process).

Text similarity is a poor judge of compatibility: MiniLM scores the rewording below 0.5 and an unrelated prompt
higher. A donor made from the request's initial noise costs nothing to judge (the step-0 screen is the request's
own first evaluation), so whatever its similarity the model is asked, with nothing wired but one node per model.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from carnator_core.demo.graphs import (
    MODEL_CHAIN,
    REPORT,
    SAMPLER,
    base_graph,
    two_expert_graph,
    with_expert_reuse,
    with_report,
    with_reuse,
)
from carnator_core.lookup.embeddings import text_embedder
from carnator_core.reuse.recording import entry_writer

DEMO_WEIGHTS = "carnator_demo_wan21_t2v.safetensors"
SCENE = "a purple triangle moving right on a gray background"
REWORDED = "a violet wedge drifting to the right over grey"
LOOK_ALIKE = "a purple triangle moving left on a gray background"  # motion reversed: the model must refuse it
OPTIONS = {"sparse_attention": "off"}  # otherwise the node's defaults, as queued (InProcessComfy.complete)
_stores = itertools.count()


def _text_cosine(a: str, b: str) -> float:
    first, second = text_embedder().embed([a, b])
    return float(torch.nn.functional.cosine_similarity(first, second, dim=0))


def _run(comfy, graph: dict) -> tuple[torch.Tensor, list[dict]]:
    comfy.unload_models()  # an identical prompt would otherwise be served from ComfyUI's cache
    run = comfy.run_prompt(comfy.complete(graph))
    entry_writer().flush()
    return run.output(SAMPLER)["samples"], json.loads(run.output(REPORT, 1))


def test_the_prompts_are_the_ones_text_similarity_gets_wrong():
    assert _text_cosine(SCENE, REWORDED) < 0.5
    assert _text_cosine(SCENE, LOOK_ALIKE) > 0.9


def test_two_experts_unwired_rewording_skips_the_first_stage(comfy):
    """The Wan 2.2 14B template's shape: one CarnatorReuse per expert, no prompt wired, 30 steps split half-way."""
    store = f"stores/model-decides-{next(_stores)}"

    def graph(prompt: str) -> dict:
        return with_expert_reuse(two_expert_graph(DEMO_WEIGHTS, prompt, seed=7, steps=30, boundary=15), store,
                                 prompt="", **OPTIONS)

    _, (first, _) = _run(comfy, graph(SCENE))
    assert not first["hit"]
    _, (first, second) = _run(comfy, graph(REWORDED))
    assert first["stage"]["skipped_whole"] and first["verdict"] == "stage skipped", json.dumps(first)
    assert first["donor_prompt"] == SCENE or first["donor_id"]
    assert first["model_calls"] == 1


@pytest.mark.parametrize("sampler_name", ["uni_pc"])
def test_wan21_template_settings_unwired_rewording_resumes_and_look_alike_does_not(comfy, sampler_name):
    """The official Wan 2.1 template's sampler settings (uni_pc, cfg 6, shift 8) with one node, nothing wired."""
    store = f"stores/model-decides-{next(_stores)}"

    def plain(prompt: str) -> dict:
        graph = base_graph(DEMO_WEIGHTS, prompt, seed=11, steps=20, cfg=6.0, sampler_name=sampler_name)
        graph[MODEL_CHAIN]["inputs"]["shift"] = 8.0
        return graph

    def reusing(prompt: str) -> dict:
        return with_reuse(plain(prompt), store, "", **OPTIONS)

    _run(comfy, reusing(SCENE))
    _, [reworded] = _run(comfy, reusing(REWORDED))
    assert reworded["skipped_steps"] > 0, json.dumps(reworded["probes"])

    expected, _ = _run(comfy, with_report(plain(LOOK_ALIKE)))
    refused, [look_alike] = _run(comfy, reusing(LOOK_ALIKE))
    assert look_alike["skipped_steps"] == 0 and not look_alike["hit"], json.dumps(look_alike)
    # the model was asked, and refused: at step 0, or (the screen admitting on the conditional branches) at a probe
    assert look_alike["probes"] and not any(p["passed"] and not p["confirms_deeper"] for p in look_alike["probes"])
    assert any(not p["passed"] for p in look_alike["probes"]), json.dumps(look_alike["probes"])
    assert torch.equal(refused, expected)

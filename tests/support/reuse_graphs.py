"""Splicing Carnator nodes into the template-shaped test graphs."""

from __future__ import annotations

import copy

from support.t2v_graphs import SAMPLER

REUSE_DEFAULTS = {
    "mode": "balanced", "seed_policy": "same-noise", "top_k": 4, "min_similarity": 0.5, "max_probes": 3,
    "structure_threshold": 0.85, "guidance_threshold": 0.8, "depth_slope": 0.09, "guidance_boost": 0.0,
    "guidance_boost_steps": 0, "record": True,
}
ATTENTION_DEFAULTS = {"sparse_attention": "borrowed", "enter_recall": 0.9, "exit_recall": 0.75}


def with_reuse(graph: dict, store_path: str, prompt: str = "", model_input: str = "model", **options) -> dict:
    """Insert Store -> CarnatorReuse in front of whatever feeds the sampler's model, plus a report node.

    `model_input` names the input of the node that takes the model ("model" for KSampler/SamplerCustom;
    for SamplerCustomAdvanced graphs pass the guider node via `graph["guider"]`).
    """
    graph = copy.deepcopy(graph)
    consumer = "guider" if "guider" in graph else SAMPLER
    graph["carnator_store"] = {"class_type": "CarnatorStore", "inputs": {"path": store_path, "size_limit_gb": 1.0}}
    graph["carnator_reuse"] = {"class_type": "CarnatorReuse", "inputs": {
        "model": graph[consumer]["inputs"][model_input], "store": ["carnator_store", 0], "prompt": prompt,
        **REUSE_DEFAULTS, **ATTENTION_DEFAULTS, **options}}
    graph[consumer]["inputs"][model_input] = ["carnator_reuse", 0]
    graph["carnator_report"] = {"class_type": "CarnatorReport", "inputs": {"samples": [SAMPLER, 0]}}
    return graph


def with_expert_reuse(graph: dict, store_path: str, prompt: str = "", experts: tuple[str, ...] = ("high_noise",
                      SAMPLER), **options) -> dict:
    """One CarnatorReuse per expert chain of a two-expert graph (`wan22_14b_t2v`), in front of each sampler named in
    `experts`, sharing one store, plus a report node on the last sampler."""
    graph = copy.deepcopy(graph)
    graph["carnator_store"] = {"class_type": "CarnatorStore", "inputs": {"path": store_path, "size_limit_gb": 1.0}}
    for sampler in experts:
        node = f"carnator_reuse_{sampler}"
        graph[node] = {"class_type": "CarnatorReuse", "inputs": {
            "model": graph[sampler]["inputs"]["model"], "store": ["carnator_store", 0], "prompt": prompt,
            **REUSE_DEFAULTS, **ATTENTION_DEFAULTS, **options}}
        graph[sampler]["inputs"]["model"] = [node, 0]
    graph["carnator_report"] = {"class_type": "CarnatorReport", "inputs": {"samples": [SAMPLER, 0]}}
    return graph

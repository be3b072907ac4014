"""Exact repeats on the demo model inside real ComfyUI (in-process), with the official Wan 2.1 template's sampler:
the same prompt queued again after another one costs its first model call and gives the first run's latent bit for
bit, for a single sampler and for each of two experts; the same prompt with any sampler input changed is never
served that latent."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from support.demo_runs import DEMO_WEIGHTS, PROMPT, sample_demo

from carnator_core.demo.graphs import (
    HIGH_NOISE,
    MODEL_CHAIN,
    NEGATIVE,
    REPORT,
    SAMPLER,
    base_graph,
    two_expert_graph,
    with_expert_reuse,
    with_report,
    with_reuse,
)
from carnator_core.reuse.recording import entry_writer

OTHER = "a blue square moving up on a white background"
STEPS = 12
_stores = itertools.count()


def _graph(prompt: str, store: str | None, *, sampler: str = "uni_pc", scheduler: str = "simple", steps: int = STEPS,
           cfg: float = 6.0, negative: str = "") -> dict:
    graph = base_graph(DEMO_WEIGHTS, prompt, seed=42, steps=steps, cfg=cfg, sampler_name=sampler, scheduler=scheduler)
    graph[MODEL_CHAIN]["inputs"]["shift"] = 8.0
    graph[NEGATIVE]["inputs"]["text"] = negative
    return with_report(graph) if store is None else with_reuse(graph, store, prompt, sparse_attention="off")




@pytest.mark.parametrize("mode", ["balanced", "safe"])
def test_an_exact_repeat_after_another_prompt_costs_one_call_and_is_the_first_run_bit_for_bit(comfy, mode):
    store = f"stores/exact-{next(_stores)}"
    plain, _ = sample_demo(comfy, _graph(PROMPT, None))
    first, report = sample_demo(comfy, _graph(PROMPT, store))
    assert torch.equal(first, plain) and not report["hit"]
    sample_demo(comfy, _graph(OTHER, store))
    repeat, report = sample_demo(comfy, _graph(PROMPT, store))
    assert report["verdict"] == "exact repeat" and report["exact_repeat"], json.dumps(report)
    assert report["model_calls"] <= 2 and report["skipped_steps"] == STEPS - 1
    assert report["reason"] == f"exact repeat of {report['donor_id'][:8]}: {report['model_calls']} of {STEPS} " \
                               "model calls"
    assert torch.equal(repeat, first)


def test_the_same_prompt_with_another_sampler_input_is_never_served_the_stored_latent(comfy):
    store = f"stores/exact-{next(_stores)}"
    first, _ = sample_demo(comfy, _graph(PROMPT, store))
    for change, changed in {"sampler": {"sampler": "euler"}, "cfg": {"cfg": 5.0}, "scheduler": {"scheduler": "beta"},
                            "steps": {"steps": STEPS - 4}, "negative": {"negative": "blurry"}}.items():
        other, report = sample_demo(comfy, _graph(PROMPT, store, **changed))
        assert not report["exact_repeat"] and report["verdict"] != "exact repeat", (change, json.dumps(report))
        assert not torch.equal(other, first), change


def _two_experts(prompt: str, store: str) -> dict:
    graph = two_expert_graph(DEMO_WEIGHTS, prompt, seed=42, steps=STEPS, boundary=STEPS // 2, cfg=6.0)
    return with_expert_reuse(graph, store, prompt, sparse_attention="off")


def _both_experts(comfy, graph: dict) -> tuple[torch.Tensor, dict[str, dict]]:
    """The second expert's latent and each expert's report by its sampler node."""
    comfy.unload_models()
    run = comfy.run_prompt(comfy.complete(graph))
    entry_writer().flush()
    reports = {report["node"]: report for report in json.loads(run.output(REPORT, 1))}
    return run.output(SAMPLER)["samples"], {node: reports[node] for node in (HIGH_NOISE, SAMPLER)}


def test_an_exact_repeat_of_two_experts_serves_each_expert_its_stored_output(comfy):
    """The Wan 2.2 14B template's shape (two KSamplerAdvanced, a CarnatorReuse before each): the same prompt again,
    after another, repeats the first expert exactly, hands the entry on, and the second expert, whose input is the
    repeated output, is served its stored output too: a model call or two per expert, the first run's latent."""
    store = f"stores/exact-{next(_stores)}"
    first, _ = _both_experts(comfy, _two_experts(PROMPT, store))
    _both_experts(comfy, _two_experts(OTHER, store))
    repeat, reports = _both_experts(comfy, _two_experts(PROMPT, store))
    for node, report in reports.items():
        assert report["verdict"] == "exact repeat" and report["model_calls"] <= 2, (node, json.dumps(report))
        assert report["skipped_steps"] == STEPS // 2 - 1, (node, json.dumps(report))
    assert reports[HIGH_NOISE]["donor_id"] == reports[SAMPLER]["donor_id"]  # one entry, both its stages
    assert torch.equal(repeat, first)

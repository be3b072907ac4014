"""Few-step sampling (distilled models, 4-step LoRAs) on the tiny Wan model in real ComfyUI.

A 4-step run records every step, so a repeat resumes half-way (balanced) or at step 3 (fast); a donor serves
requests of any step count of its own noise process (a 4-step draft its 30-step render, and the other way round) but
none of another process, and a LoRA's presence and strength are part of the model.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from support.reuse_graphs import with_reuse
from support.t2v_graphs import MODEL, SAMPLER, wan_t2v

from carnator_core.lookup.noise_process import OTHER_PROCESS
from carnator_core.reuse.recording import entry_writer

_stores = itertools.count()
PROMPT = "a red ball rolls left"


@pytest.fixture
def store_path() -> str:
    return f"stores/few-steps-{next(_stores)}"


def _graph(tiny_models, steps: int, lora: tuple[str, float] | None = None) -> dict:
    """The Wan template at `steps` (cfg 1, euler, as the lightx2v templates run), with an optional LoRA on the model."""
    graph = wan_t2v(tiny_models["wan"].name, steps=steps, cfg=1.0, sampler_name="euler", seed=17, text=PROMPT)
    if lora is not None:
        name, strength = lora
        graph["lora"] = {"class_type": "LoraLoaderModelOnly",
                         "inputs": {"model": [MODEL, 0], "lora_name": name, "strength_model": strength}}
        graph["model_sampling"]["inputs"]["model"] = ["lora", 0]
    return graph


def _report(comfy, graph: dict, store_path: str, **options) -> tuple[torch.Tensor, dict]:
    comfy.unload_models()
    run = comfy.run_prompt(comfy.complete(with_reuse(graph, store_path, prompt=PROMPT, **options)))
    entry_writer().flush()
    return run.output(SAMPLER)["samples"], json.loads(run.output("carnator_report", 1))[0]


@pytest.mark.parametrize(("mode", "skipped"), [("balanced", 2), ("fast", 3)])
def test_four_step_repeat_resumes_from_a_checkpoint_of_every_step(comfy, tiny_models, store_path, mode, skipped):
    graph = _graph(tiny_models, 4)
    first, donor = _report(comfy, graph, store_path, mode=mode)
    assert donor["hit"] is False and donor["model_calls"] == 4
    second, repeat = _report(comfy, graph, store_path, mode=mode)
    assert repeat["hit"], json.dumps(repeat)
    assert repeat["skipped_steps"] == skipped
    # The request's own step 0 confirms the same-seed donor and makes its deepest state likely, so fast asks step 3
    # first, balanced step 2; the probe's evaluation serves the resumed step, the remaining steps follow.
    assert repeat["model_calls"] == 1 + 4 - skipped
    assert float((second - first).norm() / first.norm()) < 2e-3  # fp16 checkpoints


def test_a_donor_serves_other_step_counts_of_its_noise_process_only(comfy, tiny_models, store_path):
    """A 4-step donor serves the 30-step render of its prompt by sigma, and a 30-step donor the 4-step one; a model
    sampled as another noise process (ModelSamplingDiscrete's eps on the same weights) is never served, and the
    lookup names why."""
    _report(comfy, _graph(tiny_models, 4), store_path)
    _, long_run = _report(comfy, _graph(tiny_models, 30), store_path)
    assert long_run["hit"] and long_run["resumed_at"]["donor_steps"] == 4, json.dumps(long_run)
    assert long_run["model_calls"] < 30 and long_run["skipped_steps"] >= 10
    other_store = store_path + "-long-first"
    _report(comfy, _graph(tiny_models, 30), other_store)
    _, short_after_long = _report(comfy, _graph(tiny_models, 4), other_store)
    assert short_after_long["hit"] and short_after_long["resumed_at"]["donor_steps"] == 30, \
        json.dumps(short_after_long)
    assert short_after_long["model_calls"] < 4
    eps = _graph(tiny_models, 30)
    eps["model_sampling"] = {"class_type": "ModelSamplingDiscrete",
                             "inputs": {"model": [MODEL, 0], "sampling": "eps", "zsnr": False}}
    _, other_process = _report(comfy, eps, other_store)
    assert other_process["hit"] is False and other_process["model_calls"] == 30
    assert other_process["filtered"] == {OTHER_PROCESS: 2}, json.dumps(other_process)


def test_a_lora_and_its_strength_are_part_of_the_model(comfy, tiny_models, store_path, wan_lora):
    plain_graph = _graph(tiny_models, 4, (wan_lora, 1.0))
    plain = comfy.run_prompt(plain_graph).output(SAMPLER)["samples"]
    first, donor = _report(comfy, plain_graph, store_path)
    assert donor["hit"] is False and torch.equal(first, plain)
    for count, other in enumerate((None, (wan_lora, 0.5)), start=1):
        _, report = _report(comfy, _graph(tiny_models, 4, other), store_path)
        # every entry so far (the donor, then also the request before) was made by another model
        assert report["hit"] is False and report["filtered"] == {"other model": count}, (other, json.dumps(report))
        assert report["model_calls"] == 4
    _, same = _report(comfy, plain_graph, store_path)
    assert same["hit"], json.dumps(same)

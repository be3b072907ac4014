"""Donors of another step count or scheduler, on the demo model inside real ComfyUI (in-process), with the official
Wan 2.1 template's sampler (uni_pc): a donor's state at σ continues any request of the same noise process whose
schedule reaches σ, as deep in the request's own schedule as a donor of its own schedule would, and a draft at few
steps seeds its final render."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from carnator_core.demo import world
from carnator_core.demo.graphs import MODEL_CHAIN, REPORT, SAMPLER, base_graph, with_report, with_reuse
from carnator_core.judging.quality import mse, psnr_from_mse
from carnator_core.reuse.history_replay import REPLAY_NOTE
from carnator_core.reuse.recording import entry_writer

DEMO_WEIGHTS = "carnator_demo_wan21_t2v.safetensors"
PROMPT = "a red circle moving left on a black background"
REWORDED = "a red ball moving to the left on a black background"
CHANGED = "a red circle moving left on a white background"
SAMPLER_NAME = "uni_pc"

_stores = itertools.count()


def _graph(prompt: str, steps: int, *, scheduler: str = "simple", store: str | None = None) -> dict:
    graph = base_graph(DEMO_WEIGHTS, prompt, seed=42, steps=steps, cfg=4.0, sampler_name=SAMPLER_NAME,
                       scheduler=scheduler)
    graph[MODEL_CHAIN]["inputs"]["shift"] = 3.0
    if store is None:
        return with_report(graph)
    return with_reuse(graph, store, prompt, sparse_attention="off")


def _sample(comfy, graph: dict) -> tuple[torch.Tensor, dict | None]:
    comfy.unload_models()  # ComfyUI would otherwise serve an identical prompt from its cache, without sampling
    run = comfy.run_prompt(comfy.complete(graph))
    entry_writer().flush()
    reports = json.loads(run.output(REPORT, 1))
    return run.output(SAMPLER)["samples"], reports[0] if reports else None


def _psnr(latent: torch.Tensor, reference: torch.Tensor) -> float:
    frames = [world.decode(world.from_raw(x[0].float())) for x in (latent, reference)]
    return psnr_from_mse(mse(*frames))


def _resume(comfy, donor_steps: int, steps: int, *, donor_scheduler: str = "simple",
            scheduler: str = "simple") -> tuple[torch.Tensor, dict]:
    store = f"stores/schedules-{next(_stores)}"
    _sample(comfy, _graph(PROMPT, donor_steps, scheduler=donor_scheduler, store=store))
    latent, report = _sample(comfy, _graph(REWORDED, steps, scheduler=scheduler, store=store))
    return latent, report


@pytest.mark.parametrize(("donor_steps", "steps"), [(30, 20), (20, 30)])
def test_a_rewording_resumes_as_deep_after_a_donor_of_another_step_count(comfy, donor_steps, steps):
    own, same = _resume(comfy, steps, steps)
    crossed, other = _resume(comfy, donor_steps, steps)
    plain, _ = _sample(comfy, _graph(REWORDED, steps))
    assert same["skipped_steps"] > 0, json.dumps(same["probes"])
    assert abs(other["skipped_steps"] - same["skipped_steps"]) <= 1, json.dumps(other["probes"])
    assert other["resumed_at"]["donor_steps"] == donor_steps and REPLAY_NOTE not in other["notes"]
    assert f"of {donor_steps}" in other["reason"] or other["skipped_steps"], other
    print(f"\n{donor_steps}-step donor -> {steps}-step rewording: resumed at step {other['skipped_steps']} "
          f"(σ {other['resumed_at']['sigma']:.3f}; a {steps}-step donor: step {same['skipped_steps']}), "
          f"{other['model_calls']} calls; PSNR to plain {_psnr(crossed, plain):.1f} dB "
          f"(own-schedule donor {_psnr(own, plain):.1f} dB)")
    assert _psnr(crossed, plain) > _psnr(own, plain) - 3.0


def test_a_rewording_resumes_after_a_donor_of_another_scheduler(comfy):
    crossed, report = _resume(comfy, 20, 20, donor_scheduler="simple", scheduler="beta")
    plain, _ = _sample(comfy, _graph(REWORDED, 20, scheduler="beta"))
    assert report["skipped_steps"] > 0, json.dumps(report)
    print(f"\nsimple donor -> beta rewording: {report['skipped_steps']} of 20 skipped at σ "
          f"{report['resumed_at']['sigma']:.3f}; PSNR to plain {_psnr(crossed, plain):.1f} dB")


def test_a_changed_attribute_misses_a_donor_of_another_step_count(comfy):
    store = f"stores/schedules-{next(_stores)}"
    _sample(comfy, _graph(PROMPT, 30, store=store))
    _, changed = _sample(comfy, _graph(CHANGED, 20, store=store))
    assert changed["skipped_steps"] == 0 and changed["reason"] == "probe rejected", json.dumps(changed)

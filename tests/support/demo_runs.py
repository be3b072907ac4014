"""Running a demo-model graph in the in-process host: its sampled latent and its Carnator report."""

from __future__ import annotations

import json

import torch

from carnator_core.demo.graphs import REPORT, SAMPLER
from carnator_core.reuse.recording import entry_writer

DEMO_WEIGHTS = "carnator_demo_wan21_t2v.safetensors"
PROMPT = "a red circle moving left on a black background"
REWORDED = "a red ball moving to the left on a black background"
CHANGED = "a red circle moving left on a white background"


def sample_demo(comfy, graph: dict) -> tuple[torch.Tensor, dict | None]:
    """The graph's sampled latent and its (first) Carnator report, once the run's entry is written. The models are
    unloaded first: ComfyUI would otherwise serve an identical prompt from its cache, without sampling."""
    comfy.unload_models()
    run = comfy.run_prompt(comfy.complete(graph))
    entry_writer().flush()
    reports = json.loads(run.output(REPORT, 1))
    return run.output(SAMPLER)["samples"], reports[0] if reports else None

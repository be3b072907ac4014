"""Prompt text is whatever a JSON string can hold: the API accepts lone surrogates ("\\ud800"), which the MiniLM
tokenizer rejects. The demo text encoder and the reuse node's prompt embedding take them as U+FFFD (in-process)."""

from __future__ import annotations

import json

import torch

from carnator_core.demo.graphs import REPORT, SAMPLER, base_graph, with_reuse
from carnator_core.demo.text import encode_prompts
from carnator_core.lookup.embeddings import text_embedder, tokenizable
from carnator_core.reuse.recording import writer

LONE_SURROGATE = "a red circle \ud800 moving left"


def test_lone_surrogates_become_replacement_characters():
    assert tokenizable(LONE_SURROGATE) == "a red circle \ufffd moving left"
    assert tokenizable("ok é 😀") == "ok é 😀"
    assert torch.equal(encode_prompts([LONE_SURROGATE]), encode_prompts([tokenizable(LONE_SURROGATE)]))
    assert torch.isfinite(text_embedder().embed([LONE_SURROGATE])).all()


def test_a_prompt_with_a_lone_surrogate_samples_and_records(comfy):
    graph = base_graph("carnator_demo_wan21_t2v.safetensors", LONE_SURROGATE, seed=1, steps=4)
    graph = with_reuse(graph, "stores/surrogate", LONE_SURROGATE, sparse_attention="off")  # else the node's defaults
    comfy.unload_models()
    run = comfy.run_prompt(comfy.complete(graph))
    writer.flush()
    (report,) = json.loads(run.output(REPORT, 1))
    assert report["hit"] is False and torch.isfinite(run.output(SAMPLER)["samples"]).all()

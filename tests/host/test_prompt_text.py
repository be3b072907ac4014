"""Prompt text is whatever a JSON string can hold: the API accepts lone surrogates ("\\ud800"), which the MiniLM
tokenizer rejects. The demo text encoder and the reuse node's prompt embedding take them as U+FFFD (in-process).
A queued prompt's texts start embedding when it is queued; a graph that handler cannot read is queued unchanged."""

from __future__ import annotations

import json

import torch
from support.comfy_host import pack_module

from carnator_core.demo.graphs import REPORT, SAMPLER, base_graph, with_reuse
from carnator_core.demo.text import encode_prompts
from carnator_core.lookup.compatible import embed_prompt
from carnator_core.lookup.embeddings import text_embedder, tokenizable
from carnator_core.lookup.prompt_vectors import prompt_vectors
from carnator_core.reuse.recording import entry_writer

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
    entry_writer().flush()
    (report,) = json.loads(run.output(REPORT, 1))
    assert report["hit"] is False and torch.isfinite(run.output(SAMPLER)["samples"]).all()


def test_a_queued_prompts_texts_start_embedding_when_it_is_queued(comfy):
    prefetch = pack_module("prompt_prefetch")
    given = base_graph("carnator_demo_wan21_t2v.safetensors", "a violet square sinking over grey", seed=1, steps=4)
    given = with_reuse(given, "stores/prefetch", "a violet square sinking over grey", sparse_attention="off")
    read = with_reuse(base_graph("carnator_demo_wan21_t2v.safetensors", "a white dot at rest on navy", steps=4),
                      "stores/prefetch", "")  # empty `prompt`: the node reads the sampler's text, and so does this
    assert prefetch.queued_texts(given) == ["a violet square sinking over grey"]
    assert prefetch.queued_texts(read) == ["a white dot at rest on navy"]
    assert prefetch.queued_texts(base_graph("carnator_demo_wan21_t2v.safetensors", "no carnator node")) == []
    request = {"prompt": read, "client_id": "test"}
    assert prefetch.prefetch_queued_prompt(request) is request
    vector, note = embed_prompt("a white dot at rest on navy")
    assert note is None and vector is prompt_vectors().vector("a white dot at rest on navy")


def test_a_graph_the_prefetch_cannot_read_is_queued_unchanged(comfy):
    prefetch = pack_module("prompt_prefetch")
    hostile = [None, [], "graph", {"prompt": None}, {"prompt": []}, {"prompt": {"1": None, "2": []}},
               {"prompt": {"1": {"class_type": "CarnatorReuse"}}},
               {"prompt": {"1": {"class_type": "CarnatorReuse", "inputs": None}}},
               {"prompt": {"1": {"class_type": "CarnatorReuse", "inputs": {"prompt": ["9", 0]}}}},
               {"prompt": {"1": {"class_type": "CarnatorCompatibilityLookup", "inputs": {"prompt": 12}}}},
               {"prompt": {"1": {"class_type": "CarnatorReuse", "inputs": {"prompt": LONE_SURROGATE}}}}]
    for request in hostile:
        assert prefetch.prefetch_queued_prompt(request) is request
    assert torch.isfinite(prompt_vectors().vector(LONE_SURROGATE)).all()

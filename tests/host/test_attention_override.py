"""Carnator's attention override is on a run's hook only where Carnator's attention acts (in-process, tiny Wan).

- a run whose attention stays dense for Carnator (too few video tokens) samples with the host's own override (or
  none), never Carnator's, and bit for bit as without Carnator;
- next to ComfyUI's own block-sparse attention (its "Model Sparse Attention" node's callback under that node's key):
  no attention of Carnator's in the run, latent reuse still hits, the report says in one line whose attention it is;
- where the host passes q, k and v in containers, the override takes them for a sparse call only and hands a dense
  one on in its containers.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from support.comfy_host import pack_module
from support.reuse_graphs import with_reuse
from support.t2v_graphs import SAMPLER, wan_t2v

from carnator_core.attention.sparse_attention import (
    COMFYUI_SPARSE_ATTENTION,
    TOO_FEW_TOKENS,
    SparseAttentionRun,
    SparseAttentionSettings,
)
from carnator_core.reuse.recording import writer


def _harness():
    return next(module for key, module in sys.modules.items() if key.endswith("carnator_harness"))


def _hooked(graph: dict, name: str, hook: str) -> dict:
    """A HarnessAttentionHooks node in front of the sampler's model."""
    graph[name] = {"class_type": "HarnessAttentionHooks", "inputs": {"model": graph[SAMPLER]["inputs"]["model"],
                                                                     "hook": hook}}
    graph[SAMPLER]["inputs"]["model"] = [name, 0]
    return graph


def _sparse(graph: dict, **knobs) -> dict:
    graph["sparse"] = {"class_type": "CarnatorSparseAttention",
                       "inputs": {"model": graph[SAMPLER]["inputs"]["model"], "source": "own", **knobs}}
    graph[SAMPLER]["inputs"]["model"] = ["sparse", 0]
    graph["carnator_report"] = {"class_type": "CarnatorReport", "inputs": {"samples": [SAMPLER, 0]}}
    return graph


def _run(comfy, graph: dict) -> tuple[torch.Tensor, list, list[dict]]:
    """The samples, the overrides the run's CALC_COND_BATCH calls saw on the hook, and Carnator's reports."""
    harness = _harness()
    harness.seen_overrides.clear()
    harness.override_calls.clear()
    comfy.unload_models()
    run = comfy.run_prompt(comfy.complete(graph))
    writer.flush()
    reports = json.loads(run.output("carnator_report", 1)) if "carnator_report" in graph else []
    return run.output(SAMPLER)["samples"], list(harness.seen_overrides), reports


@pytest.mark.parametrize("prior", [None, "other pack override"])
def test_a_run_too_short_for_sparse_attention_samples_with_the_hosts_own_override(comfy, tiny_models, prior):
    graph = wan_t2v(tiny_models["wan"].name, steps=3, seed=4, sampler_name="euler")
    if prior is not None:
        graph = _hooked(graph, "prior", prior)
    graph = _hooked(graph, "probe", "probe")
    plain, plain_seen, _ = _run(comfy, graph)
    expected = None if prior is None else _harness().other_pack_override
    assert plain_seen and all(override is expected for override in plain_seen)

    dense, seen, reports = _run(comfy, _sparse(json.loads(json.dumps(graph)), min_tokens=1024))
    assert seen == plain_seen  # the override each model call saw on the hook: the host's own, or none
    assert torch.equal(dense, plain)
    assert reports[0]["reason"] == TOO_FEW_TOKENS.format(32, 1024)

    # the same graph where Carnator's attention acts: its override is on the hook, chained to the prior one
    _, acting, reports = _run(comfy, _sparse(json.loads(json.dumps(graph)), min_tokens=0))
    carnator_override = pack_module("attention_hooks").carnator_attention_override
    assert acting and all(override is carnator_override for override in acting)
    assert reports[0]["attention"]["self_attention_calls"] > 0
    if prior is not None:
        assert _harness().override_calls["other pack"] > 0  # Carnator's dense calls went through the prior override


def test_next_to_comfyuis_sparse_attention_carnator_adds_no_attention_and_reuse_still_hits(comfy, tiny_models):
    graph = _hooked(wan_t2v(tiny_models["wan"].name, steps=6, seed=9, sampler_name="euler"), "comfyui_sparse",
                    "comfyui sparse attention")
    graph = _hooked(graph, "probe", "probe")
    plain, plain_seen, _ = _run(comfy, graph)
    comfyui_calls = _harness().override_calls["comfyui sparse"]
    carnator_override = pack_module("attention_hooks").carnator_attention_override
    reuse = {"sparse_attention": "own", "min_tokens": 0}

    first, seen, reports = _run(comfy, with_reuse(json.loads(json.dumps(graph)), "stores/comfyui-sparse",
                                                  prompt="a red ball", **reuse))
    assert torch.equal(first, plain) and not reports[0]["hit"]
    assert seen and carnator_override not in seen
    assert all(o.__qualname__.startswith("_comfyui_sparse_attention_override") for o in seen + plain_seen)
    assert _harness().override_calls["comfyui sparse"] == comfyui_calls  # every attention call reached ComfyUI's
    attention = reports[0]["attention"]
    assert attention["inactive"] == COMFYUI_SPARSE_ATTENTION and attention["self_attention_calls"] == 0
    assert reports[0]["notes"].count(COMFYUI_SPARSE_ATTENTION) == 1

    _, seen, reports = _run(comfy, with_reuse(json.loads(json.dumps(graph)), "stores/comfyui-sparse",
                                              prompt="a red ball", **reuse))
    assert reports[0]["hit"] and reports[0]["skipped_steps"] > 0  # latent reuse works as before
    assert carnator_override not in seen and COMFYUI_SPARSE_ATTENTION in reports[0]["notes"]


def test_the_key_of_comfyuis_sparse_attention_callback_is_what_carnator_detects(comfy, tiny_models):
    """A patcher carrying a callback under the key ComfyUI's node uses is detected; one under another key is not."""
    import comfy.patcher_extension as extension  # `comfy` is the host fixture here

    host = pack_module("host")
    model = comfy.call_node("UNETLoader", unet_name=tiny_models["wan"].name, weight_dtype="default")[0]
    options = model.model_options["transformer_options"]
    assert not host.comfyui_sparse_attention(model, options)
    other = model.clone()
    other.add_callback_with_key(extension.CallbacksMP.ON_PREPARE_STATE, "another_pack", lambda *args: None)
    assert not host.comfyui_sparse_attention(other, other.model_options["transformer_options"])
    core = model.clone()
    core.add_callback_with_key(extension.CallbacksMP.ON_PREPARE_STATE, "block_sparse_attention", lambda *args: None)
    assert host.comfyui_sparse_attention(core, core.model_options["transformer_options"])


def _acting_run(**overrides) -> SparseAttentionRun:
    settings = SparseAttentionSettings(dense_fraction=0.0, dense_first_blocks=1, dense_last_blocks=0, min_tokens=0,
                                       dense_above=1.0, min_density=1.0, **overrides)
    return SparseAttentionRun(settings=settings, video_tokens=256, first_frame_tokens=64, num_layers=4, total_steps=4)


def test_containers_are_taken_for_sparse_calls_and_handed_on_for_dense_ones():
    attention = pytest.importorskip("comfy.ldm.modules.attention")
    if not hasattr(attention, "AttentionTensorContainer"):
        pytest.skip("this host passes no attention tensor containers")
    hooks, keys = pack_module("attention_hooks"), pack_module("keys")
    container = attention.AttentionTensorContainer
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 64, generator=generator) for _ in range(3))
    run = _acting_run()
    options = {"optimized_attention_override": hooks.carnator_attention_override, keys.ATTENTION_RUN_KEY: run}

    def call(layer: int, **extra_options):
        tensors = tuple(container(t) for t in (q, k, v))
        out = attention.optimized_attention(*tensors, 2, skip_reshape=True, skip_output_reshape=True,
                                            transformer_options={**options, keys.BLOCK_KEY: layer, **extra_options})
        return out, tensors

    sparse, taken = call(layer=2)
    assert run.sparse_calls == 1 and torch.equal(sparse, _acting_run().attend(q, k, v, 2, layer=2, step=0))
    for spent in taken:
        with pytest.raises(RuntimeError):
            spent.peek()

    dense, handed_on = call(layer=0)  # a dense-first block: ComfyUI's attention gets the containers
    assert run.sparse_calls == 1
    assert torch.equal(dense, attention.optimized_attention(q, k, v, 2, skip_reshape=True, skip_output_reshape=True))
    for spent in handed_on:
        with pytest.raises(RuntimeError):
            spent.peek()

    received = []

    def previous(func, *args, **kwargs):
        return func(*args, **kwargs)

    def previous_containers(*args, **kwargs):
        received.append(all(isinstance(a, container) for a in args[:3]))
        return attention.optimized_attention(*args, **kwargs)

    previous.container_function = previous_containers
    call(layer=0, **{keys.PREVIOUS_OVERRIDE_KEY: previous})
    assert received == [True]  # the override before Carnator's got the dense call in its containers

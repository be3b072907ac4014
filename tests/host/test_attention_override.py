"""Carnator's attention override is on a run's hook only where Carnator's attention acts (in-process, tiny Wan).

- a run whose attention stays dense for Carnator (too few video tokens) samples with the host's own override (or
  none), never Carnator's, and bit for bit as without Carnator;
- next to ComfyUI's own block-sparse attention (its "Model Sparse Attention" node's callback under that node's key):
  no attention of Carnator's in the run, latent reuse still hits, the report says in one line whose attention it is;
- where the host passes q, k and v in containers and the override before Carnator's takes them, Carnator's takes them
  for a sparse call only and hands a dense one on in its containers;
- a dense call runs the function the model called; a mask passed by position is honoured on a sparse call; LTX's
  guide-mask slices count as video self-attention.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

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
from carnator_core.reuse.recording import entry_writer


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
    entry_writer().flush()
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


def _run_options(run: SparseAttentionRun, previous=None) -> dict:
    """A run's transformer_options with Carnator's hooks installed as a sampling run installs them."""
    hooks, keys = pack_module("attention_hooks"), pack_module("keys")
    carnator = pack_module("run_state").CarnatorRun(attention=run)
    options = {keys.RUN_KEY: carnator}
    if previous is not None:
        options["optimized_attention_override"] = previous
    hooks._hook_into_run(options, carnator, torch.nn.Module(), SimpleNamespace(model_options={"transformer_options": options}))
    return options


def _qkv(tokens: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, tokens, 64, generator=generator) for _ in range(3))


@pytest.mark.usefixtures("comfy")  # the pack loaded
def test_containers_are_taken_for_sparse_calls_and_handed_on_for_dense_ones():
    attention = pytest.importorskip("comfy.ldm.modules.attention")
    if not hasattr(attention, "AttentionTensorContainer"):
        pytest.skip("this host passes no attention tensor containers")
    container = attention.AttentionTensorContainer
    q, k, v = _qkv()

    def call(options: dict, layer: int):
        tensors = tuple(container(t) for t in (q, k, v))
        out = attention.optimized_attention(*tensors, 2, skip_reshape=True, skip_output_reshape=True,
                                            transformer_options={**options, "block_index": layer})
        return out, tensors

    run = _acting_run()
    options = _run_options(run)
    sparse, taken = call(options, layer=2)
    assert run.sparse_calls == 1 and torch.equal(sparse, _acting_run().attend(q, k, v, 2, layer=2, step=0))
    for spent in taken:
        with pytest.raises(RuntimeError):
            spent.peek()

    dense, handed_on = call(options, layer=0)  # a dense-first block: the function the model called gets them
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
    chained = _acting_run()
    call(_run_options(chained, previous), layer=0)
    assert received == [True]  # the override before Carnator's got the dense call in its containers
    sparse, _ = call(_run_options(chained, previous), layer=2)
    assert chained.sparse_calls == 1 and received == [True]


@pytest.mark.usefixtures("comfy")  # the pack loaded
def test_a_dense_call_runs_the_attention_function_the_model_called():
    """A model that calls an attention function of its own (an int8 or device-specific one) directly keeps it for
    every call Carnator leaves dense, in containers or not."""
    attention = pytest.importorskip("comfy.ldm.modules.attention")
    called = []

    @attention.wrap_attn
    def device_attention(q, k, v, heads, **kwargs):
        called.append(type(q))
        return "device attention"

    q, k, v = _qkv()
    options = {**_run_options(_acting_run()), "block_index": 0}  # a dense-first block
    inputs = [(q, k, v)]
    if hasattr(attention, "AttentionTensorContainer"):
        inputs.append(tuple(attention.AttentionTensorContainer(t) for t in (q, k, v)))
    for tensors in inputs:
        assert device_attention(*tensors, 2, skip_reshape=True, transformer_options=options) == "device attention"
    assert called == [torch.Tensor] * len(inputs)


@pytest.mark.usefixtures("comfy")  # the pack loaded
def test_a_mask_passed_by_position_is_honoured_on_a_sparse_call():
    """Core `CrossAttention` passes its mask by position (`optimized_attention_masked(q, k, v, heads, mask, ...)`)."""
    attention = pytest.importorskip("comfy.ldm.modules.attention")
    q, k, v = _qkv()
    valid = torch.ones(1, 256, dtype=torch.bool)
    valid[:, -32:] = False
    run = _acting_run()
    options = {**_run_options(run), "block_index": 2}
    out = attention.optimized_attention(q, k, v, 2, valid, None, True, True, transformer_options=options)
    assert run.sparse_calls == 1
    assert torch.equal(out, _acting_run().attend(q, k, v, 2, layer=2, step=0, key_valid=valid[0]))
    assert not torch.allclose(out, _acting_run().attend(q, k, v, 2, layer=2, step=0))


@pytest.mark.usefixtures("comfy")  # the pack loaded
def test_guide_mask_slices_count_as_video_self_attention_and_video_to_audio_does_not():
    """LTX's guide-mask attention splits the queries of video self-attention in slices under a mask over every key;
    a run whose self-attention all went so is not said to be patched by someone else."""
    attention = pytest.importorskip("comfy.ldm.modules.attention")
    hooks = pack_module("attention_hooks")
    q, k, v = _qkv()
    run = _acting_run()
    options = {**_run_options(run), "block_index": 2}
    audio = torch.randn(1, 2, 40, 64)
    attention.optimized_attention(audio, k, v, 2, skip_reshape=True, transformer_options=options)  # video to audio
    assert run.self_attention_calls == 0
    for rows in (slice(0, 200), slice(200, 256)):
        mask = torch.zeros(1, 1, rows.stop - rows.start, 256)
        attention.optimized_attention(q[:, :, rows], k, v, 2, mask=mask, skip_reshape=True, low_precision_attention=False,
                                      transformer_options=options)
    assert run.self_attention_calls == 2 and run.sparse_calls == 0
    hooks.settle(run, SimpleNamespace(get_model_object=lambda name: torch.nn.Module()))
    assert run.inactive == ""

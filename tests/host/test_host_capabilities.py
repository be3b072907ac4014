"""What Carnator does on a host that is not the one it was built for (in-process, tiny Wan model).

- a host that lacks a hook Carnator needs: the pack loads, says once what it lacks, and samples plain;
- arguments a newer host adds to the sampling wrappers reach the sampler untouched;
- a packed multi-latent run (LTX-2 audio + video: noise (B, 1, N) with the shapes beside it) whose shapes do not add
  up: a clean, reported miss; sparse attention takes its video only where the token count tells it apart;
- another patch that takes video self-attention past the attention override: reported, never as sparse.
"""

from __future__ import annotations

import importlib
import json
import math
import sys

import pytest
import torch
from support.comfy_host import captured_logs, pack_module
from support.reuse_graphs import with_reuse
from support.t2v_graphs import SAMPLER, wan_t2v

from carnator_core.reuse.recording import entry_writer


def _run(comfy, graph: dict) -> tuple[torch.Tensor, list[dict]]:
    comfy.unload_models()
    run = comfy.run_prompt(comfy.complete(graph))
    entry_writer().flush()
    return run.output(SAMPLER)["samples"], json.loads(run.output("carnator_report", 1))


def test_a_host_without_a_needed_hook_samples_plain_and_says_so_once(comfy, tiny_models, monkeypatch,
                                                                    fresh_process_state):
    attention = importlib.import_module("comfy.ldm.modules.attention")  # `comfy` is the host fixture here
    graph = wan_t2v(tiny_models["wan"].name, steps=4, seed=5, sampler_name="euler")
    plain, _ = _run(comfy, with_reuse(graph, "stores/hooks", prompt="a red ball", record=False))
    # a host without the attention override hook (the host applied wrap_attn at import; sampling does not need it)
    monkeypatch.delattr(attention, "wrap_attn")
    fresh_process_state()  # the hooks are looked for again; the fixture's reset after the test forgets what it found
    with captured_logs() as logs:
        first, reports = _run(comfy, with_reuse(graph, "stores/hooks", prompt="a red ball"))
        second, _ = _run(comfy, with_reuse(graph, "stores/hooks", prompt="a red ball", top_k=5))
    assert reports == []  # no wrapper ran: nothing looked up, probed, reported or recorded
    assert torch.equal(first, plain) and torch.equal(second, plain)
    lacking = [line for line in logs if "this ComfyUI lacks" in line]
    assert len(lacking) == 1 and "optimized_attention_override" in lacking[0], logs


def test_wrappers_pass_on_arguments_they_do_not_know(comfy, tiny_models):
    """A newer host may call the sampling wrappers with more keywords: Carnator's pass them on untouched (a harness
    wrapper outside Carnator's adds one, another inside takes it off and counts it), and the run still reuses."""
    arrivals = next(m for k, m in sys.modules.items() if k.endswith("carnator_harness")).newer_host_arrivals
    graph = wan_t2v(tiny_models["wan"].name, steps=6, seed=9, sampler_name="euler")
    _run(comfy, with_reuse(graph, "stores/extra", prompt="a red ball"))
    graph["outer"] = {"class_type": "HarnessNewerHostArgument", "inputs": {"model": graph[SAMPLER]["inputs"]["model"],
                                                                         "mode": "add"}}
    graph[SAMPLER]["inputs"]["model"] = ["outer", 0]
    graph = with_reuse(graph, "stores/extra", prompt="a red ball")
    graph["inner"] = {"class_type": "HarnessNewerHostArgument", "inputs": {"model": ["carnator_reuse", 0],
                                                                         "mode": "take"}}
    graph[SAMPLER]["inputs"]["model"] = ["inner", 0]
    before = dict(arrivals)
    _, reports = _run(comfy, graph)
    assert {kind: arrivals[kind] - before[kind] for kind in arrivals} == {"OUTER_SAMPLE": 1, "SAMPLER_SAMPLE": 1}
    assert reports[0]["hit"] and reports[0]["skipped_steps"] == 3, json.dumps(reports[0])


@pytest.mark.parametrize("shapes", [2, 3])
def test_packed_multi_latent_run_whose_shapes_do_not_add_up_is_a_reported_miss(shapes):
    host = pack_module("host")
    packed = torch.zeros(1, 1, 640)
    call = host.outer_sample_arguments((packed, packed, None, torch.linspace(1, 0, 5)), {"latent_shapes": [
        torch.Size([1, 16, 2, 8, 8])] * shapes})
    reason = host.unsupported_latent(call)
    assert reason == f"packed latent shapes {[[1, 16, 2, 8, 8]] * shapes} add up to {2048 * shapes} values, not 640: " \
                     "sampled plain"
    assert host.unsupported_latent(host.outer_sample_arguments((torch.zeros(1, 16, 2, 8, 8),), {
        "latent_shapes": [torch.Size([1, 16, 2, 8, 8])]})) == ""


def test_sparse_attention_takes_the_video_of_a_packed_run_only_where_its_token_count_tells_it_apart():
    host = pack_module("host")
    video, audio = (1, 16, 4, 16, 16), (1, 8, 9, 16)  # 4 x 8 x 8 = 256 video tokens; 9 x 16 audio positions
    for shapes, grid, reason in [([video, audio], (4, 8, 8), ""),
                                 ([(1, 16, 1, 4, 4), audio], None, "packed latent whose other part has as many "
                                                                   "positions as its video has tokens: attention "
                                                                   "stays dense"),
                                 ([audio, audio], None, "packed latent with 0 video parts: attention stays dense")]:
        packed = torch.zeros(1, 1, sum(math.prod(shape[1:]) for shape in shapes))
        call = host.outer_sample_arguments((packed,), {"latent_shapes": shapes})
        assert host.video_token_grid(call, (1, 2, 2)) == (grid, reason), shapes


def test_a_latent_that_is_not_one_tensor_is_a_reported_miss(comfy):
    """A NestedTensor (LTX-2's video and audio before the host packs them) reaching the sampler unpacked."""
    host = pack_module("host")
    nested = pytest.importorskip("comfy.nested_tensor").NestedTensor([torch.zeros(1, 16, 2, 8, 8),
                                                                      torch.zeros(1, 8, 9, 16)])
    call = host.outer_sample_arguments((nested, nested, None, torch.linspace(1, 0, 5)), {})
    assert host.unsupported_latent(call) == "latent of type NestedTensor, not one tensor: sampled plain"


def test_self_attention_patched_past_the_override_is_reported_inactive(comfy, tiny_models):
    graph = wan_t2v(tiny_models["wan"].name, steps=4, seed=3, sampler_name="euler")
    graph["bypass"] = {"class_type": "HarnessBypassAttentionOverride",
                       "inputs": {"model": graph[SAMPLER]["inputs"]["model"]}}
    graph[SAMPLER]["inputs"]["model"] = ["bypass", 0]
    _, reports = _run(comfy, with_reuse(graph, "stores/bypass", prompt="a red ball", sparse_attention="own", min_tokens=0))
    attention = reports[0]["attention"]
    assert attention["self_attention_calls"] == 0 and attention["sparse_calls"] == 0
    assert attention["inactive"] == "sparse attention inactive: attention is patched by carnator_harness"
    assert attention["inactive"] in reports[0]["notes"]
    _, plain_attention = _run(comfy, with_reuse(wan_t2v(tiny_models["wan"].name, steps=4, seed=3,
                                                        sampler_name="euler"), "stores/bypass", prompt="a red ball",
                                                sparse_attention="own", top_k=5, min_tokens=0))
    assert plain_attention[0]["attention"]["self_attention_calls"] > 0 and not plain_attention[0]["attention"]["inactive"]


def test_layers_with_attention_functions_of_their_own_are_named_once(comfy, fresh_process_state):
    """Newer hosts give a layer its own attention function (`comfy_attention.function`); an override installed on
    the model takes its calls, so Carnator says once that in the runs where its attention acts those layers' dense calls
    use the default attention."""
    host = pack_module("host")

    class LayerAttention:
        function = staticmethod(torch.nn.functional.scaled_dot_product_attention)

    plain, carrying = torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Sequential(torch.nn.Linear(2, 2))
    carrying[0].comfy_attention = LayerAttention()
    with captured_logs() as lines:
        host.note_bypassed_attention(plain)
        assert not lines
        host.note_bypassed_attention(carrying)
        host.note_bypassed_attention(carrying)
    assert lines == [
        "Carnator: this model's layers have attention functions of their own; in runs where Carnator's sparse "
        "attention acts, their dense calls use ComfyUI's default attention instead"]

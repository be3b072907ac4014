"""Wan 2.2 14B's two experts as one trajectory, on two tiny Wan models in real ComfyUI (KSamplerAdvanced pair).

A same-prompt repeat skips the high-noise stage whole: one screening call of the first expert, then the second
expert continues from the donor's boundary state. An edit whose screen fails samples both stages plain, bit-identical
to the graph without Carnator. Every bad hand-over samples plain and says why.
"""

from __future__ import annotations

import copy
import itertools
import json
import sys

import pytest
import torch
from support.reuse_graphs import with_expert_reuse, with_reuse
from support.t2v_graphs import HIGH_NOISE, LOW_NOISE, wan22_14b_t2v

from carnator_core.reuse.input_start import INPUT_NOTE
from carnator_core.reuse.recording import entry_writer
from carnator_core.reuse.trajectory import CONTINUED_BEFORE, handover_registry

_stores = itertools.count()
PROMPT = "a red ball rolls left"


@pytest.fixture
def store_path() -> str:
    return f"stores/two-experts-{next(_stores)}"


def _calls() -> dict[str, int]:
    harness = next(m for k, m in sys.modules.items() if k.endswith("carnator_harness"))
    return dict(harness.model_calls)


def _run(comfy, graph: dict) -> tuple[torch.Tensor, dict[str, int], list[dict]]:
    """The request's latent, each expert's forwards and the Carnator reports (stage 1, stage 2)."""
    comfy.unload_models()
    before = _calls()
    run = comfy.run_prompt(comfy.complete(graph))
    entry_writer().flush()
    after = _calls()
    calls = {label: after.get(label, 0) - before.get(label, 0) for label in ("high_noise", "low_noise")}
    reports = json.loads(run.output("carnator_report", 1)) if "carnator_report" in graph else []
    return run.output(LOW_NOISE)["samples"], calls, reports


def _graph(tiny_models, wan_low_noise, steps: int, boundary: int, text: str = PROMPT) -> dict:
    return wan22_14b_t2v(tiny_models["wan"].name, wan_low_noise, steps=steps, boundary=boundary, text=text, seed=5)


def _with_reuse(graph: dict, store_path: str, prompt: str = PROMPT, **options) -> dict:
    return with_expert_reuse(graph, store_path, prompt=prompt, sparse_attention="off", **options)


@pytest.mark.parametrize(("steps", "boundary", "mode", "low_noise_calls"),
                         [(4, 2, "balanced", 2), (4, 2, "fast", 1), (30, 15, "balanced", 15)])
def test_a_same_prompt_repeat_skips_the_high_noise_stage(comfy, tiny_models, wan_low_noise, store_path, steps,
                                                         boundary, mode, low_noise_calls):
    graph = _graph(tiny_models, wan_low_noise, steps, boundary)
    plain, plain_calls, _ = _run(comfy, graph)
    assert plain_calls == {"high_noise": boundary, "low_noise": steps - boundary}
    donor, donor_calls, (first, second) = _run(comfy, _with_reuse(graph, store_path, mode=mode))
    assert torch.equal(donor, plain) and donor_calls == plain_calls
    assert first["stage"] == {"index": 0, "first_step": 0, "hands_over": True, "skipped_whole": False}
    assert second["stage"]["index"] == 1 and second["stage"]["first_step"] == boundary

    repeat, calls, (first, second) = _run(comfy, _with_reuse(graph, store_path, mode=mode))
    assert calls == {"high_noise": 1, "low_noise": low_noise_calls}, (calls, json.dumps([first, second]))
    assert first["hit"] and first["stage"]["skipped_whole"] and first["skipped_steps"] == boundary
    assert first["verdict"] == "stage skipped"
    assert first["model_calls"] == 1 and second["model_calls"] == low_noise_calls
    if mode == "balanced":  # the second expert's first evaluation at the boundary agrees with the donor's
        assert [p["passed"] for p in second["probes"] if p.get("boundary")] == [True], json.dumps(second)
        assert second["reason"] == "continues a stage skipped to a donor's output: the mode's depth ends at the " \
                                   "boundary"
    assert repeat.shape == plain.shape
    assert float((repeat - plain).norm() / plain.norm()) < 5e-3  # fp16 boundary state


def test_an_edit_whose_screen_fails_samples_both_stages_plain(comfy, tiny_models, wan_low_noise, store_path):
    graph = _graph(tiny_models, wan_low_noise, 4, 2)
    _run(comfy, _with_reuse(graph, store_path))
    edited = _graph(tiny_models, wan_low_noise, 4, 2, text="a blue cube spins on a wooden table at night")
    plain, plain_calls, _ = _run(comfy, edited)
    output, calls, (first, second) = _run(comfy, _with_reuse(edited, store_path, prompt=edited["positive"]["inputs"]
                                                              ["text"]))
    assert torch.equal(output, plain) and calls == plain_calls, json.dumps([first, second])
    assert not first["hit"] and not first["stage"]["skipped_whole"]
    assert second["reason"] == "continues a stage that sampled in full: latent reuse off for this stage"


def test_a_latent_edited_between_the_stages_samples_the_second_plain(comfy, tiny_models, wan_low_noise, store_path):
    graph = _with_reuse(_graph(tiny_models, wan_low_noise, 4, 2), store_path)
    _run(comfy, graph)
    edited = copy.deepcopy(graph)
    edited["edit"] = {"class_type": "LatentMultiply", "inputs": {"samples": [HIGH_NOISE, 0], "multiplier": 0.99}}
    edited[LOW_NOISE]["inputs"]["latent_image"] = ["edit", 0]
    output, calls, (first, second) = _run(comfy, edited)
    assert first["hit"] and calls == {"high_noise": 1, "low_noise": 2}
    # not a stage output handed over here: a run from an input, with no earlier run from a close input to reuse
    assert not second["hit"] and INPUT_NOTE in second["notes"] and second["stage"] == {}, json.dumps(second)
    assert output.shape == (1, 16, 2, 8, 8)


def test_the_second_expert_without_carnator_samples_plain_from_the_skipped_stage(comfy, tiny_models, wan_low_noise,
                                                                                store_path):
    graph = _graph(tiny_models, wan_low_noise, 4, 2)
    _run(comfy, _with_reuse(graph, store_path))
    only_first = with_expert_reuse(graph, store_path, prompt=PROMPT, experts=(HIGH_NOISE,), sparse_attention="off")
    output, calls, reports = _run(comfy, only_first)
    handover_registry().flush()  # the stage nobody continued is recorded as it is
    entry_writer().flush()
    assert calls == {"high_noise": 1, "low_noise": 2} and output.shape == (1, 16, 2, 8, 8), json.dumps(reports)
    assert reports[0]["stage"]["skipped_whole"]
    # the first expert without Carnator: nothing is handed over, the second samples plain with its reason (another
    # seed: the plain first stage of the same seed returns the very latent an earlier Carnator stage handed over)
    other_seed = copy.deepcopy(graph)
    for sampler in (HIGH_NOISE, LOW_NOISE):
        other_seed[sampler]["inputs"]["noise_seed"] = 6
    only_second = with_expert_reuse(other_seed, store_path, prompt=PROMPT, experts=(LOW_NOISE,),
                                    sparse_attention="off")
    plain, plain_calls, _ = _run(comfy, other_seed)
    output, calls, [second] = _run(comfy, only_second)
    assert torch.equal(output, plain) and calls == plain_calls
    assert not second["hit"] and INPUT_NOTE in second["notes"] and second["stage"] == {}, json.dumps(second)


def test_a_stage_output_continued_twice_samples_the_second_continuation_as_a_run_from_an_input(
        comfy, tiny_models, wan_low_noise, store_path):
    graph = _with_reuse(_graph(tiny_models, wan_low_noise, 4, 2), store_path)
    graph["again"] = copy.deepcopy(graph[LOW_NOISE])
    graph["again"]["inputs"]["noise_seed"] = 6  # unused without added noise; another input, so the node runs
    graph["again_stats"] = {"class_type": "HarnessLatentStats", "inputs": {"latent": ["again", 0]}}
    comfy.unload_models()
    comfy.drain_events()
    run = comfy.run_prompt(comfy.complete(graph))
    entry_writer().flush()
    reports = [data for event, data, _ in comfy.drain_events() if event == "carnator.status"]  # every run's report
    later = [r for r in reports if r["stage"].get("index") != 0]  # one continues the stage, the other starts anew
    assert sorted(r["stage"].get("index", -1) for r in later) == [-1, 1], json.dumps(reports)
    assert [INPUT_NOTE in r["notes"] and CONTINUED_BEFORE in r["notes"] for r in later if not r["stage"]] == [True], \
        json.dumps(reports)
    assert run.output("again")["samples"].shape == run.output(LOW_NOISE)["samples"].shape


def test_a_schedule_split_between_two_custom_samplers_is_one_trajectory(comfy, tiny_models, store_path):
    """SplitSigmas with DisableNoise on the second SamplerCustomAdvanced (HunyuanVideo 1.5's super-resolution
    stage, split schedules in general): the second sampler continues the first one's output."""
    graph = wan22_14b_t2v(tiny_models["wan"].name, tiny_models["wan"].name, steps=4, boundary=2, seed=5)
    model = ["high_noise_sampling", 0]
    graph.update({
        "sigmas": {"class_type": "BasicScheduler", "inputs": {"model": model, "scheduler": "simple", "steps": 4,
                                                              "denoise": 1.0}},
        "split": {"class_type": "SplitSigmas", "inputs": {"sigmas": ["sigmas", 0], "step": 2}},
        "guider": {"class_type": "CFGGuider", "inputs": {"model": model, "positive": ["positive", 0],
                                                         "negative": ["negative", 0], "cfg": 1.0}},
        "select": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "noise": {"class_type": "RandomNoise", "inputs": {"noise_seed": 5}},
        "no_noise": {"class_type": "DisableNoise", "inputs": {}},
    })
    graph[HIGH_NOISE] = {"class_type": "SamplerCustomAdvanced", "inputs": {
        "noise": ["noise", 0], "guider": ["guider", 0], "sampler": ["select", 0], "sigmas": ["split", 0],
        "latent_image": ["latent", 0]}}
    graph[LOW_NOISE] = {"class_type": "SamplerCustomAdvanced", "inputs": {
        "noise": ["no_noise", 0], "guider": ["guider", 0], "sampler": ["select", 0], "sigmas": ["split", 1],
        "latent_image": [HIGH_NOISE, 0]}}
    for unused in ("low_noise_model", "low_noise_shift", "low_noise_sampling"):
        del graph[unused]
    reuse = with_reuse(graph, store_path, prompt=PROMPT, sparse_attention="off")  # in front of the guider
    plain, plain_calls, _ = _run(comfy, graph)
    donor, _, (first, second) = _run(comfy, reuse)
    assert torch.equal(donor, plain) and plain_calls["high_noise"] == 4
    assert first["stage"]["hands_over"] and second["stage"] == {"index": 1, "first_step": 2, "hands_over": False,
                                                                "skipped_whole": False}
    repeat, calls, (first, second) = _run(comfy, reuse)
    assert first["stage"]["skipped_whole"] and calls["high_noise"] == 1 + 2, json.dumps([first, second])
    assert float((repeat - plain).norm() / plain.norm()) < 5e-3


def test_a_stage_output_sampled_with_fresh_noise_is_not_a_continuation(comfy, tiny_models, wan_low_noise, store_path):
    graph = _with_reuse(_graph(tiny_models, wan_low_noise, 4, 2), store_path)
    graph[LOW_NOISE]["inputs"]["add_noise"] = "enable"  # not a continuation: a run from an input, sampled plain
    plain_graph = copy.deepcopy(graph)
    for node in [n for n in plain_graph if n.startswith("carnator")]:
        del plain_graph[node]
    plain_graph[HIGH_NOISE]["inputs"]["model"] = ["high_noise_sampling", 0]
    plain_graph[LOW_NOISE]["inputs"]["model"] = ["low_noise_sampling", 0]
    plain, plain_calls, _ = _run(comfy, plain_graph)
    output, calls, (first, second) = _run(comfy, graph)
    assert not second["hit"] and INPUT_NOTE in second["notes"] and second["stage"] == {}, json.dumps(second)
    assert torch.equal(output, plain) and calls == plain_calls


def test_a_repeat_at_another_step_count_resumes_its_high_noise_stage_by_sigma(comfy, tiny_models, wan_low_noise,
                                                                              store_path):
    """A 30-step donor (boundary 15) serves the same prompt at 20 steps (boundary 10): the first expert resumes from
    the donor's state where its own schedule reaches it, and the second expert samples its own steps."""
    _run(comfy, _with_reuse(_graph(tiny_models, wan_low_noise, 30, 15), store_path))
    graph = _graph(tiny_models, wan_low_noise, 20, 10)
    plain, plain_calls, _ = _run(comfy, graph)
    repeat, calls, (first, second) = _run(comfy, _with_reuse(graph, store_path))
    assert first["verdict"] in ("resumed", "stage skipped"), json.dumps(first)
    assert first["resumed_at"].get("donor_steps") in (15, None) and first["skipped_steps"] > 0
    assert calls["high_noise"] < plain_calls["high_noise"] and calls["low_noise"] <= plain_calls["low_noise"]
    print(f"\n30-step donor -> 20-step repeat, two experts: {first['verdict']} at step {first['skipped_steps']}/10 of "
          f"the first expert; calls {calls} (plain {plain_calls}); "
          f"relative distance to plain {float((repeat - plain).norm() / plain.norm()):.4f}")
    assert float((repeat - plain).norm() / plain.norm()) < 0.05

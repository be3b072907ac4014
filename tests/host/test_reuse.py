"""Reuse-aware sampling inside real ComfyUI on the tiny Wan model (KSampler template)."""

from __future__ import annotations

import itertools
import json
import logging

import pytest
import torch
from support.comfy_host import captured_logs
from support.reuse_graphs import with_reuse
from support.t2v_graphs import SAMPLER, wan_t2v

from carnator_core.demo.graphs import with_easycache
from carnator_core.reuse.recording import entry_writer

_stores = itertools.count()
STEPS = 10


@pytest.fixture
def store_path() -> str:
    return f"stores/reuse-{next(_stores)}"


def _sample(comfy, graph: dict) -> tuple[torch.Tensor, list[dict]]:
    """Run a graph from a cold cache: ComfyUI would otherwise serve an identical prompt without sampling."""
    comfy.unload_models()
    run = comfy.run_prompt(comfy.complete(graph))
    latent = run.output(SAMPLER)["samples"]
    reports = json.loads(run.output("carnator_report", 1)) if "carnator_report" in graph else []
    entry_writer().flush()
    return latent, reports


def _wan(tiny_models, **kwargs) -> dict:
    return wan_t2v(tiny_models["wan"].name, steps=STEPS, **{"sampler_name": "euler", **kwargs})


def test_miss_is_bit_identical_to_plain_ksampler(comfy, tiny_models, store_path):
    plain, _ = _sample(comfy, _wan(tiny_models, seed=3))
    reused, reports = _sample(comfy, with_reuse(_wan(tiny_models, seed=3), store_path, prompt="a red ball"))
    assert reports[0]["hit"] is False and reports[0]["reason"]
    assert torch.equal(plain, reused)


def test_same_prompt_and_seed_resumes_at_deepest_checkpoint(comfy, tiny_models, store_path):
    first, first_reports = _sample(comfy, with_reuse(_wan(tiny_models, seed=7), store_path, prompt="a red ball"))
    second, reports = _sample(comfy, with_reuse(_wan(tiny_models, seed=7), store_path, prompt="a red ball"))
    report = reports[0]
    assert report["hit"], json.dumps(report)
    assert report["skipped_steps"] == 5  # balanced: deepest checkpoint at <= half of 10 steps
    assert report["structure_agreement"] == pytest.approx(1.0, abs=1e-3)  # fp16 checkpoints
    assert first_reports[0]["model_calls"] == STEPS
    # The request's own step 0 confirms the donor (same noise: the donor started from that state); the accepted
    # probe is step 5's evaluation.
    assert [(p["step"], p["passed"], p["confirms_deeper"]) for p in report["probes"]] == [(0, True, True), (5, True, False)]
    assert report["model_calls"] == STEPS - 5 + 1
    # checkpoints are stored as fp16: the resumed result matches to that precision
    relative_error = float((second - first).norm() / first.norm())
    assert relative_error < 2e-3, relative_error


def test_forced_probe_failure_and_changed_seed_get_no_latent_reuse(comfy, tiny_models, store_path):
    plain, _ = _sample(comfy, with_reuse(_wan(tiny_models, seed=11), store_path, prompt="a red ball"))
    rejected, strict = _sample(comfy, with_reuse(_wan(tiny_models, seed=11), store_path, prompt="a red ball",
                                                 structure_threshold=1.0, guidance_threshold=1.0, depth_slope=0.0))
    assert strict[0]["skipped_steps"] == 0 and strict[0]["reason"] == "probe rejected"
    # Rejected at step 0 by the request's own first evaluation, which the sampler then takes as its step 0: the miss
    # costs no extra call and its output is the plain sampler's, bit for bit.
    assert [(p["step"], p["passed"]) for p in strict[0]["probes"]] == [(0, False)]
    assert strict[0]["model_calls"] == STEPS
    assert torch.equal(rejected, plain)
    _, reseeded = _sample(comfy, with_reuse(_wan(tiny_models, seed=12), store_path, prompt="a red ball"))
    assert reseeded[0]["skipped_steps"] == 0
    assert "other initial noise (seed)" in reseeded[0]["skipped_donors"]
    _, serving = _sample(comfy, with_reuse(_wan(tiny_models, seed=13), store_path, prompt="a red ball",
                                           seed_policy="serving", structure_threshold=-1.0,
                                           guidance_threshold=-1.0, depth_slope=0.0))
    assert serving[0]["skipped_steps"] > 0


def test_safe_mode_never_resumes(comfy, tiny_models, store_path):
    _sample(comfy, with_reuse(_wan(tiny_models, seed=5), store_path, prompt="a red ball", mode="safe"))
    _, reports = _sample(comfy, with_reuse(_wan(tiny_models, seed=5), store_path, prompt="a red ball", mode="safe"))
    assert reports[0]["skipped_steps"] == 0


def test_carnator_ksampler_is_a_drop_in_for_ksampler(comfy, tiny_models, store_path):
    plain_graph = _wan(tiny_models, seed=21)
    plain, _ = _sample(comfy, plain_graph)
    graph = with_reuse(_wan(tiny_models, seed=21), store_path, prompt="a red ball")
    reuse_inputs = graph.pop("carnator_reuse")["inputs"]
    graph[SAMPLER] = {"class_type": "CarnatorKSampler",
                      "inputs": {**plain_graph[SAMPLER]["inputs"], **{k: v for k, v in reuse_inputs.items()
                                                                     if k != "model"}}}
    first, first_reports = _sample(comfy, graph)
    assert torch.equal(first, plain) and not first_reports[0]["hit"]
    second, reports = _sample(comfy, graph)
    assert reports[0]["skipped_steps"] == 5
    assert float((second - first).norm() / first.norm()) < 2e-3


def test_reuse_sampler_with_lookup_in_a_sampler_custom_advanced_graph(comfy, tiny_models, store_path):
    from support.t2v_graphs import LATENT, POSITIVE, hunyuan_video_t2v

    from carnator_core.demo.graphs import STORE, with_report, with_store

    graph = hunyuan_video_t2v(tiny_models["hunyuan_video"].name, steps=STEPS, seed=4)
    plain, _ = _sample(comfy, graph)
    graph = with_store(graph, store_path)
    graph["lookup"] = {"class_type": "CarnatorCompatibilityLookup", "inputs": {  # otherwise the nodes' defaults
        "model": ["model_sampling", 0], "positive": [POSITIVE, 0], "latent": [LATENT, 0], "prompt": "a red ball",
        "store": [STORE, 0], "sigmas": ["sigmas", 0]}}
    graph["reuse_sampler"] = {"class_type": "CarnatorReuseSampler", "inputs": {
        "sampler": ["ksampler_select", 0], "match": ["lookup", 0], "store": [STORE, 0], "prompt": "a red ball"}}
    graph[SAMPLER]["inputs"]["sampler"] = ["reuse_sampler", 0]
    graph = with_report(graph)
    first, first_reports = _sample(comfy, graph)
    assert torch.equal(first, plain) and not first_reports[0]["hit"]
    repeat, reports = _sample(comfy, graph)  # the same request again: an exact repeat through the reuse sampler too
    assert reports[0]["verdict"] == "exact repeat" and reports[0]["model_calls"] == 1 and torch.equal(repeat, first)
    graph["reuse_sampler"]["inputs"]["exact_repeats"] = False
    second, reports = _sample(comfy, graph)
    assert reports[0]["skipped_steps"] == 5, json.dumps(reports[0])
    assert reports[0]["guidance_cosine"] is None  # BasicGuider: cfg 1, no uncond half
    assert float((second - first).norm() / first.norm()) < 2e-3


def test_text_only_baseline_resumes_without_a_probe(comfy, tiny_models, store_path):
    _sample(comfy, with_reuse(_wan(tiny_models, seed=31), store_path, prompt="a red ball"))
    _, reports = _sample(comfy, with_reuse(_wan(tiny_models, seed=31), store_path, prompt="a red ball",
                                           verification="text-only"))
    report = reports[0]
    assert report["skipped_steps"] == 5 and report["probes"] == [] and report["structure_agreement"] is None
    assert report["model_calls"] == STEPS - 5


def test_guidance_boost_changes_only_the_steps_after_a_resume(comfy, tiny_models, store_path):
    first, _ = _sample(comfy, with_reuse(_wan(tiny_models, seed=41), store_path, prompt="a red ball"))
    plain_resume, reports = _sample(comfy, with_reuse(_wan(tiny_models, seed=41), store_path, prompt="a red ball",
                                                      record=False))
    boosted, boosted_reports = _sample(comfy, with_reuse(_wan(tiny_models, seed=41), store_path, prompt="a red ball",
                                                         record=False, guidance_boost=0.5, guidance_boost_steps=2))
    assert reports[0]["skipped_steps"] == boosted_reports[0]["skipped_steps"] == 5
    assert not torch.equal(boosted, plain_resume)
    assert boosted_reports[0]["model_calls"] == reports[0]["model_calls"]  # a boost costs no extra evaluation


def test_text_only_baseline_says_why_it_declined(comfy, tiny_models, store_path):
    _sample(comfy, with_reuse(_wan(tiny_models, seed=51), store_path, prompt="a red ball"))
    _, reports = _sample(comfy, with_reuse(_wan(tiny_models, seed=51), store_path,
                                           prompt="lecture notes on quantum chromodynamics",
                                           verification="text-only", min_similarity=-1.0))
    assert reports[0]["skipped_steps"] == 0 and reports[0]["candidates"]
    assert reports[0]["reason"] == "text similarity too low for the baseline's skip table"


def test_probes_of_several_donors_share_one_model_call(comfy, tiny_models, store_path):
    """probe_batch=2: both donors' step-5 states are evaluated in one call; the first in planner order that
    passes is taken, as the sequential probe would, and the result matches it."""
    for text in ("a red ball rolls left", "a red ball rolls right"):
        _sample(comfy, with_reuse(_wan(tiny_models, seed=21, text=text), store_path, prompt=text))
    accept_all = {"structure_threshold": -1.0, "guidance_threshold": -1.0, "depth_slope": 0.0, "record": False}
    request = _wan(tiny_models, seed=21, text="a red ball rolls left")
    batched, batched_reports = _sample(comfy, with_reuse(request, store_path, prompt="a red ball rolls left",
                                                         probe_batch=2, **accept_all))
    sequential, sequential_reports = _sample(comfy, with_reuse(request, store_path, prompt="a red ball rolls left",
                                                               probe_batch=1, **accept_all))
    report, baseline = batched_reports[0], sequential_reports[0]
    # Both donors are confirmed by the request's own step 0, then probed at step 5 in one call (batched) or two.
    assert [(p["step"], p["batched_with"]) for p in report["probes"]] == [(0, 0), (0, 0), (5, 1), (5, 1)], \
        json.dumps(report)
    assert [(p["step"], p["batched_with"]) for p in baseline["probes"]] == [(0, 0), (0, 0), (5, 0)], baseline["probes"]
    assert report["donor_id"] == baseline["donor_id"] and report["skipped_steps"] == 5
    assert report["model_calls"] == baseline["model_calls"] == STEPS - 5 + 1  # step 0, then the probe serves step 5
    relative_error = float((batched - sequential).norm() / sequential.norm())
    assert relative_error < 1e-4, relative_error


def test_rejected_probes_leave_easycache_as_they_found_it(comfy, tiny_models, store_path):
    """Probes run at deep states before step 0; EasyCache follows calls in order. A rejected probe must not
    leave it state that breaks step 0, nor change what EasyCache does in the run. A donor rejected at
    step 0 by the request's own first evaluation hands the run that evaluation and EasyCache's state after it."""
    _sample(comfy, with_reuse(_wan(tiny_models, seed=31), store_path, prompt="a red ball"))
    reject_all = {"structure_threshold": 1.0, "guidance_threshold": 1.0, "depth_slope": 0.0, "record": False,
                  "sparse_attention": "off"}
    screened, reports = _sample(comfy, with_easycache(with_reuse(_wan(tiny_models, seed=31), store_path,
                                                                  prompt="a red ball", **reject_all)))
    assert [(p["step"], p["passed"]) for p in reports[0]["probes"]] == [(0, False)], json.dumps(reports[0])
    easycache_only, _ = _sample(comfy, with_easycache(_wan(tiny_models, seed=31)))
    assert torch.equal(screened, easycache_only)
    # Another seed (serving policy takes any donor): the donor's step 0 is not this request's, so deep probes run.
    reused, reports = _sample(comfy, with_easycache(with_reuse(_wan(tiny_models, seed=32), store_path,
                                                                prompt="a red ball", seed_policy="serving",
                                                                **reject_all)))
    probes = reports[0]["probes"]
    assert reports[0]["reason"] == "probe rejected" and probes and all(p["step"] > 0 for p in probes), \
        json.dumps(reports[0])
    easycache_only, _ = _sample(comfy, with_easycache(_wan(tiny_models, seed=32)))
    assert torch.equal(reused, easycache_only)


def test_easycache_continues_from_an_accepted_probe_and_reports_its_skips(comfy, tiny_models, store_path):
    """After a resume, EasyCache runs on from the accepted probe's evaluation, and its own end-of-run summary
    counts the steps it skipped in this run (it said 0 while a copy of its state did the skipping)."""
    _sample(comfy, with_reuse(_wan(tiny_models, seed=33), store_path, prompt="a red ball"))
    accept_all = {"structure_threshold": -1.0, "guidance_threshold": -1.0, "depth_slope": 0.0}
    graph = with_easycache(with_reuse(_wan(tiny_models, seed=33), store_path, prompt="a red ball",
                                      sparse_attention="off", **accept_all), reuse_threshold=1.0)
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    try:
        with captured_logs(logging.INFO) as logs:
            _, reports = _sample(comfy, graph)
    finally:
        root.setLevel(level)
    assert reports[0]["skipped_steps"] == 5, json.dumps(reports[0])
    summaries = [line for line in logs if line.startswith("EasyCache - skipped")]
    assert len(summaries) == 1 and not summaries[0].startswith("EasyCache - skipped 0/"), summaries


@pytest.mark.parametrize(("sampler_name", "batch_size", "extra_calls"),
                         [("euler", 2, 0), ("dpmpp_2m", 1, 0), ("euler_ancestral", 1, 0), ("uni_pc", 2, 1)])
def test_a_donor_ruled_out_at_step_0_leaves_the_output_plain(comfy, tiny_models, store_path, sampler_name,
                                                           batch_size, extra_calls):
    """The step-0 check is the request's own first evaluation: whatever sampler runs (multistep, ancestral, a batch
    of two), a rejected donor leaves the output the plain sampler's, and the sampler is handed that evaluation as its
    step 0, so the check costs nothing, except where the sampler's first call sees the state rescaled (uni_pc)."""

    def graph(**kwargs) -> dict:
        return _wan(tiny_models, seed=61, batch_size=batch_size, sampler_name=sampler_name, **kwargs)

    _sample(comfy, with_reuse(graph(), store_path, prompt="a red ball rolls left"))
    plain, _ = _sample(comfy, graph(text="a blue cube spins"))
    reused, reports = _sample(comfy, with_reuse(graph(text="a blue cube spins"), store_path, prompt="a blue cube spins",
                                                min_similarity=-1.0, structure_threshold=1.0, guidance_threshold=1.0,
                                                depth_slope=0.0, sparse_attention="off", record=False))
    assert [(p["step"], p["passed"]) for p in reports[0]["probes"]] == [(0, False)], json.dumps(reports[0])
    assert reports[0]["model_calls"] == STEPS + extra_calls
    assert torch.equal(reused, plain)


def test_uni_pc_after_a_step_0_check_gives_exactly_easycaches_output(comfy, tiny_models, store_path):
    """uni_pc sees the start state rescaled, so it evaluates step 0 itself after the check; with EasyCache in the
    graph that second evaluation of step 0 must still give exactly EasyCache's own output."""

    def graph() -> dict:
        return _wan(tiny_models, seed=37, sampler_name="uni_pc")

    _sample(comfy, with_reuse(graph(), store_path, prompt="a red ball"))
    reject_all = {"structure_threshold": 1.0, "guidance_threshold": 1.0, "depth_slope": 0.0, "record": False,
                  "sparse_attention": "off"}
    screened, reports = _sample(comfy, with_easycache(with_reuse(graph(), store_path, prompt="a red ball",
                                                                  **reject_all)))
    assert [(p["step"], p["passed"]) for p in reports[0]["probes"]] == [(0, False)], json.dumps(reports[0])
    easycache_only, _ = _sample(comfy, with_easycache(graph()))
    assert torch.equal(screened, easycache_only)

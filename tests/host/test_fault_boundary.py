"""Nothing Carnator reads can fail a prompt (`nodes/fault_boundary.py`), inside real ComfyUI on the tiny Wan model.

A failure is injected into one of Carnator's own functions at a time (pytest's monkeypatch): each prompt still
succeeds, its output is the plain graph's bit for bit, and its report names the error in one line. A model that
fails without Carnator, or ComfyUI's interrupt, still fails the prompt with Carnator inserted, without a retry.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import sys

import pytest
import torch
from support.comfy_host import PACK_NAME, captured_logs
from support.reuse_graphs import with_reuse
from support.t2v_graphs import SAMPLER, hunyuan_video_t2v, wan_t2v

from carnator_core.attention import sparse_attention
from carnator_core.demo.graphs import STORE, with_report, with_store
from carnator_core.lookup import fingerprint as fingerprint_module
from carnator_core.reuse import decision
from carnator_core.reuse.cached_evaluation import CachedEvaluation
from carnator_core.reuse.history_replay import HistoryReplay
from carnator_core.reuse.recording import entry_writer
from carnator_core.reuse.run import ReuseRun

STEPS = 6
INJECTED = "injected fault"
_stores = itertools.count()


def _raise(*args, **kwargs):
    raise RuntimeError(INJECTED)


@pytest.fixture
def store_path() -> str:
    return f"stores/fault-{next(_stores)}"


@pytest.fixture(scope="module")
def host(comfy):
    """The pack's host bridge module, as ComfyUI's loader imported it."""
    return sys.modules[f"{comfy.base_dir / 'custom_nodes' / PACK_NAME}.nodes.host"]


def _sample(comfy, graph: dict) -> tuple[torch.Tensor, list[dict]]:
    """Run a graph from a cold cache: ComfyUI would otherwise serve an identical prompt without sampling."""
    comfy.unload_models()
    run = comfy.run_prompt(comfy.complete(graph))
    reports = json.loads(run.output("carnator_report", 1)) if "carnator_report" in graph else []
    entry_writer().flush()
    return run.output(SAMPLER)["samples"], reports


def _wan(tiny_models, seed: int, sampler_name: str = "euler") -> dict:
    return wan_t2v(tiny_models["wan"].name, steps=STEPS, seed=seed, sampler_name=sampler_name)


def _one_line_error(report: dict, where: str) -> str:
    """The report's line that names the injected error (its reason or a note)."""
    lines = [line for line in [report["reason"], *report.get("notes", ())] if INJECTED in line]
    assert lines, json.dumps(report)
    assert f"Carnator error while {where}: RuntimeError: {INJECTED}" in lines[0] and "\n" not in lines[0]
    return lines[0]


def test_a_fingerprint_that_raises_is_a_plain_run(comfy, tiny_models, store_path, host, monkeypatch):
    plain, _ = _sample(comfy, _wan(tiny_models, seed=1))
    monkeypatch.setattr(host, "fingerprint", _raise)
    guarded, reports = _sample(comfy, with_reuse(_wan(tiny_models, seed=1), store_path, prompt="a red ball"))
    assert torch.equal(plain, guarded)
    assert reports[0]["reason"] == f"model not fingerprinted: RuntimeError: {INJECTED}"


def test_a_weight_that_cannot_be_read_is_a_plain_run(comfy, tiny_models, store_path, host, monkeypatch,
                                                     fresh_process_state):
    """A weight not materialised (a meta tensor, as lazy loaders hold them) cannot be copied out: a clean miss."""
    plain, _ = _sample(comfy, _wan(tiny_models, seed=2))
    unpatched = host._unpatched_weights

    def one_weight_on_meta(model_patcher):
        for index, weight in enumerate(unpatched(model_patcher)):
            meta = tuple(torch.empty(part.shape, dtype=part.dtype, device="meta") for part in weight.parts)
            yield dataclasses.replace(weight, parts=meta) if index == 0 else weight

    monkeypatch.setattr(host, "_unpatched_weights", one_weight_on_meta)
    fresh_process_state()  # the model's fingerprint from the plain run is forgotten
    guarded, reports = _sample(comfy, with_reuse(_wan(tiny_models, seed=2), store_path, prompt="a red ball"))
    assert torch.equal(plain, guarded)
    assert reports[0]["reason"] == "model not fingerprinted: a weight is a meta tensor (it holds no data)"


def test_a_sample_of_weights_that_raises_is_a_plain_run(comfy, tiny_models, store_path, host, monkeypatch,
                                                        fresh_process_state):
    plain, _ = _sample(comfy, _wan(tiny_models, seed=3))
    monkeypatch.setattr(fingerprint_module, "tensor_sample", _raise)
    fresh_process_state()  # the model's fingerprint from the plain run is forgotten
    guarded, reports = _sample(comfy, with_reuse(_wan(tiny_models, seed=3), store_path, prompt="a red ball"))
    assert torch.equal(plain, guarded)
    assert reports[0]["reason"] == f"model not fingerprinted: RuntimeError: {INJECTED}"


def test_a_mask_estimate_that_raises_turns_attention_dense(comfy, tiny_models, monkeypatch):
    """Sparse attention on every block and step (as tests/host/test_sparse_attention.py runs it): its first mask
    estimate fails, so that call and every later one run dense and the output is the plain sampler's."""
    size = {"width": 256, "height": 256}
    plain_graph = wan_t2v(tiny_models["wan"].name, steps=4, seed=4, **size)
    plain, _ = _sample(comfy, plain_graph)
    graph = wan_t2v(tiny_models["wan"].name, steps=4, seed=4, **size)
    graph["sparse"] = {"class_type": "CarnatorSparseAttention", "inputs": {
        "model": graph[SAMPLER]["inputs"]["model"], "source": "own", "dense_fraction": 0.0, "dense_first_blocks": 0,
        "dense_last_blocks": 0, "dense_above": 1.0, "min_tokens": 0}}
    graph[SAMPLER]["inputs"]["model"] = ["sparse", 0]
    monkeypatch.setattr(sparse_attention, "estimate_block_mass", _raise)
    guarded, reports = _sample(comfy, with_report(graph))
    assert torch.equal(plain, guarded)
    assert _one_line_error(reports[0], "running sparse attention").startswith("dense attention: ")
    assert reports[0]["hit"] is False and reports[0]["attention"]["sparse_calls"] == 0


@pytest.mark.parametrize("failing, where", [("observe_step", "recording a step"), ("finish", "recording the run")])
def test_a_recording_that_raises_leaves_the_output_plain_and_records_nothing(comfy, tiny_models, store_path,
                                                                             monkeypatch, failing, where):
    plain, _ = _sample(comfy, _wan(tiny_models, seed=5))
    monkeypatch.setattr(ReuseRun, failing, _raise)
    graph = with_reuse(_wan(tiny_models, seed=5), store_path, prompt="a red ball")
    guarded, reports = _sample(comfy, graph)
    assert torch.equal(plain, guarded)
    _one_line_error(reports[0], where)
    monkeypatch.undo()
    _, later = _sample(comfy, graph)  # nothing recorded: the same request again has no donor
    assert later[0]["skipped_steps"] == 0 and later[0]["reason"] == "no candidate", json.dumps(later[0])


@pytest.mark.parametrize("sampler_name, target, failing, where", [
    ("euler", decision, "probe_signals", "probing donors"),
    ("euler", CachedEvaluation, "serves", "answering the sampler from the donor"),
    ("dpmpp_2m", HistoryReplay, "answer", "answering the sampler from the donor"),
])
def test_a_failure_in_a_resumed_run_samples_it_again_plain(comfy, tiny_models, store_path, monkeypatch, sampler_name,
                                                           target, failing, where):
    """The donor is the same request, recorded: unguarded, the second run resumes. A failure while probing leaves
    the run plain; one after it resumed (serving the probe, replaying a multistep sampler's history) samples the
    run again plain from the start. Either way the output is the first (plain) run's, bit for bit."""
    graph = with_reuse(_wan(tiny_models, seed=6, sampler_name=sampler_name), store_path, prompt="a red ball")
    plain, first = _sample(comfy, graph)
    assert not first[0]["hit"]
    monkeypatch.setattr(target, failing, _raise)
    with captured_logs(logging.ERROR) as logged:
        guarded, reports = _sample(comfy, graph)
    assert torch.equal(plain, guarded)
    assert reports[0]["skipped_steps"] == 0
    _one_line_error(reports[0], where)
    tracebacks = [line for line in logged if "Traceback" in line]
    assert len(tracebacks) == 1 and INJECTED in tracebacks[0], logged
    monkeypatch.undo()
    _, unguarded = _sample(comfy, graph)  # the same request without the failure does resume from that donor
    assert unguarded[0]["skipped_steps"] > 0, json.dumps(unguarded[0])


def test_a_failure_in_a_reuse_samplers_resumed_run_samples_it_again_plain(comfy, tiny_models, store_path,
                                                                          monkeypatch):
    """The same through CarnatorReuseSampler in a SamplerCustomAdvanced graph (the reuse SAMPLER's own entry)."""
    graph = hunyuan_video_t2v(tiny_models["hunyuan_video"].name, steps=STEPS, seed=7)
    graph = with_store(graph, store_path)
    graph["reuse_sampler"] = {"class_type": "CarnatorReuseSampler", "inputs": {
        "sampler": ["ksampler_select", 0], "store": [STORE, 0], "prompt": "a red ball", "exact_repeats": False}}
    graph[SAMPLER]["inputs"]["sampler"] = ["reuse_sampler", 0]
    graph = with_report(graph)
    plain, first = _sample(comfy, graph)
    assert not first[0]["hit"]
    monkeypatch.setattr(CachedEvaluation, "serves", _raise)
    guarded, reports = _sample(comfy, graph)
    assert torch.equal(plain, guarded)
    assert reports[0]["reason"].endswith("(sampled again plain from the start)")
    _one_line_error(reports[0], "answering the sampler from the donor")


def test_a_host_error_in_a_run_carnator_altered_samples_it_again_plain(comfy, tiny_models, store_path):
    """A step of the host's CFG path fails at the first call Carnator served on a resume (the same request again:
    its screen and probe pass): what Carnator handed the host may be the cause, so the run is sampled again plain
    from the start, the prompt succeeds with the plain graph's output bit for bit, and the report names the error."""
    def graph(label: str, fail_at: int, reusing: bool = True) -> dict:
        graph = _wan(tiny_models, seed=9)
        graph["post_cfg"] = {"class_type": "HarnessFailingPostCfg",
                             "inputs": {"model": graph[SAMPLER]["inputs"]["model"], "label": label, "fail_at": fail_at}}
        graph[SAMPLER]["inputs"]["model"] = ["post_cfg", 0]
        return with_reuse(graph, store_path, prompt="a red ball") if reusing else with_report(graph)

    plain, _ = _sample(comfy, graph("plain", 0, reusing=False))
    _, first = _sample(comfy, graph("donor", 0))
    assert not first[0]["hit"]
    # its calls: the step-0 screen, the probe, then the sampler's first call, served from the probe
    guarded, reports = _sample(comfy, graph("glitch", 3))
    assert torch.equal(plain, guarded)
    assert reports[0]["reason"] == ("the sampler failed in a run Carnator altered: RuntimeError: host glitch "
                                    "(sampled again plain from the start)"), json.dumps(reports[0])
    _, unguarded = _sample(comfy, graph("steady", 0))  # without the glitch the same request resumes
    assert unguarded[0]["skipped_steps"] > 0, json.dumps(unguarded[0])


class UserModelError(RuntimeError):
    """A model that fails by itself, without Carnator."""


@pytest.mark.parametrize("error", [UserModelError, "interrupt"])
def test_a_model_that_raises_still_fails_the_prompt_without_a_retry(comfy, tiny_models, store_path, error):
    """The model raises at the request's first call, which is the probe of a recorded donor: the host's error (or
    ComfyUI's interrupt) fails the prompt as it would without Carnator, and nothing samples again."""
    import comfy.model_management as mm
    from comfy.patcher_extension import WrappersMP

    raised = mm.InterruptProcessingException if error == "interrupt" else error
    _sample(comfy, with_reuse(_wan(tiny_models, seed=8), store_path, prompt="a red ball"))  # the donor
    store = comfy.call_node("CarnatorStore", path=store_path, size_limit_gb=1.0)[0]
    model = comfy.call_node("UNETLoader", unet_name=tiny_models["wan"].name, weight_dtype="default")[0]
    reusing = comfy.call_node("CarnatorReuse", model=model, store=store, prompt="a red ball", mode="balanced",
                              seed_policy="same-noise", top_k=4, min_similarity=0.5, max_probes=3,
                              structure_threshold=0.8, guidance_threshold=0.8, depth_slope=0.15, guidance_boost=0.0,
                              guidance_boost_steps=0, record=True, sparse_attention="borrowed", enter_recall=0.9,
                              exit_recall=0.75)[0].clone()
    calls = itertools.count(1)

    def broken_model(executor, *args, **kwargs):
        next(calls)
        raise raised("the user's model is broken")

    reusing.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "test-broken-model", broken_model)
    positive = comfy.call_node("HarnessTextConditioning", text="a red ball", family="wan")[0]
    latent = comfy.call_node("EmptyHunyuanLatentVideo", width=64, height=64, length=5, batch_size=1)[0]
    with pytest.raises(raised):
        comfy.call_node("KSampler", model=reusing, seed=8, steps=STEPS, cfg=1.0, sampler_name="euler",
                        scheduler="simple", positive=positive, negative=positive, latent_image=latent, denoise=1.0)
    assert next(calls) == 2  # called once: no retry



def test_a_lookup_that_raises_is_a_clean_miss(comfy, tiny_models, store_path, monkeypatch):
    """CarnatorCompatibilityLookup reading a store that fails: no candidates and the error, never a failed node."""
    lookup_node = sys.modules[f"{comfy.base_dir / 'custom_nodes' / PACK_NAME}.nodes.lookup_node"]
    monkeypatch.setattr(lookup_node, "find_compatible", _raise)
    store = comfy.call_node("CarnatorStore", path=store_path, size_limit_gb=1.0)[0]
    model = comfy.call_node("UNETLoader", unet_name=tiny_models["wan"].name, weight_dtype="default")[0]
    positive = comfy.call_node("HarnessTextConditioning", text="a red ball", family="wan")[0]
    latent = comfy.call_node("EmptyHunyuanLatentVideo", width=64, height=64, length=5, batch_size=1)[0]
    match, report = comfy.call_node("CarnatorCompatibilityLookup", model=model, positive=positive, latent=latent,
                                    top_k=4, min_similarity=0.5, prompt="a red ball", store=store)
    assert match.candidates == []
    assert match.notes == [f"no lookup (clean miss): Carnator error while looking up candidates: RuntimeError: "
                           f"{INJECTED}"]
    assert INJECTED in report

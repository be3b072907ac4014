"""Donors of another step count or scheduler, on the demo model inside real ComfyUI (in-process), with the official
Wan 2.1 template's sampler (uni_pc): a donor's state at σ continues any request of the same noise process whose
schedule reaches σ, as deep in the request's own schedule as a donor of its own schedule would, and a draft at few
steps seeds its final render."""

from __future__ import annotations

import itertools
import json
import threading

import pytest
import torch
from support.demo_runs import CHANGED, DEMO_WEIGHTS, PROMPT, REWORDED, sample_demo

from carnator_core.demo import world
from carnator_core.demo.graphs import (
    LATENT,
    MODEL_CHAIN,
    NEGATIVE,
    POSITIVE,
    SAMPLER,
    base_graph,
    with_report,
    with_reuse,
)
from carnator_core.judging.quality import mse, psnr_from_mse
from carnator_core.reuse.history_replay import REPLAY_NOTE
from carnator_core.reuse.recording import LOOKUP_WAIT_S, PendingEntry, entry_writer

SAMPLER_NAME = "uni_pc"

_stores = itertools.count()


def _graph(prompt: str, steps: int, *, scheduler: str = "simple", store: str | None = None) -> dict:
    graph = base_graph(DEMO_WEIGHTS, prompt, seed=42, steps=steps, cfg=4.0, sampler_name=SAMPLER_NAME,
                       scheduler=scheduler)
    graph[MODEL_CHAIN]["inputs"]["shift"] = 3.0
    if store is None:
        return with_report(graph)
    return with_reuse(graph, store, prompt, sparse_attention="off")




def _psnr(latent: torch.Tensor, reference: torch.Tensor) -> float:
    frames = [world.decode(world.from_raw(x[0].float())) for x in (latent, reference)]
    return psnr_from_mse(mse(*frames))


def _resume(comfy, donor_steps: int, steps: int, *, donor_scheduler: str = "simple",
            scheduler: str = "simple") -> tuple[torch.Tensor, dict]:
    store = f"stores/schedules-{next(_stores)}"
    sample_demo(comfy, _graph(PROMPT, donor_steps, scheduler=donor_scheduler, store=store))
    latent, report = sample_demo(comfy, _graph(REWORDED, steps, scheduler=scheduler, store=store))
    return latent, report


@pytest.mark.parametrize(("donor_steps", "steps"), [(30, 20), (20, 30)])
def test_a_rewording_resumes_as_deep_after_a_donor_of_another_step_count(comfy, donor_steps, steps):
    own, same = _resume(comfy, steps, steps)
    crossed, other = _resume(comfy, donor_steps, steps)
    assert same["skipped_steps"] > 0, json.dumps(same["probes"])
    assert abs(other["skipped_steps"] - same["skipped_steps"]) <= 1, json.dumps(other["probes"])
    assert other["resumed_at"]["donor_steps"] == donor_steps and REPLAY_NOTE not in other["notes"]
    closeness = _psnr(crossed, own)
    print(f"\n{donor_steps}-step donor -> {steps}-step rewording: resumed at step {other['skipped_steps']} "
          f"(σ {other['resumed_at']['sigma']:.3f}; a {steps}-step donor: step {same['skipped_steps']}), "
          f"{other['model_calls']} calls; {closeness:.1f} dB from the resume of a {steps}-step donor")
    assert closeness > 30.0


def test_a_rewording_resumes_after_a_donor_of_another_scheduler(comfy):
    crossed, report = _resume(comfy, 20, 20, donor_scheduler="simple", scheduler="beta")
    plain, _ = sample_demo(comfy, _graph(REWORDED, 20, scheduler="beta"))
    assert report["skipped_steps"] > 0, json.dumps(report)
    print(f"\nsimple donor -> beta rewording: {report['skipped_steps']} of 20 skipped at σ "
          f"{report['resumed_at']['sigma']:.3f}; PSNR to plain {_psnr(crossed, plain):.1f} dB")


def test_a_final_queued_while_its_draft_is_still_being_written_resumes_from_it(comfy):
    """The entry writer held busy (a slow store) until a while after an 8-step draft finished: the 30-step final queued
    right behind the draft waits for the draft's entry and resumes from it."""
    store, release = f"stores/schedules-{next(_stores)}", threading.Event()
    entry_writer().submit(PendingEntry(store=None, meta=None, blobs={}, cond_vector=None,
                                       on_written=lambda _: release.wait(LOOKUP_WAIT_S)))
    try:
        sample_draft = comfy.run_prompt(comfy.complete(_graph(PROMPT, 8, store=store)))
        assert not release.is_set() and sample_draft.output(SAMPLER)["samples"] is not None
        threading.Timer(LOOKUP_WAIT_S / 4, release.set).start()
        _, final = sample_demo(comfy, _graph(PROMPT, 30, store=store))
    finally:
        release.set()
    assert final["verdict"] == "resumed" and final["resumed_at"]["donor_steps"] == 8, json.dumps(final)


def test_a_changed_attribute_misses_a_donor_of_another_step_count(comfy):
    store = f"stores/schedules-{next(_stores)}"
    sample_demo(comfy, _graph(PROMPT, 30, store=store))
    _, changed = sample_demo(comfy, _graph(CHANGED, 20, store=store))
    assert changed["skipped_steps"] == 0 and changed["reason"] == "probe rejected", json.dumps(changed)


_WIDGETS = ("INT", "FLOAT", "BOOLEAN", "STRING")
CUSTOM_STEPS = 6
# ManualSigmas schedules people type: rising part-way, a sigma twice, a zero-length first step, below the donor's
MANUAL = ("1.0, 0.8, 0.85, 0.5, 0.2, 0.0", "1.0, 0.8, 0.8, 0.5, 0.2, 0.0", "1.0, 1.0, 0.6, 0.3, 0.0",
          "0.5, 0.3, 0.1, 0.0")


def _sigmas_nodes(comfy) -> dict[str, dict]:
    """Every node of the host that outputs SIGMAS, with its inputs (required and optional)."""
    info = comfy.object_info(*comfy.node_classes)
    return {name: {**node["input"].get("required", {}), **node["input"].get("optional", {})}
            for name, node in info.items() if "SIGMAS" in node.get("output", [])
            and node.get("python_module", "").split(".")[0] in ("nodes", "comfy_extras")}


def _custom_graph(prompt: str, sigmas_node: dict, store: str | None) -> dict | None:
    """SamplerCustom (uni_pc) on `sigmas_node`'s output; None where a node input cannot be filled."""
    graph = base_graph(DEMO_WEIGHTS, prompt, seed=42, steps=CUSTOM_STEPS, cfg=4.0)
    graph[MODEL_CHAIN]["inputs"]["shift"] = 3.0
    graph["basic"] = {"class_type": "BasicScheduler", "inputs": {"model": [MODEL_CHAIN, 0], "scheduler": "simple",
                                                                 "steps": CUSTOM_STEPS, "denoise": 1.0}}
    graph["custom_sigmas"] = sigmas_node
    graph["sampler_select"] = {"class_type": "KSamplerSelect", "inputs": {"sampler_name": SAMPLER_NAME}}
    graph[SAMPLER] = {"class_type": "SamplerCustom", "inputs": {
        "model": [MODEL_CHAIN, 0], "add_noise": True, "noise_seed": 42, "cfg": 4.0, "positive": [POSITIVE, 0],
        "negative": [NEGATIVE, 0], "sampler": ["sampler_select", 0], "sigmas": ["custom_sigmas", 0],
        "latent_image": [LATENT, 0]}}
    if store is None:
        return with_report(graph)
    return with_reuse(graph, store, prompt, sparse_attention="off")


def _node_with_defaults(name: str, inputs: dict) -> dict | None:
    filled: dict = {}
    for key, spec in inputs.items():
        kind = spec[0] if isinstance(spec, (list, tuple)) and spec else None
        options = spec[1] if isinstance(spec, (list, tuple)) and len(spec) > 1 and isinstance(spec[1], dict) else {}
        if kind == "MODEL":
            filled[key] = [MODEL_CHAIN, 0]
        elif kind == "SIGMAS":
            filled[key] = ["basic", 0]
        elif kind == "LATENT":
            filled[key] = [LATENT, 0]
        elif key == "steps" and kind == "INT":
            filled[key] = CUSTOM_STEPS
        elif isinstance(kind, list) and kind:
            filled[key] = options.get("default", kind[0])
        elif kind == "COMBO" and options.get("options"):
            filled[key] = options.get("default", options["options"][0])
        elif kind in _WIDGETS and "default" in options:
            filled[key] = options["default"]
        else:
            return None
    return {"class_type": name, "inputs": filled}


def test_custom_sigmas_from_every_sigmas_node_resume_or_miss_cleanly(comfy):
    """SamplerCustom on every SIGMAS node the host lists (its defaults at 10 steps; a 10-step simple schedule where it
    takes one)
    and on ManualSigmas schedules that rise, repeat a sigma or start below the donor's: after a 20-step donor of the
    prompt, a rewording completes with a finite output of the latent's shape, resumed or missed with a reason;
    where the plain graph itself fails on that schedule, so may the graph with Carnator, with the same error."""
    graph_nodes = _sigmas_nodes(comfy)
    assert {"BasicScheduler", "KarrasScheduler", "SplitSigmas"} <= set(graph_nodes), sorted(graph_nodes)
    cases = {name: _node_with_defaults(name, inputs) for name, inputs in sorted(graph_nodes.items())}
    if "ManualSigmas" in graph_nodes:
        cases.update({f"ManualSigmas {text!r}": {"class_type": "ManualSigmas", "inputs": {"sigmas": text}}
                      for text in MANUAL})
    store = f"stores/schedules-{next(_stores)}"
    donor, _ = sample_demo(comfy, _custom_graph(PROMPT, _node_with_defaults("BasicScheduler",
                                                                         graph_nodes["BasicScheduler"]), store))
    results, failed = {}, []
    for name, node in cases.items():
        if node is None:
            results[name] = "inputs not fillable from defaults"
            continue
        try:
            latent, report = sample_demo(comfy, _custom_graph(REWORDED, node, store))
        except Exception as error:
            try:
                sample_demo(comfy, _custom_graph(REWORDED, node, None))
            except Exception as plain_error:
                results[name] = f"fails without Carnator too: {type(plain_error).__name__}"
                continue
            failed.append(name)
            results[name] = f"FAILED: {type(error).__name__}: {error}"
            continue
        if tuple(latent.shape) != tuple(donor.shape) or 0 < report["total_steps"] <= report["skipped_steps"] or \
                not bool(torch.isfinite(latent).all()) and bool(torch.isfinite(sample_demo(
                    comfy, _custom_graph(REWORDED, node, None))[0]).all()):
            failed.append(name)  # a wrong shape, a resume at the schedule's end, or a non-finite output plain avoids
        results[name] = (f"resumed at {report['skipped_steps']}/{report['total_steps']}" if report["skipped_steps"]
                         else f"miss ({report['reason']})")
    print("\n" + "\n".join(f"  {name}: {result}" for name, result in results.items()))
    assert not failed, failed

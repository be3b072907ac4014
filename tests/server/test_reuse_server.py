"""Reuse through a real headless ComfyUI server and its /prompt API (tiny models, CPU).

- the three official text-to-video template shapes (Wan 2.1 KSampler; HunyuanVideo SamplerCustomAdvanced
  with BasicGuider, cfg 1; LTX-Video SamplerCustom with LTXVScheduler) with one CarnatorReuse node
  spliced in: the first run records, the same prompt and seed queued again resumes;
- alongside ComfyUI's EasyCache node, in both orders;
- entries persist: a second server process on the same base directory reuses what the first recorded;
- bad store paths give a node error and the server keeps serving; batch 2 never collapses items;
- prompts the text prefetch cannot read get ComfyUI's own answer;
- one `carnator.status` websocket event per sampling run, equal to the CarnatorReport output in /history.

ComfyUI serves an identical prompt from its output cache without sampling. Every run here therefore
gives CarnatorStore a slightly different size limit, which plays no part in matching, so the sampler
runs again while the loaded model stays cached.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.comfy_host import ComfyServer
from support.reuse_graphs import with_reuse
from support.t2v_graphs import GRAPHS, SAMPLER

from carnator_core.client import ExecutionFailed
from carnator_core.demo import graphs
from carnator_core.store.entry import EntryMeta
from carnator_core.store.reuse_store import ReuseStore

pytestmark = [pytest.mark.server, pytest.mark.shared_server]  # see tests/conftest.py: comfy_server

STEPS = 8
RESUME_STEP = 4  # balanced mode: the deepest checkpoint (an 8-step run records every step) at most half-way
FP16_TOLERANCE = 2e-3  # checkpoints are stored as fp16: a resumed result matches the full run to that precision
# The fields every `carnator.status` event and CarnatorReport entry carries (the frontend badge reads them).
STATUS_FIELDS = {
    "prompt_id", "node", "hit", "verdict", "mode", "donor_id", "donor_prompt", "text_similarity", "agreement",
    "skipped_steps", "total_steps", "attention_density", "heads_reuse", "heads_own", "time_s", "time_saved_s",
    "reason",
}
_runs = itertools.count(1)


@dataclass
class ServerRun:
    """One prompt executed by the server: its /history entry and the `carnator.status` events it sent."""

    prompt_id: str
    history: dict
    statuses: list[dict]
    base_dir: Path

    @property
    def report(self) -> dict:
        """The CarnatorReport node's structured output for the (single) sampling run, as /history has it."""
        reports = json.loads(self.history["outputs"]["carnator_report"]["carnator_report"][0])
        assert len(reports) == 1, reports
        return reports[0]

    def latent(self) -> torch.Tensor:
        """The sampled latent, as the SaveLatent node wrote it into the server's output directory."""
        saved = self.history["outputs"][graphs.SAVE_LATENT]["latents"][0]
        return load_file(str(self.base_dir / "output" / saved["subfolder"] / saved["filename"]))["latent_tensor"]


# ComfyUI's EasyCache, with a reuse threshold high enough that it skips steps of the tiny random model (the default
# 0.2 skips none of its 8 steps), so that the two really run together.
EASYCACHE = {"reuse_threshold": 1.0, "start_percent": 0.15, "end_percent": 0.95}


def _graph(tiny_models, family: str, store: str, *, seed: int = 0, batch_size: int = 1, easycache: str = "",
           **options) -> dict:
    """A template graph with Store -> CarnatorReuse -> sampler, a CarnatorReport and a SaveLatent node; `easycache`
    "first" or "last" adds ComfyUI's EasyCache to the model chain before or after CarnatorReuse."""
    graph = GRAPHS[family](tiny_models[family].name, steps=STEPS, seed=seed, batch_size=batch_size,
                           sampler_name="euler")
    if easycache == "first":
        graph = graphs.with_easycache(graph, **EASYCACHE)
    graph = with_reuse(graph, store, **options)
    if easycache == "last":
        graph = graphs.with_easycache(graph, **EASYCACHE)
    return graphs.with_save_latent(graph, f"carnator_test/{family}")


def _run(server: ComfyServer, graph: dict) -> ServerRun:
    """Queue `graph` (node defaults from the server) through the server's client, which follows it on the websocket;
    raises ExecutionFailed naming the node and the error."""
    graph = server.complete(graph)
    graph["carnator_store"]["inputs"]["size_limit_gb"] = 1.0 + next(_runs) / 1000  # defeats the output cache
    run = server.client.run(graph, timeout=300)
    return ServerRun(run.prompt_id, run.history, run.statuses, server.base_dir)


def _entries(base_dir: Path, store: str, count: int, timeout: float = 60.0) -> list[EntryMeta]:
    """The store's entries once the server's background recorder has written `count` of them (oldest first)."""
    directory = base_dir / store if store else base_dir / "user" / "carnator" / "store"
    deadline = time.monotonic() + timeout
    while True:
        reader = ReuseStore(str(directory))  # the server created it; opening it here adds or changes no entry
        try:
            metas = [reader.get_meta(entry_id) for entry_id in reader.entry_ids()]
        finally:
            reader.close()
        if len(metas) >= count or time.monotonic() > deadline:
            assert len(metas) == count, f"{directory}: {len(metas)} entries, expected {count}"
            return metas
        time.sleep(0.1)


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _assert_resumed(report: dict, donor: EntryMeta) -> None:
    assert report["hit"] is True, json.dumps(report)
    assert report["skipped_steps"] == RESUME_STEP and report["total_steps"] == STEPS, json.dumps(report)
    assert report["donor_id"] == donor.entry_id
    assert report["structure_agreement"] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("family", sorted(GRAPHS))
def test_template_records_then_resumes_the_same_prompt_and_seed(comfy_server, tiny_models, family: str) -> None:
    store = f"stores/template-{family}"
    graph = _graph(tiny_models, family, store, seed=5)

    first = _run(comfy_server, graph)
    assert first.report["hit"] is False and first.report["reason"] == "no candidate"
    (donor,) = _entries(comfy_server.base_dir, store, 1)
    assert donor.total_steps == STEPS and [c.step for c in donor.checkpoints] == list(range(STEPS))

    second = _run(comfy_server, graph)
    _assert_resumed(second.report, donor)
    if family == "hunyuan_video":  # BasicGuider, no uncond: the structure signal alone decides
        assert second.report["guidance_cosine"] is None
        assert not any(c.guidance for c in donor.checkpoints)
    else:
        assert second.report["guidance_cosine"] == pytest.approx(1.0, abs=1e-2)
    # the resumed run records too, under the same hard key: identical runs give identical schedule
    # fingerprints, also for LTX-Video's token-count-dependent LTXVScheduler
    _, resumed_entry = _entries(comfy_server.base_dir, store, 2)
    assert resumed_entry.hard_key == donor.hard_key
    assert resumed_entry.extra["sigmas"] == donor.extra["sigmas"]
    assert resumed_entry.lineage == {"donor_id": donor.entry_id, "depth": RESUME_STEP}
    assert _relative_error(second.latent(), first.latent()) < FP16_TOLERANCE


def test_status_event_once_per_sampling_run_matches_report(comfy_server, tiny_models) -> None:
    text = "a red ball rolls left"
    graph = _graph(tiny_models, "wan", "stores/status", seed=2, prompt=text)
    miss = _run(comfy_server, graph)
    _entries(comfy_server.base_dir, "stores/status", 1)
    hit = _run(comfy_server, graph)
    for run in (miss, hit):
        assert len(run.statuses) == 1, run.statuses
        (status,) = run.statuses
        assert STATUS_FIELDS <= set(status), STATUS_FIELDS - set(status)
        assert status["prompt_id"] == run.prompt_id and status["node"] == SAMPLER
        assert status["mode"] == "balanced" and status["total_steps"] == STEPS and status["time_s"] > 0
        assert status == run.report  # the websocket event and the CarnatorReport output carry the same data
    assert miss.statuses[0]["hit"] is False and miss.statuses[0]["reason"] == "no candidate"
    assert miss.statuses[0]["skipped_steps"] == 0 and miss.statuses[0]["agreement"] is None
    assert miss.statuses[0]["verdict"] == "miss"
    assert miss.history["outputs"]["carnator_report"]["text"][0].startswith("MISS: no candidate")
    status = hit.statuses[0]
    assert status["hit"] is True and status["reason"] == "" and status["skipped_steps"] == RESUME_STEP
    assert status["donor_prompt"] == text and status["text_similarity"] == pytest.approx(1.0, abs=1e-2)
    assert status["agreement"] == pytest.approx(1.0, abs=1e-2) and status["time_saved_s"] > 0
    assert status["verdict"] == "resumed"
    assert hit.history["outputs"]["carnator_report"]["text"][0].startswith(f"HIT: resumed at step {RESUME_STEP}/{STEPS}")


@pytest.mark.parametrize("easycache_first", [True, False], ids=["easycache-then-carnator", "carnator-then-easycache"])
def test_alongside_easycache(comfy_server, tiny_models, easycache_first: bool) -> None:
    store = f"stores/easycache-{easycache_first}"
    plain = _run(comfy_server, _graph(tiny_models, "wan", f"{store}-plain", seed=9, record=False))
    graph = _graph(tiny_models, "wan", store, seed=9, easycache="first" if easycache_first else "last")

    first = _run(comfy_server, graph)
    assert len(first.statuses) == 1 and first.report["hit"] is False
    assert _relative_error(first.latent(), plain.latent()) > 1e-3  # EasyCache skipped steps
    (donor,) = _entries(comfy_server.base_dir, store, 1)

    second = _run(comfy_server, graph)
    report = second.report
    assert len(second.statuses) == 1 and report["hit"] is True and report["donor_id"] == donor.entry_id
    # At a step EasyCache skipped, the recorded x0 is EasyCache's extrapolation, not the model's prediction:
    # such checkpoints are marked and never probed, so the resume may land shallower than without EasyCache.
    extrapolated = {c.step for c in donor.checkpoints if not c.evaluated}
    assert extrapolated, donor.checkpoints  # EasyCache skipped some recorded steps in this graph
    assert 0 < report["skipped_steps"] <= RESUME_STEP and report["skipped_steps"] not in extrapolated
    assert not extrapolated & {p["step"] for p in report["probes"]}
    assert [p["passed"] for p in report["probes"]][-1] is True
    assert torch.isfinite(second.latent()).all()
    # EasyCache's skips depend on the calls it has seen, so a resumed run cannot repeat the first run's skips
    # exactly (its cache continues from the accepted probe's true evaluation). What must hold: resuming adds no
    # error beyond EasyCache's own, measured against the plain sampler.
    assert _relative_error(second.latent(), plain.latent()) <= _relative_error(first.latent(), plain.latent()) + 1e-3


def test_second_server_process_reuses_what_the_first_recorded(comfy_server_factory, new_base_dir, tiny_models) -> None:
    base_dir = new_base_dir()
    graph = _graph(tiny_models, "wan", "", seed=4)  # the default store: <user dir>/carnator/store
    server_a = comfy_server_factory(base_dir)
    first = _run(server_a, graph)
    (donor,) = _entries(base_dir, "", 1)
    server_a.stop()
    assert server_a.process.poll() is not None

    server_b = comfy_server_factory(base_dir)
    assert server_b.pid != server_a.pid
    second = _run(server_b, graph)
    _assert_resumed(second.report, donor)
    assert _relative_error(second.latent(), first.latent()) < FP16_TOLERANCE
    # with exact repeats on (the node's default), the same request after the restart is the first run's output
    repeat = _run(server_b, _graph(tiny_models, "wan", "", seed=4, exact_repeats=True))
    assert repeat.report["verdict"] == "exact repeat" and repeat.report["donor_id"] == donor.entry_id, repeat.report
    assert repeat.report["model_calls"] == 1 and torch.equal(repeat.latent(), first.latent())


def test_store_path_outside_base_dir_is_a_node_error_and_the_server_keeps_serving(comfy_server, tiny_models) -> None:
    with pytest.raises(ExecutionFailed, match="outside the ComfyUI base directory") as error:
        _run(comfy_server, _graph(tiny_models, "wan", "../elsewhere/store", seed=1))
    assert "CarnatorStore" in str(error.value)
    assert not (comfy_server.base_dir.parent / "elsewhere").exists()
    run = _run(comfy_server, _graph(tiny_models, "wan", "stores/after-error", seed=1))
    assert run.report["total_steps"] == STEPS


def test_directory_that_is_not_a_store_is_a_node_error(comfy_server, tiny_models) -> None:
    directory = comfy_server.base_dir / "not_a_store"
    directory.mkdir()
    (directory / "notes.txt").write_text("my own files")
    with pytest.raises(ExecutionFailed, match="is not a Carnator store"):
        _run(comfy_server, _graph(tiny_models, "wan", "not_a_store", seed=1))
    assert sorted(p.name for p in directory.iterdir()) == ["notes.txt"]  # nothing written into it
    assert comfy_server.get("/system_stats").ok


def test_prompts_the_text_prefetch_cannot_read_get_comfyuis_own_answer(comfy_server, tiny_models) -> None:
    """Every prompt posted passes Carnator's on-prompt handler (the text prefetch) before ComfyUI validates it."""
    unreadable = [{"1": {"class_type": "CarnatorReuse", "inputs": {"prompt": ["9", 0]}}},
                  {"1": {"class_type": "CarnatorReuse"}},
                  {"1": {"class_type": "CarnatorCompatibilityLookup", "inputs": {"prompt": 12}}},
                  {"1": {"class_type": "CarnatorKSampler", "inputs": {"prompt": "", "positive": ["1", 0]}}}]
    for graph in unreadable:
        response = comfy_server.post("/prompt", json={"prompt": graph})
        assert response.status_code == 400 and "error" in response.json(), response.text
    assert "on_prompt_handler" not in comfy_server.log()
    run = _run(comfy_server, _graph(tiny_models, "wan", "stores/after-unreadable", seed=1))
    assert run.report["total_steps"] == STEPS


def test_batch_of_two_resumes_without_collapsing_items(comfy_server, tiny_models) -> None:
    store = "stores/batch"
    graph = _graph(tiny_models, "wan", store, seed=6, batch_size=2)
    first = _run(comfy_server, graph)
    (donor,) = _entries(comfy_server.base_dir, store, 1)
    assert donor.latent_shape[0] == 2
    second = _run(comfy_server, graph)
    _assert_resumed(second.report, donor)
    for latent in (first.latent(), second.latent()):
        assert latent.shape[0] == 2
        assert _relative_error(latent[0], latent[1]) > 0.1  # the two items stay different samples
    for item in range(2):
        assert _relative_error(second.latent()[item], first.latent()[item]) < FP16_TOLERANCE

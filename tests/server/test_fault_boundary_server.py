"""A Carnator error in a resumed run, through a real headless ComfyUI server and its /prompt API: the prompt
succeeds, its latent is the plain graph's bit for bit, and its report names the error in one line.

The fault is injected into the server process by the harness pack (`CARNATOR_HARNESS_FAULT`): serving the resumed
probe's evaluation raises, after the run has left the plain path, so the run samples again plain from the start.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file
from support.reuse_graphs import with_reuse
from support.t2v_graphs import wan_t2v

from carnator_core.demo import graphs
from carnator_core.store.reuse_store import ReuseStore

pytestmark = pytest.mark.server

FAULT = "carnator_core.reuse.cached_evaluation:CachedEvaluation.serves"


def test_a_failure_in_a_resumed_run_is_a_plain_prompt(comfy_server_factory, tiny_models):
    server = comfy_server_factory(env={"CARNATOR_HARNESS_FAULT": FAULT})
    plain_graph = graphs.with_save_latent(wan_t2v(tiny_models["wan"].name, steps=6, seed=3), "fault/plain")
    reuse_graph = graphs.with_save_latent(with_reuse(wan_t2v(tiny_models["wan"].name, steps=6, seed=3),
                                                     "stores/fault", prompt="a red ball"), "fault/reuse")

    def run(graph: dict, size_limit_gb: float = 1.0) -> tuple[torch.Tensor, list]:
        graph = server.complete(graph)
        if "carnator_store" in graph:
            graph["carnator_store"]["inputs"]["size_limit_gb"] = size_limit_gb  # defeats the output cache
        history = server.client.run(graph, timeout=300).history
        saved = history["outputs"][graphs.SAVE_LATENT]["latents"][0]
        latent = load_file(str(server.base_dir / "output" / saved["subfolder"] / saved["filename"]))["latent_tensor"]
        reports = history["outputs"].get("carnator_report", {}).get("carnator_report", ["[]"])
        return latent, json.loads(reports[0])

    plain, _ = run(plain_graph)
    first, first_reports = run(reuse_graph, 1.001)  # records the donor
    assert first_reports[0]["reason"] == "no candidate" and torch.equal(first, plain)
    _written(server.base_dir / "stores" / "fault")  # the recorder writes in the background; the donor must be there
    second, reports = run(reuse_graph, 1.002)  # would resume: serving the probe fails
    assert torch.equal(second, plain)
    assert reports[0]["skipped_steps"] == 0
    assert reports[0]["reason"] == ("Carnator error while answering the sampler from the donor: RuntimeError: "
                                    "injected fault (sampled again plain from the start)")
    assert server.log().count("Traceback") == 1


def _written(directory, timeout: float = 60.0) -> None:
    """Wait until the server's background recorder has written an entry into the store at `directory`."""
    deadline = time.monotonic() + timeout
    while True:
        reader = ReuseStore(str(directory))  # the server created it; opening it here changes no entry
        try:
            count = len(list(reader.entry_ids()))
        finally:
            reader.close()
        if count or time.monotonic() > deadline:
            assert count, f"{directory}: no entry written"
            return
        time.sleep(0.1)

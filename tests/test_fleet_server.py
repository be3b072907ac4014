"""A fleet: two headless ComfyUI workers (separate base directories) sharing one Redis store.

The second worker reuses what the first recorded; Redis killed while both keep running ->
the run completes without reuse and says why; Redis back -> reuse resumes by itself.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator

import pytest
from comfy_host import ComfyServer
from reuse_graphs import with_reuse
from t2v_graphs import GRAPHS

from carnator_core.store import ReuseStore

pytestmark = pytest.mark.server

STEPS = 8
RESUME_STEP = 4  # balanced mode: the deepest checkpoint at most half-way
_runs = itertools.count(1)


def _run(server: ComfyServer, tiny_models, url: str) -> dict:
    """Queue the Wan template through CarnatorStore(url) -> CarnatorReuse; the run's report."""
    graph = with_reuse(GRAPHS["wan"](tiny_models["wan"].name, steps=STEPS, seed=4, sampler_name="euler"), url)
    graph["carnator_store"]["inputs"]["size_limit_gb"] = 1.0 + next(_runs) / 1000  # defeats ComfyUI's output cache
    history = server.run_prompt(graph)
    (report,) = json.loads(history["outputs"]["carnator_report"]["carnator_report"][0])
    return report


def _entries(url: str, count: int, timeout: float = 60.0) -> list[str]:
    """Entry ids once the workers' background recorders have written `count` of them."""
    reader = ReuseStore(url)
    deadline = time.monotonic() + timeout
    while len(ids := list(reader.entry_ids())) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    reader.close()
    assert len(ids) == count, ids
    return ids


@pytest.fixture
def two_workers(comfyui_path, new_base_dir) -> Iterator[tuple[ComfyServer, ComfyServer]]:
    """Two servers on their own base directories, started side by side."""
    workers = [ComfyServer(comfyui_path, new_base_dir()) for _ in range(2)]
    try:
        for worker in workers:
            worker.wait_ready()
        yield workers[0], workers[1]
    finally:
        for worker in workers:
            worker.stop()


def test_two_workers_share_one_redis_store_and_survive_its_outage(two_workers, tiny_models, redis_factory):
    redis_server = redis_factory(persistent=True)  # every write durable: a killed server restarts with its data
    url = redis_server.url + "?timeout_ms=300&retry_ms=200"
    worker_a, worker_b = two_workers

    first = _run(worker_a, tiny_models, url)
    assert first["hit"] is False and first["reason"] == "no candidate"
    (donor,) = _entries(url, 1)
    second = _run(worker_b, tiny_models, url)
    assert second["hit"] is True and second["donor_id"] == donor, second
    assert second["skipped_steps"] == RESUME_STEP
    blob_cache = worker_b.base_dir / "user" / "carnator" / "blob-cache"
    assert any(path.stat().st_size > 0 for path in blob_cache.rglob("cache.db"))  # the donor's checkpoints, kept
    _entries(url, 2)  # worker B recorded its own run too

    redis_server.kill()
    third = _run(worker_b, tiny_models, url)
    assert third["hit"] is False and third["reason"] == "store unavailable: generated without reuse", third
    assert any(note.startswith("store unavailable") for note in third["notes"])
    fourth = _run(worker_b, tiny_models, url)  # still down: generated again, and not logged again
    assert fourth["hit"] is False
    assert worker_b.log().count(f"Carnator store {redis_server.url} unavailable") == 1

    redis_server.start()
    time.sleep(0.3)  # past the retry interval
    fifth = _run(worker_b, tiny_models, url)
    assert fifth["hit"] is True and fifth["skipped_steps"] == RESUME_STEP, fifth
    assert "reachable again" in worker_b.log()
    _entries(url, 3)  # the runs during the outage recorded nothing; this one did

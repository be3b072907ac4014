"""A fleet: two headless ComfyUI workers (separate base directories) sharing one Redis store.

The second worker (configured like an API deployment) reuses what the first recorded; Redis
killed while both keep running -> the run completes without reuse and says why; Redis back ->
reuse resumes by itself. Bad store URLs are errors at the CarnatorStore node, never hangs.
"""

from __future__ import annotations

import itertools
import json
import time

import pytest
from support.comfy_host import ComfyServer, ServerFactory, free_port
from support.redis_host import RedisServer
from support.reuse_graphs import with_reuse
from support.t2v_graphs import GRAPHS

from carnator_core.client import ExecutionFailed
from carnator_core.store.fleet_config import STORE_URL_ENV
from carnator_core.store.reuse_store import ReuseStore

pytestmark = pytest.mark.server

STEPS = 8
RESUME_STEP = 4  # balanced mode: the deepest checkpoint at most half-way
_runs = itertools.count(1)


def _run(server: ComfyServer, tiny_models, url: str, **options) -> dict:
    """Queue the Wan template through CarnatorStore(url) -> CarnatorReuse; the run's report."""
    graph = with_reuse(GRAPHS["wan"](tiny_models["wan"].name, steps=STEPS, seed=4, sampler_name="euler"), url,
                       **options)
    graph["carnator_store"]["inputs"]["size_limit_gb"] = 1.0 + next(_runs) / 1000  # defeats ComfyUI's output cache
    (report,) = server.client.run(server.complete(graph), timeout=300).reports
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
def fleet(redis_factory, comfy_server_factory: ServerFactory) -> tuple[RedisServer, str, ComfyServer, ComfyServer]:
    """One Redis and two workers started side by side: A names the store in its workflows, B is an API
    deployment configured with CARNATOR_STORE_URL whose workflows leave the store path empty. (Redis is asked for
    first, so that the workers stop before it.)"""
    redis_server = redis_factory(persistent=True)  # every write durable: a killed server restarts with its data
    url = redis_server.url + "?timeout_ms=300&retry_ms=200"
    workers = [comfy_server_factory.start(), comfy_server_factory.start(env={STORE_URL_ENV: url})]
    for worker in workers:
        worker.wait_ready()
    return redis_server, url, workers[0], workers[1]


def test_two_workers_share_one_redis_store_and_survive_its_outage(fleet, tiny_models):
    redis_server, url, worker_a, worker_b = fleet
    assert f"using the configured store {redis_server.url}" in worker_b.log()
    for path, message in (("redis://127.0.0.1:port/0", "does not parse"),
                          (f"redis://127.0.0.1:{worker_a.port}/0", "is not a Redis server"),  # ComfyUI's HTTP port
                          ("redis://192.0.2.1:6379/0", "other than this machine and the configured store")):
        with pytest.raises(ExecutionFailed, match=message) as error:  # a node error, never a hang
            _run(worker_a, tiny_models, path)
        assert "CarnatorStore" in str(error.value)

    first = _run(worker_a, tiny_models, url)
    assert first["hit"] is False and first["reason"] == "no candidate"
    (donor,) = _entries(url, 1)
    second = _run(worker_b, tiny_models, "")
    assert second["hit"] is True and second["donor_id"] == donor, second
    assert second["skipped_steps"] == RESUME_STEP
    blob_cache = worker_b.base_dir / "user" / "carnator" / "blob-cache"
    assert any(path.stat().st_size > 0 for path in blob_cache.rglob("cache.db"))  # the donor's checkpoints, kept
    _entries(url, 2)  # worker B recorded its own run too
    repeat = _run(worker_b, tiny_models, "", exact_repeats=True)  # the same request: worker A's output, one call
    assert repeat["verdict"] == "exact repeat" and repeat["donor_id"] == donor and repeat["model_calls"] == 1, repeat

    redis_server.kill()
    third = _run(worker_b, tiny_models, "")
    assert third["hit"] is False and third["reason"] == "store unavailable: generated without reuse", third
    assert any(note.startswith("store unavailable") for note in third["notes"])
    fourth = _run(worker_b, tiny_models, "")  # still down: generated again, and not logged again
    assert fourth["hit"] is False
    assert worker_b.log().count(f"Carnator store {redis_server.url} unavailable") == 1

    redis_server.start()
    time.sleep(0.3)  # past the retry interval
    fifth = _run(worker_b, tiny_models, "")
    assert fifth["hit"] is True and fifth["skipped_steps"] == RESUME_STEP, fifth
    assert "reachable again" in worker_b.log()
    _entries(url, 3)  # the runs during the outage recorded nothing; this one did


@pytest.mark.parametrize("configured", ["wrong password", "closed port"])
def test_a_misconfigured_fleet_store_samples_plain_and_says_why(redis_factory, comfy_server_factory, tiny_models,
                                                                configured):
    """A worker whose configured store cannot be used and a workflow without a CarnatorStore node: the run completes
    without reuse, its report says the store is unavailable with the cause in its notes (the badge reads the
    reason). A CarnatorStore node that opens that store fails with the same message (the first test)."""
    if configured == "wrong password":
        redis_server = redis_factory(password="s3cret")
        url = f"redis://:wrong@127.0.0.1:{redis_server.port}/0?timeout_ms=300"
    else:
        url = f"redis://127.0.0.1:{free_port()}/0?timeout_ms=300"
    graph = with_reuse(GRAPHS["wan"](tiny_models["wan"].name, steps=STEPS, seed=4, sampler_name="euler"), "")
    del graph["carnator_store"], graph["carnator_reuse"]["inputs"]["store"]  # an API workflow: the worker's store
    worker = comfy_server_factory(env={STORE_URL_ENV: url})
    (report,) = worker.client.run(worker.complete(graph), timeout=300).reports
    assert report["hit"] is False and report["reason"] == "store unavailable: generated without reuse", report
    assert any(note.startswith("store unavailable, generating without reuse: ") for note in report["notes"]), report
    assert report["model_calls"] == STEPS
    assert "wrong" not in json.dumps(report)  # the password never appears in a report

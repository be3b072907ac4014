"""The store benchmark runs end to end on both backends and prints the JSON the fleet docs quote: its documented
fields, figures consistent with one another, and nothing left behind in the store."""

from __future__ import annotations

import json

import pytest

from carnator_core.bench.store import DEMO_STEPS, main
from carnator_core.store.reuse_store import ReuseStore

FIELDS = {"backend", "entry_bytes", "entry_bytes_multistep", "get_history_ms", "put_ms", "get_ms", "put_mb_s", "get_mb_s", "lookup_ms", "demo_fetch_ms",
          "demo_step_ms", "hit_fetch_share"}


@pytest.mark.parametrize("backend", ["diskcache", "redis"])
def test_store_benchmark_prints_medians_for_a_wan_sized_entry(backend, request, capsys):
    url = request.getfixturevalue("redis_url") if backend == "redis" else None
    assert main(["--backend", backend, *(["--url", url] if url else []), "--puts", "1", "--lookup-entries",
                 "2000,3000", "--queries", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    # the worker's local blob cache is timed only where blobs come over the network
    assert set(result) == FIELDS | ({"get_local_cache_ms"} if backend == "redis" else set())
    assert result["backend"] == backend
    assert 55 * 2**20 < result["entry_bytes"] < 64 * 2**20  # Wan 2.1 1.3B 480p 81 frames
    # a multistep sampler's entry adds one fp16 latent (16x21x60x104, 4 MiB) per step before the deepest checkpoint
    latent_bytes = 16 * 21 * 60 * 104 * 2
    history_steps = (result["entry_bytes_multistep"] - result["entry_bytes"]) / latent_bytes
    assert history_steps == pytest.approx(24, rel=1e-3)  # 30 steps: the deepest checkpoint is step 24
    timings = [result[key] for key in ("put_ms", "get_ms", "get_history_ms", "demo_fetch_ms", "demo_step_ms")]
    timings += list(result["lookup_ms"].values()) + [result.get("get_local_cache_ms", 1.0)]
    assert all(isinstance(ms, float) and 0 < ms < 60_000 for ms in timings), result
    assert set(result["lookup_ms"]) == {"2000", "3000"}
    # throughput is the entry (put) and what a hit reads (checkpoints and masks, less than the entry) over the median
    assert result["put_mb_s"] == pytest.approx(result["entry_bytes"] / 2**20 / (result["put_ms"] / 1e3))
    assert result["get_mb_s"] < result["entry_bytes"] / 2**20 / (result["get_ms"] / 1e3)
    # a balanced resume saves half of the demo's 30 steps: the share is the fetch over their time
    assert result["hit_fetch_share"] == pytest.approx(result["demo_fetch_ms"] / (DEMO_STEPS // 2 * result["demo_step_ms"]))
    if url is not None:  # the entries it wrote are deleted again
        store = ReuseStore(url)
        try:
            assert list(store.entry_ids()) == []
        finally:
            store.close()

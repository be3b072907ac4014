"""The store benchmark runs end to end on both backends and prints the JSON the fleet docs quote."""

from __future__ import annotations

import json

import pytest

from carnator_core.bench.store import main


@pytest.mark.parametrize("backend", ["diskcache", "redis"])
def test_store_benchmark_prints_medians_for_a_wan_sized_entry(backend, request, capsys):
    url = ["--url", request.getfixturevalue("redis_url")] if backend == "redis" else []
    assert main(["--backend", backend, *url, "--puts", "1", "--lookup-entries", "2000,3000", "--queries", "3",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["backend"] == backend
    assert 55 * 2**20 < result["entry_bytes"] < 64 * 2**20  # Wan 2.1 1.3B 480p 81 frames
    assert result["put_ms"] > 0 and result["get_ms"] > 0
    assert set(result["lookup_ms"]) == {"2000", "3000"} and all(ms > 0 for ms in result["lookup_ms"].values())
    assert result["demo_fetch_ms"] > 0 and result["demo_step_ms"] > 0 and result["hit_fetch_share"] > 0
    assert ("get_local_cache_ms" in result) == (backend == "redis")

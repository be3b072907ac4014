"""What only a store on a server can do wrong: bad URLs and credentials, outages, lost data, memory, local copies.

The store's behaviour on entries is tested once for both backends in test_store.py; these
tests start their own redis-servers (loopback, free ports) where they kill or configure them.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis
import torch
from support.store_writer import synthetic_entry

from carnator_core.lookup.compatible import LookupRequest, find_compatible
from carnator_core.lookup.shortlist import ShortlistIndex
from carnator_core.store.backend import StoreError, StoreUnavailable
from carnator_core.store.entry import EntryMeta
from carnator_core.store.fleet_config import STORE_URL_ENV, configured_store_url
from carnator_core.store.location import open_store, resolve_store_location
from carnator_core.store.redis_backend import parse_redis_url
from carnator_core.store.reuse_store import ReuseStore

HANG_BOUND = 5.0  # seconds: far above every timeout used here, far below a hang


@contextmanager
def fake_server(reply: bytes | None) -> Iterator[int]:
    """A TCP server on a free loopback port that answers every connection with `reply`, or stays silent."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    connections = []

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            connections.append(connection)
            if reply is not None:
                connection.recv(4096)
                connection.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
        for connection in connections:
            connection.close()


def _put(store: ReuseStore, tag: str, number: int = 0, floats: int = 64) -> EntryMeta:
    meta, blobs, vectors = synthetic_entry(tag, number, floats)
    store.put(meta, blobs, vectors)
    return meta


@pytest.mark.parametrize(("url", "message"), [
    ("redis://", "names no host"),
    ("redis://cache.internal:port/0", "does not parse"),
    ("redis://cache.internal/zero", "database number"),
    ("redis://cache.internal/0?timeout=5", "unknown option 'timeout'"),
    ("redis://cache.internal/0?timeout_ms=soon", "timeout_ms must be a number"),
    ("redis://cache.internal/0?timeout_ms=0", "must lie between"),
    ("memcached://cache.internal", "scheme must be redis"),
])
def test_urls_that_do_not_parse_are_clear_errors(url, message):
    with pytest.raises(StoreError, match=message):
        ReuseStore(url)


def test_url_credentials_never_show_in_names_or_errors():
    location = parse_redis_url("redis://worker:s3cret@cache.internal:6380/2?timeout_ms=50")
    assert (location.username, location.password, location.db, location.timeout_ms) == ("worker", "s3cret", 2, 50)
    assert location.public_url == "redis://cache.internal:6380/2"
    with pytest.raises(StoreError) as error:
        parse_redis_url("redis://:s3cret@cache.internal:6380/x")
    assert "s3cret" not in str(error.value)


def test_wrong_or_missing_password_is_a_clear_error(redis_factory):
    server = redis_factory(password="s3cret")
    with pytest.raises(StoreError, match="refused the credentials"):
        ReuseStore(f"redis://:wrong@127.0.0.1:{server.port}/0")
    with pytest.raises(StoreError, match="needs a password"):
        ReuseStore(f"redis://127.0.0.1:{server.port}/0")
    store = ReuseStore(server.url)
    assert store.unavailable is None and store.location == f"redis://127.0.0.1:{server.port}/0"


def test_a_server_that_is_not_redis_is_a_clear_error_and_a_silent_one_never_a_hang():
    started = time.monotonic()
    with fake_server(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n") as port:
        with pytest.raises(StoreError, match="not a Redis server"):
            ReuseStore(f"redis://127.0.0.1:{port}/0?timeout_ms=200")
    with fake_server(None) as port:  # accepts, never answers: slow, not wrong
        store = ReuseStore(f"redis://127.0.0.1:{port}/0?timeout_ms=200&retry_ms=0")
        assert "Timeout" in store.unavailable
        assert store.get_meta("0" * 32) is None and store.sequence() == 0
        with pytest.raises(StoreUnavailable):
            _put(store, "silent")
    assert time.monotonic() - started < HANG_BOUND


def test_outage_means_no_reuse_logged_once_and_reuse_resumes_by_itself(redis_factory, caplog):
    server = redis_factory(persistent=True)
    store = ReuseStore(server.url + "?timeout_ms=300&retry_ms=100")
    donor = _put(store, "outage")
    vectors = store.get_vectors(donor.entry_id)
    request = LookupRequest(hard_key=donor.hard_key, cond_vector=vectors.cond, prompt=donor.prompt,
                            text_vector=vectors.text)
    assert find_compatible(store, request, top_k=2, min_similarity=0.5).best.entry_id == donor.entry_id

    server.kill()
    with caplog.at_level(logging.WARNING, logger="carnator.store"):
        match = find_compatible(store, request, top_k=2, min_similarity=0.5)
        assert match.candidates == [] and "store unavailable" in match.notes[0]
        assert store.get_tensors(donor.entry_id, "checkpoints") is None
        store.record_hit(donor.entry_id, 1.0)
        with pytest.raises(StoreUnavailable):
            _put(store, "outage", 1)  # dropped whole
        time.sleep(0.15)  # past the retry interval: the next call tries again, and fails again
        assert store.get_meta(donor.entry_id) is None
        assert store.unavailable is not None
    assert sum("unavailable" in record.message for record in caplog.records) == 1

    server.start()
    time.sleep(0.15)
    with caplog.at_level(logging.WARNING, logger="carnator.store"):
        match = find_compatible(store, request, top_k=2, min_similarity=0.5)
    assert match.best.entry_id == donor.entry_id and store.unavailable is None
    assert any("reachable again" in record.message for record in caplog.records)
    assert store.stats(donor.entry_id).hits == 0  # the hit during the outage was not counted
    assert len(set(store.entry_ids())) == 1  # and the failed write left nothing behind
    _put(store, "outage", 2)
    assert len(set(store.entry_ids())) == 2


def test_server_that_lost_its_data_starts_the_index_over(redis_factory):
    server = redis_factory()  # no persistence: a restart empties it
    store = ReuseStore(server.url + "?retry_ms=0")
    index = ShortlistIndex()
    for number in range(3):
        _put(store, "lost", number)
    assert index.refresh(store) == 3
    server.kill()
    server.start()
    assert store.get_meta("0" * 32) is None  # notices the restart (the old connection is gone)
    survivor = _put(store, "lost", 3)
    assert ReuseStore(server.url).unavailable is None  # the schema marker was written again
    assert index.refresh(store) == 1
    assert len(index) == 1
    assert index.query(survivor.hard_key, store.get_vectors(survivor.entry_id).cond, None, 3, -1.0).candidates[
        0].entry_id == survivor.entry_id


def _bytes_sent(server) -> int:
    return int(server.client().info("stats")["total_net_output_bytes"])


def test_local_blob_cache_serves_repeat_reads_and_follows_upstream_eviction(redis_url, redis_server, tmp_path):
    writer = ReuseStore(redis_url)
    meta = _put(writer, "cached", floats=100_000)
    worker = ReuseStore(redis_url, blob_cache_root=str(tmp_path / "blob-cache"))
    first = worker.get_tensors(meta.entry_id, "checkpoints")["x"]
    sent = _bytes_sent(redis_server)
    second = worker.get_tensors(meta.entry_id, "checkpoints")["x"]
    assert torch.equal(first, second)
    assert _bytes_sent(redis_server) - sent < 10_000  # a length check, not the 200 kB blob
    assert writer.delete(meta.entry_id)  # evicted upstream, by another worker
    assert worker.get_blob(meta.entry_id, "checkpoints") is None
    assert worker._blob_cache.get(f"blob/{meta.entry_id}/checkpoints", 1) is None  # the copy is gone too


def test_memory_budget_stays_under_redis_maxmemory(redis_factory, caplog):
    server = redis_factory(maxmemory=32 * 2**20)
    store = ReuseStore(server.url, size_limit=2**30)
    assert store.budget() == 24 * 2**20  # a share of maxmemory, leaving room for Redis' own overhead
    # Another program keeps 12 MB on the same server (its own database), so Redis refuses writes before
    # the budget is reached: the store then makes room by its own value-based eviction instead of failing.
    redis.Redis(port=server.port, db=1).set("their-data", b"x" * 12 * 2**20)
    for number in range(80):  # 32 MB of entries
        _put(store, "budget", number, floats=200_000)
        assert store.used_bytes() <= store.budget()
    assert 20 < len(list(store.entry_ids())) < 60
    assert store.used_bytes() < 20 * 2**20
    server.client().config_set("maxmemory-policy", "allkeys-lru")
    with caplog.at_level(logging.WARNING, logger="carnator.store"):
        ReuseStore(server.url).budget()
    assert any("maxmemory-policy is allkeys-lru" in record.message for record in caplog.records)


def test_configured_store_comes_from_the_environment_or_the_settings_file(tmp_path):
    settings = tmp_path / "settings.json"
    assert configured_store_url(str(settings), {}) is None
    settings.write_text(json.dumps({"store_url": "redis://cache.internal:6379/1"}))
    assert configured_store_url(str(settings), {}) == "redis://cache.internal:6379/1"
    assert configured_store_url(str(settings), {STORE_URL_ENV: "redis://other:6379/0"}) == "redis://other:6379/0"
    with pytest.raises(StoreError, match=f"configured in {STORE_URL_ENV}.*does not parse"):
        configured_store_url(str(settings), {STORE_URL_ENV: "redis://other:port/0"})
    settings.write_text("{broken")
    with pytest.raises(StoreError, match="unreadable"):
        configured_store_url(str(settings), {})


def test_workflows_may_name_local_or_configured_redis_servers_only(tmp_path):
    base, default = str(tmp_path), str(tmp_path / "store")
    configured = "redis://:s3cret@cache.internal:6379/0"
    assert resolve_store_location("", base, configured, configured, allow_outside=False) == configured
    assert resolve_store_location("redis://127.0.0.1:7000/3", base, default, None, False) == "redis://127.0.0.1:7000/3"
    assert resolve_store_location("redis://localhost/0", base, default, None, False) == "redis://localhost/0"
    # a report or an older workflow names the configured store without its password: the worker supplies it
    assert resolve_store_location("redis://cache.internal:6379/0", base, default, configured, False) == configured
    with pytest.raises(StoreError, match="other than this machine"):
        resolve_store_location("redis://10.1.2.3:6379/0", base, default, configured, False)
    assert resolve_store_location("redis://10.1.2.3/0", base, default, None, True) == "redis://10.1.2.3/0"


def test_one_store_object_per_server_database_in_a_process(redis_url):
    store = open_store(redis_url, 2**30)
    again = open_store(redis_url + "?timeout_ms=100", 2**31)  # client options do not make another store
    assert again is store and store.size_limit == 2**31
    other_db = open_store(redis_url.rsplit("/", 1)[0] + "/1")
    assert other_db is not store and other_db.location.endswith("/1")

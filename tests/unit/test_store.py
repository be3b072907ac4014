"""The reuse store on both backends: round trips, concurrency, crash safety, hostile content, eviction, schema.

Every test taking `location` runs once on a diskcache directory and once on a real Redis
database (a loopback redis-server started for the session). Hostile or foreign content is
planted the way an attacker or another program would: with plain diskcache or redis clients.
"""

from __future__ import annotations

import json
import os
import pickle
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import diskcache
import numpy as np
import pytest
import redis
import torch
from support.store_writer import Exploit, synthetic_entry

from carnator_core.store.backend import StoreError, UnsafeValueError, is_store_url
from carnator_core.store.entry import SCHEMA_VERSION, CheckpointRecord, CorruptEntryError, EntryMeta, HardKey
from carnator_core.store.location import is_loopback_host, resolve_store_directory
from carnator_core.store.reuse_store import IndexVectors, ReuseStore
from carnator_core.store.tensor_codec import decode_tensors, encode_tensors

WRITER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "store_writer.py")


@pytest.fixture(params=["diskcache", "redis"])
def location(request, tmp_path) -> str:
    """Where a test's store lives: a new directory, or an empty Redis database."""
    if request.param == "redis":
        return request.getfixturevalue("redis_url")
    return str(tmp_path / "store")


def plant(location: str, key: str, value) -> None:
    """Write a raw value as another program would: plain diskcache (pickling what is not bytes) or redis."""
    if is_store_url(location):
        client = redis.Redis.from_url(location)
        if isinstance(value, dict):
            client.delete(key)
            client.hset(key, mapping=value)
        else:
            client.set(key, value if isinstance(value, (bytes, str, int)) else pickle.dumps(value))
    else:
        with diskcache.Cache(location) as cache:
            cache.set(key, value)


def _vectors() -> IndexVectors:
    return IndexVectors(text=torch.nn.functional.normalize(torch.randn(384), dim=0),
                        cond=torch.nn.functional.normalize(torch.randn(256), dim=0))


def test_round_trip_latents_and_masks(location):
    store = ReuseStore(location)
    latent = torch.randn(1, 16, 5, 16, 16)
    mask = torch.rand(12, 40, 40) < 0.2
    packed = torch.from_numpy(np.packbits(mask.numpy(), axis=-1))
    meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=HardKey("m", (5, 8, 8), "s", frame_rate=23.976),
                     prompt="a red ball",
                     checkpoints=[CheckpointRecord(step=5, sigma=0.8)], masks={"block_size": 64, "grid": [40, 40]})
    store.put(meta, {"checkpoints": encode_tensors({"x_5": latent.half()}), "masks": encode_tensors({"w0": packed})},
              _vectors())

    reopened = ReuseStore(location)
    loaded = reopened.get_meta(meta.entry_id)
    assert loaded.prompt == "a red ball" and loaded.checkpoints == [CheckpointRecord(step=5, sigma=0.8)]
    assert loaded.hard_key == meta.hard_key == reopened.index_entries([meta.entry_id])[0].hard_key  # both records
    restored = reopened.get_tensors(meta.entry_id, "checkpoints")["x_5"]
    assert restored.dtype == torch.float16
    assert torch.equal(restored, latent.half())  # bit-exact once fp16 quantisation is accounted for
    unpacked = np.unpackbits(reopened.get_tensors(meta.entry_id, "masks")["w0"].numpy(), axis=-1)[..., :40]
    assert np.array_equal(unpacked.astype(bool), mask.numpy())
    assert reopened.used_bytes() == meta.total_bytes + len(meta.to_json())


def test_values_that_need_pickle_are_refused(location):
    store = ReuseStore(location)
    meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=HardKey("m", (1,), "s"))
    with pytest.raises(UnsafeValueError):
        store.put(meta, {"checkpoints": {"not": "bytes"}}, _vectors())
    with pytest.raises(UnsafeValueError):
        store.backend.set("meta/x", {"a": 1})
    assert list(store.entry_ids()) == []


def test_planted_pickle_payload_is_never_executed(location, tmp_path):
    store = ReuseStore(location)
    meta, blobs, vectors = synthetic_entry("victim", 0, 64)
    store.put(meta, blobs, vectors)
    Exploit.marker = tmp_path / "pwned"
    for key in (f"meta/{meta.entry_id}", f"emb/{meta.entry_id}", f"blob/{meta.entry_id}/checkpoints",
                f"stats/{meta.entry_id}"):
        plant(location, key, Exploit())
    if not is_store_url(location):  # and a pickled key, straight into SQLite
        payload = pickle.dumps(Exploit())
        with sqlite3.connect(Path(location) / "cache.db") as db:
            db.execute("INSERT INTO Cache (key, raw, store_time, expire_time, access_time, access_count, tag, size, "
                       "mode, filename, value) VALUES (?, 0, 0, NULL, 0, 0, NULL, 0, 4, NULL, ?)", (payload, payload))
    reopened = ReuseStore(location)
    assert reopened.get_meta(meta.entry_id) is None
    assert reopened.get_vectors(meta.entry_id) is None
    assert reopened.get_tensors(meta.entry_id, "checkpoints") is None
    assert reopened.totals()["entries"] == 1  # listed, but every read is refused
    reopened.evict(0)
    assert not Exploit.marker.exists()


def test_blob_file_pointing_outside_the_store_is_refused(tmp_path):
    store = ReuseStore(str(tmp_path / "store"))
    meta, blobs, vectors = synthetic_entry("outside", 0, 65536)  # large enough to live in a file
    store.put(meta, blobs, vectors)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"secret")
    with sqlite3.connect(tmp_path / "store" / "cache.db") as db:
        db.execute("UPDATE Cache SET filename = ? WHERE key = ?", ("../secret.bin", f"blob/{meta.entry_id}/checkpoints"))
    assert ReuseStore(str(tmp_path / "store")).get_blob(meta.entry_id, "checkpoints") is None


def test_corrupt_and_foreign_keys_are_skipped_and_others_still_served(location, caplog):
    store = ReuseStore(location)
    entries = [synthetic_entry("corrupt", n, 64) for n in range(4)]
    for meta, blobs, vectors in entries:
        store.put(meta, blobs, vectors)
    broken, torn, wrong_type, healthy = (entry[0].entry_id for entry in entries)
    store.backend.set(f"meta/{broken}", b"{not json")
    store.backend.set(f"emb/{broken}", b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    store.backend.set(f"blob/{torn}/checkpoints", b"\x00torn")
    plant(location, f"blob/{wrong_type}/checkpoints", {"a": "hash"} if is_store_url(location) else 42)
    plant(location, f"stats/{healthy}", b"not a record")
    plant(location, "someone:else", b"another program's data")
    plant(location, "meta/foreign", b"{}")

    assert store.get_meta(broken) is None
    assert store.get_meta(broken) is None
    assert sum("skipping entry" in r.message and broken in r.message for r in caplog.records) == 1  # logged once
    assert store.get_tensors(torn, "checkpoints") is None
    assert store.get_tensors(wrong_type, "checkpoints") is None
    assert store.get_tensors(healthy, "checkpoints") is not None
    assert store.stats(healthy).hits == 0  # unreadable counters read as fresh ones
    assert [entry.entry_id for entry in store.index_entries([broken, torn, wrong_type, healthy, "foreign"])] == [
        torn, wrong_type, healthy]  # the index needs only the index records
    assert set(store.entry_ids()) == {broken, torn, wrong_type, healthy}
    assert store.delete(broken)  # a corrupt entry can still be removed whole
    assert store.get_blob(broken, "checkpoints") is None
    store.evict(0)
    assert list(store.entry_ids()) == []
    assert store.backend.get("someone:else") == b"another program's data"  # never touched


def test_an_index_record_that_does_not_name_its_entry_is_left_out(location, caplog):
    store = ReuseStore(location)
    unnamed, named = (synthetic_entry("unnamed", n, 64) for n in range(2))
    for entry in (unnamed, named):
        store.put(*entry)
    store.backend.set(f"emb/{unnamed[0].entry_id}", encode_tensors({"cond": unnamed[2].cond.half()}))
    assert [entry.entry_id for entry in store.index_entries([unnamed[0].entry_id, named[0].entry_id])] == [
        named[0].entry_id]
    assert sum("skipping entry" in r.message and unnamed[0].entry_id in r.message for r in caplog.records) == 1


def test_records_stored_as_json_text_read_as_records(tmp_path):
    """A local store may hold its stats and log records as JSON text: entries, counters and ranking read alike."""
    directory = str(tmp_path / "store")
    store = ReuseStore(directory)
    meta, blobs, vectors = synthetic_entry("text", 0, 64)
    store.put(meta, blobs, vectors)
    store.record_hit(meta.entry_id, 3.0)
    as_text = []
    with diskcache.Cache(directory) as cache:
        for key in list(cache.iterkeys()):
            value = cache.get(key)
            if isinstance(key, str) and key.startswith(("stats/", "seq/")) and isinstance(value, bytes):
                cache.set(key, value.decode("utf-8"))
                as_text.append(key.split("/")[0])
    assert sorted(as_text) == ["seq", "stats"]
    reopened = ReuseStore(directory)
    assert reopened.stats(meta.entry_id).hits == 1
    assert [entry.entry_id for entry in reopened.index_entries(list(reopened.entry_ids()))] == [meta.entry_id]

def test_two_processes_writing_concurrently_lose_nothing(location):
    ReuseStore(location)
    writers = [subprocess.Popen([sys.executable, WRITER, location, "60", tag], stdout=subprocess.PIPE, text=True)
               for tag in ("left", "right")]
    written = set()
    for writer in writers:
        out, _ = writer.communicate(timeout=300)
        assert writer.returncode == 0
        written |= {line.split()[1] for line in out.splitlines() if line.startswith("wrote ")}
    assert len(written) == 120
    store = ReuseStore(location)
    assert set(store.entry_ids()) == written
    prompts = {meta.prompt for meta in store.get_metas(sorted(written))}
    assert {f"left prompt {n}" for n in range(60)} <= prompts and {f"right prompt {n}" for n in range(60)} <= prompts


def test_writer_killed_mid_write_leaves_a_readable_store(location):
    writer = subprocess.Popen([sys.executable, WRITER, location, "100000", "killed", "400000"],
                              stdout=subprocess.PIPE, text=True)
    written = []
    while len(written) < 5:
        line = writer.stdout.readline()
        assert line, "writer died before writing"
        written.append(line.split()[1])
    time.sleep(0.05)  # land the kill inside a later write
    writer.kill()
    writer.wait()
    store = ReuseStore(location)
    ids = list(store.entry_ids())
    assert set(written) <= set(ids)
    for entry_id in ids:  # every entry that is listed is whole
        assert store.get_meta(entry_id) is not None
        assert store.get_tensors(entry_id, "checkpoints")["x"].numel() == 400000
    meta, blobs, vectors = synthetic_entry("after", 0, 64)
    store.put(meta, blobs, vectors)
    assert store.get_meta(meta.entry_id) is not None


def test_eviction_keeps_store_under_its_limit_and_spares_valuable_and_pinned(location):
    limit = 600_000
    store = ReuseStore(location, size_limit=limit)
    first_meta, blobs, vectors = synthetic_entry("evict", 0, 20_000)
    store.put(first_meta, blobs, vectors)
    second_meta, blobs, vectors = synthetic_entry("evict", 1, 20_000)
    store.put(second_meta, blobs, vectors)
    store.record_hit(first_meta.entry_id, 3.0)
    assert store.set_pinned(second_meta.entry_id, True)
    assert not store.set_pinned("0" * 32, True)
    for number in range(2, 40):
        meta, blobs, vectors = synthetic_entry("evict", number, 20_000)
        store.put(meta, blobs, vectors)
        assert store.used_bytes() <= limit
    ids = set(store.entry_ids())
    assert first_meta.entry_id in ids and second_meta.entry_id in ids
    assert len(ids) < 40
    assert store.used_bytes() == sum(m.total_bytes + len(m.to_json()) for m in store.get_metas(sorted(ids)))


def test_hit_counters_add_up_under_concurrent_updates(location):
    store = ReuseStore(location)
    meta, blobs, vectors = synthetic_entry("hits", 0, 64)
    store.put(meta, blobs, vectors)
    views = [ReuseStore(location) for _ in range(4)]  # as four workers would

    def hit(view: ReuseStore) -> None:
        for _ in range(10):
            view.record_hit(meta.entry_id, 1.5)

    threads = [threading.Thread(target=hit, args=(view,)) for view in views]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats = store.stats(meta.entry_id)
    assert stats.hits == 40 and stats.seconds_saved == pytest.approx(60.0) and stats.last_hit_at > 0
    assert store.totals()["hits"] == 40
    store.record_hit("0" * 32, 1.0)  # an entry that is gone: nothing happens
    assert store.stats("0" * 32) is None


def test_directory_that_is_not_a_store_is_refused(tmp_path):
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"jpeg")
    with pytest.raises(StoreError, match="not a Carnator store"):
        ReuseStore(str(foreign))
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(StoreError, match="is a file"):
        ReuseStore(str(a_file))


def test_store_holding_other_data_is_refused(location):
    plant(location, "someone", b"else")
    with pytest.raises(StoreError, match="not a Carnator store"):
        ReuseStore(location)


def test_store_from_a_newer_schema_is_refused_with_a_clear_error(location):
    store = ReuseStore(location)
    store.backend.set("carnator/schema", json.dumps({"format": "carnator-store",
                                                     "schema_version": SCHEMA_VERSION + 1}).encode())
    with pytest.raises(StoreError, match="newer Carnator"):
        ReuseStore(location)


def test_store_paths_must_stay_inside_the_base_directory(tmp_path):
    base = tmp_path / "comfy"
    base.mkdir()
    default = str(base / "user" / "carnator" / "store")
    assert resolve_store_directory("", str(base), default, allow_outside=False) == os.path.realpath(default)
    assert resolve_store_directory("stores/a", str(base), default, allow_outside=False) == str(base / "stores" / "a")
    for escape in ("../elsewhere", "/etc", "stores/../../x"):
        with pytest.raises(StoreError, match="outside the ComfyUI base directory"):
            resolve_store_directory(escape, str(base), default, allow_outside=False)
    assert resolve_store_directory("/srv/store", str(base), default, allow_outside=True) == "/srv/store"


def test_one_url_and_one_loopback_predicate():
    """Store locations and Host headers are told apart by the same two tests (store/location.py)."""
    assert all(is_store_url(url) for url in ("redis://cache:6379/0", "rediss://[::1]/0", "http://elsewhere/x"))
    assert not any(is_store_url(path) for path in ("/srv/store", "stores/a", "C:\\store", ""))
    assert all(is_loopback_host(host) for host in ("localhost", "LOCALHOST", "127.0.0.1", "127.8.0.1", "::1", "[::1]",
                                                    "::ffff:127.0.0.1"))
    assert not any(is_loopback_host(host) for host in ("localhost.", "example.com", "10.0.0.1", "0.0.0.0", "[::]", ""))


def test_tensor_codec_rejects_garbage():
    from carnator_core.store.tensor_codec import CorruptBlobError

    with pytest.raises(CorruptBlobError):
        decode_tensors(b"\xff" * 32)
    assert torch.equal(decode_tensors(encode_tensors({"a": torch.arange(4)}))["a"], torch.arange(4))


def test_checkpoint_records_read_and_write_the_entry_json_as_recorded():
    """The metadata's checkpoint list, as a run records it, is read into typed records and written back unchanged;
    a malformed record makes the entry corrupt (skipped), never a KeyError in the planner."""
    listing = [{"step": 0, "sigma": 1.0, "guidance": True, "evaluated": True, "start": "noise"},
               {"step": 15, "sigma": 0.5, "guidance": True, "evaluated": False}]
    meta = EntryMeta(entry_id="e", hard_key=HardKey(model="m", grid=(1, 2, 2), schedule="s"))
    record = json.loads(meta.to_json())
    record["checkpoints"] = listing
    loaded = EntryMeta.from_json(json.dumps(record))
    assert loaded.checkpoints == [CheckpointRecord(step=0, sigma=1.0, guidance=True, start="noise"),
                                  CheckpointRecord(step=15, sigma=0.5, guidance=True, evaluated=False)]
    assert json.loads(loaded.to_json())["checkpoints"] == listing
    for malformed in ({"sigma": 0.5}, {"step": "15", "sigma": 0.5}, {"step": 1, "sigma": 0.5, "start": 3}, [1, 0.5]):
        record["checkpoints"] = [malformed]
        with pytest.raises(CorruptEntryError):
            EntryMeta.from_json(json.dumps(record))

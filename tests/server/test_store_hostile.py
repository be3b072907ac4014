"""The local store under hostile ground: its files truncated, deleted, replaced or planted while workers use it.

Every test runs the real store on a real directory and damages it the way a person, a crash
or another program would: truncating or deleting SQLite files, removing the directory,
planting FIFOs, symlinks and pickles, killing a writer inside a commit. The sampling path must
see clean misses and dropped writes (logged once), never an exception.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import diskcache
import pytest
from support.store_writer import Exploit, synthetic_entry

from carnator_core.lookup.compatible import LookupRequest, find_compatible
from carnator_core.reuse.recording import PendingEntry, entry_writer
from carnator_core.store.backend import StoreError
from carnator_core.store.reuse_store import ReuseStore

pytestmark = pytest.mark.shared_server  # see tests/conftest.py: comfy_server
ROOT = Path(__file__).resolve().parents[2]

# Puts an entry whose second blob is larger than the file size limit: the commit dies (SIGXFSZ) or fails (EFBIG)
# after the first blob's file is written.
COMMIT_BEYOND_FILE_LIMIT = f"""
import resource, signal, sys
sys.path[:0] = [{str(ROOT / "tests")!r}, {str(ROOT)!r}]
import torch
from support.store_writer import synthetic_entry
from carnator_core.store.reuse_store import ReuseStore
from carnator_core.store.tensor_codec import encode_tensors
store = ReuseStore(sys.argv[1])
meta, blobs, vectors = synthetic_entry("beyond", 0, 65536)
blobs["large"] = encode_tensors({{"x": torch.zeros(2**21, dtype=torch.float16)}})
signal.signal(signal.SIGXFSZ, signal.SIG_DFL if sys.argv[2] == "killed" else signal.SIG_IGN)  # Python ignores it
resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
try:
    store.put(meta, blobs, vectors)
except Exception as error:
    print(type(error).__name__, error)
"""


def in_thread(work: Callable[[], object]) -> object:
    """Run `work` on a new thread (its own SQLite connection, as ComfyUI's prompt worker has); re-raise its error."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as error:  # handed to the test thread
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the store call hung"
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def value_file(directory: Path, key: str) -> Path:
    """The file diskcache keeps a large value in."""
    with sqlite3.connect(directory / "cache.db") as db:
        (filename,), = db.execute("SELECT filename FROM Cache WHERE key = ?", (key,)).fetchall()
    return directory / filename


def unreferenced_files(directory: Path) -> set[str]:
    """Value files on disk that no row of the database names (read as an outside program would)."""
    with sqlite3.connect(directory / "cache.db") as db:
        named = {name for (name,) in db.execute("SELECT filename FROM Cache WHERE filename IS NOT NULL")}
    on_disk = {str(path.relative_to(directory)) for path in directory.rglob("*.val")}
    return on_disk - named


def bytes_on_disk(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def skip_lines(caplog: pytest.LogCaptureFixture, word: str) -> int:
    return sum("skipping entry" in record.getMessage() and word in record.getMessage() for record in caplog.records)


def record_through_the_writer(store: ReuseStore, tag: str) -> str:
    """Record an entry the way a finished run does (background writer); its id."""
    meta, blobs, vectors = synthetic_entry(tag, 0, 65536)
    meta.prompt = ""  # no text embedding needed
    entry_writer().submit(PendingEntry(store=store, meta=meta, blobs=blobs, cond_vector=vectors.cond))
    assert entry_writer().flush()
    return meta.entry_id


def damage(directory: Path, kind: str) -> None:
    database = directory / "cache.db"
    if kind == "zeroed":
        os.truncate(database, 0)
    elif kind == "halved":
        with sqlite3.connect(database) as db:  # the pages must be in the file, not only in the journal
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        os.truncate(database, database.stat().st_size // 2)
    else:
        os.remove(directory / "cache.db-wal")


@pytest.mark.parametrize("kind", ["zeroed", "halved", "journal deleted"])
def test_a_damaged_database_gives_clean_misses_and_dropped_writes(tmp_path, caplog, kind):
    directory = tmp_path / "store"
    store = ReuseStore(str(directory))
    donors = [synthetic_entry("donor", n, 65536) for n in range(3)]
    for meta, blobs, vectors in donors:
        store.put(meta, blobs, vectors)
    donor, _, vectors = donors[0]
    damage(directory, kind)

    match = in_thread(lambda: find_compatible(store, LookupRequest(donor.hard_key, vectors.cond), 4, 0.0))
    assert match.candidates == [] and "store unavailable" in match.notes[0]
    assert in_thread(lambda: store.get_tensors(donor.entry_id, "checkpoints")) is None
    in_thread(lambda: store.record_hit(donor.entry_id, 2.0))
    record_through_the_writer(store, "after damage")
    totals = in_thread(store.totals)  # what the stats route and the info node read: no raw SQLite error
    assert totals["entries"] == 0 and "damaged" in store.unavailable
    assert not [r for r in caplog.records if r.exc_info]  # no traceback: the write was dropped quietly
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1

    shutil.rmtree(directory)  # what the message says to do: the store starts afresh by itself
    written = record_through_the_writer(store, "after removal")
    assert store.unavailable is None and ReuseStore(str(directory)).get_meta(written) is not None


def test_a_store_directory_removed_under_a_running_worker_starts_afresh(tmp_path, caplog):
    directory = tmp_path / "store"
    store = ReuseStore(str(directory))
    lost = synthetic_entry("lost", 0, 65536)
    store.put(*lost)
    shutil.rmtree(directory)
    later = [synthetic_entry("later", n, 65536) for n in range(2)]
    for entry in later:
        store.put(*entry)

    restarted = ReuseStore(str(directory))  # another process, or this one after a restart
    assert list(restarted.entry_ids()) == [meta.entry_id for meta, _, _ in later]
    assert restarted.get_tensors(later[0][0].entry_id, "checkpoints") is not None
    assert store.get_meta(lost[0].entry_id) is None
    assert sum("lost its database" in r.getMessage() for r in caplog.records) == 1
    assert unreferenced_files(directory) == set()


def test_leftovers_of_a_lost_database_are_cleared_but_other_files_never(tmp_path):
    directory = tmp_path / "store"
    store = ReuseStore(str(directory))
    store.put(*synthetic_entry("gone", 0, 65536))
    store.close()
    (directory / "cache.db").unlink()  # what an earlier version left: value files and journals, no database
    assert ReuseStore(str(directory)).totals()["entries"] == 0
    assert not list(directory.rglob("*.val"))

    foreign = tmp_path / "foreign"
    leftover = foreign / "ab" / "cd" / f"{'0' * 28}.val"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"value")
    (foreign / "notes.txt").write_text("someone else's")
    with pytest.raises(StoreError, match="not a Carnator store"):
        ReuseStore(str(foreign))
    assert leftover.exists() and not (foreign / "cache.db").exists()


@pytest.mark.parametrize("plant", ["fifo", "link to a file outside", "link to a directory outside"])
def test_value_files_that_are_not_regular_files_inside_the_store_are_corrupt_entries(tmp_path, caplog, plant):
    directory = tmp_path / "store"
    store = ReuseStore(str(directory))
    meta, blobs, vectors = synthetic_entry("planted", 0, 65536)
    store.put(meta, blobs, vectors)
    target = value_file(directory, f"blob/{meta.entry_id}/checkpoints")
    outside = tmp_path / "outside"
    outside.mkdir()
    if plant == "fifo":
        target.unlink()
        os.mkfifo(target)
    elif plant == "link to a file outside":
        shutil.move(target, outside / target.name)  # a perfectly valid blob, but not the store's file
        target.symlink_to(outside / target.name)
    else:
        shutil.move(target.parent, outside / target.parent.name)
        target.parent.symlink_to(outside / target.parent.name)
    try:
        for _ in range(2):
            assert in_thread(lambda: store.get_tensors(meta.entry_id, "checkpoints")) is None
    finally:  # a reader blocked on the FIFO (before the fix) is let go by a writer
        if plant == "fifo":
            with contextlib.suppress(OSError):
                os.close(os.open(target, os.O_WRONLY | os.O_NONBLOCK))
    assert skip_lines(caplog, meta.entry_id) == 1
    assert store.get_meta(meta.entry_id) is not None  # the rest of the entry is still there


@pytest.mark.parametrize("how", ["killed", "failed"])
def test_a_commit_that_dies_midway_leaves_no_files_behind(tmp_path, how):
    directory = tmp_path / "store"
    store = ReuseStore(str(directory))
    kept = synthetic_entry("kept", 0, 65536)
    store.put(*kept)
    result = subprocess.run([sys.executable, "-c", COMMIT_BEYOND_FILE_LIMIT, str(directory), how],
                            capture_output=True, text=True, timeout=300)
    if how == "killed":
        assert result.returncode == -signal.SIGXFSZ, result.stderr
        assert unreferenced_files(directory)  # the dead commit's first blob
        ReuseStore(str(directory))  # the next worker to open the store sweeps them
    else:
        assert result.returncode == 0 and result.stdout.startswith("StoreUnavailable"), result.stdout + result.stderr
    assert unreferenced_files(directory) == set()
    assert store.get_tensors(kept[0].entry_id, "checkpoints") is not None


def test_eviction_sweeps_leftovers_and_volume_counts_what_is_on_disk(tmp_path):
    directory = tmp_path / "store"
    store = ReuseStore(str(directory))
    for number in range(3):
        store.put(*synthetic_entry("volume", number, 65536))
    leftover = directory / "ab" / "cd" / f"{'1' * 28}.val"
    leftover.parent.mkdir(parents=True, exist_ok=True)
    leftover.write_bytes(b"\0" * 100_000)
    assert store.volume() == bytes_on_disk(directory)  # leftovers and journals included
    assert store.evict(store.used_bytes()) == []  # nothing to evict, but the sweep runs
    assert not leftover.exists() and store.volume() == bytes_on_disk(directory)
    assert len(list(store.entry_ids())) == 3


def test_pickled_counters_are_rebuilt_and_never_unpickled(tmp_path, caplog):
    directory = tmp_path / "store"
    store = ReuseStore(str(directory))
    entries = [synthetic_entry("counted", n, 64) for n in range(3)]
    for entry in entries:
        store.put(*entry)
    Exploit.marker = tmp_path / "pwned"
    with diskcache.Cache(str(directory)) as cache:  # plain diskcache pickles what is not bytes, str or a number
        cache.set("carnator/seq", Exploit())
        cache.set("carnator/bytes", Exploit())

    assert list(store.entry_ids()) == [meta.entry_id for meta, _, _ in entries]
    for number in range(3, 5):  # recording goes on, and the counters are right again
        entries.append(synthetic_entry("counted", number, 64))
        store.put(*entries[-1])
    ids = [meta.entry_id for meta, _, _ in entries]
    assert list(ReuseStore(str(directory)).entry_ids()) == ids
    assert store.used_bytes() == sum(m.total_bytes + len(m.to_json()) for m in store.get_metas(ids))
    assert sum("counter was unreadable" in r.getMessage() for r in caplog.records) == 2  # one line each
    assert not Exploit.marker.exists()


def test_pickled_values_are_skipped_with_one_log_line_each(tmp_path, caplog):
    directory = tmp_path / "store"
    store = ReuseStore(str(directory))
    entries = [synthetic_entry("pickled", n, 64) for n in range(3)]
    for entry in entries:
        store.put(*entry)
    no_meta, no_index, no_position = (meta.entry_id for meta, _, _ in entries)
    Exploit.marker = tmp_path / "pwned"
    with diskcache.Cache(str(directory)) as cache:
        for key in (f"meta/{no_meta}", f"emb/{no_index}", "seq/000000000003"):
            cache.set(key, Exploit())

    for _ in range(2):
        assert [meta is None for meta in store.get_metas([no_meta, no_index])] == [True, False]
        assert [entry.entry_id for entry in store.index_entries([no_meta, no_index])] == [no_meta]
        assert store.entries_since(0) == ([no_meta, no_index], 3)
    assert skip_lines(caplog, no_meta) == 1 and skip_lines(caplog, no_index) == 1
    assert skip_lines(caplog, "log position 3") == 1
    assert not Exploit.marker.exists()


def test_a_pickled_schema_marker_is_a_clear_store_error(tmp_path):
    directory = tmp_path / "store"
    ReuseStore(str(directory))
    Exploit.marker = tmp_path / "pwned"
    with diskcache.Cache(str(directory)) as cache:
        cache.set("carnator/schema", Exploit())
    with pytest.raises(StoreError, match="unreadable Carnator schema marker"):
        ReuseStore(str(directory))
    assert not Exploit.marker.exists()


def test_store_node_refuses_a_nan_size_and_a_nul_in_the_path_clearly(comfy):
    with pytest.raises(ValueError, match="Carnator Store: size_limit_gb must be a positive number"):
        comfy.call_node("CarnatorStore", path="", size_limit_gb=float("nan"))
    with pytest.raises(ValueError, match="Carnator Store: store path .* contains a NUL character"):
        comfy.call_node("CarnatorStore", path="stores/a\0b", size_limit_gb=1.0)


@pytest.mark.server
@pytest.mark.parametrize("damage", ["zeroed", "halved"])
def test_a_store_damaged_under_a_running_server_never_fails_a_prompt(comfy_server, tiny_models, damage):
    """Record a donor through the server, damage its database while the server runs, queue a near-duplicate: the
    prompt completes with the plain result and its report says why nothing was reused; the server keeps serving."""
    from support.reuse_graphs import with_reuse
    from support.t2v_graphs import GRAPHS

    from carnator_core.demo.graphs import with_save_latent

    store = f"stores/damaged-{damage}"

    def run(size_limit: float) -> dict:
        graph = with_reuse(GRAPHS["wan"](tiny_models["wan"].name, steps=6, seed=4, sampler_name="euler"), store)
        graph["carnator_store"]["inputs"]["size_limit_gb"] = size_limit  # defeats ComfyUI's output cache
        (report,) = comfy_server.client.run(comfy_server.complete(with_save_latent(graph, damage)), timeout=300).reports
        return report

    assert run(1.001)["reason"] == "no candidate"
    database = comfy_server.base_dir / store / "cache.db"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the server's background recorder has written the donor
        reader = ReuseStore(str(comfy_server.base_dir / store))
        try:
            if list(reader.entry_ids()):
                break
        finally:
            reader.close()
        time.sleep(0.1)
    with sqlite3.connect(database) as db:  # pages still in the write-ahead log stay readable: fold them in first
        db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
    os.truncate(database, 0 if damage == "zeroed" else database.stat().st_size // 2)
    for attempt in (1.002, 1.003):  # and again: the damage is not forgotten between prompts
        report = run(attempt)
        if damage == "zeroed":
            assert report["hit"] is False and report["reason"].startswith("store unavailable"), report
            assert report["model_calls"] == 6
        else:  # pages the server still holds may serve the donor; whatever it cannot read is a clean miss
            assert report["hit"] or report["reason"].startswith("store unavailable"), report
    assert comfy_server.get("/system_stats").ok

"""The process-wide objects are made once, on first use, and one reset drops them all: the next use makes fresh ones,
and what runs a thread or holds a connection is closed, the latest made first (entries submitted before the reset are
still written)."""

from __future__ import annotations

from support.store_writer import synthetic_entry

from carnator_core import process_state
from carnator_core.reuse.recording import PendingEntry, entry_writer
from carnator_core.store.location import open_store, opened_stores
from carnator_core.store.reuse_store import ReuseStore


def test_an_object_is_made_once_and_again_after_a_reset(fresh_process_state):
    made: list[object] = []

    def make() -> object:
        made.append(object())
        return made[-1]

    assert process_state.one("test object", make) is process_state.one("test object", make) is made[0]
    fresh_process_state()
    assert process_state.one("test object", make) is made[1] and len(made) == 2


def test_a_reset_closes_the_latest_made_first(fresh_process_state):
    closed: list[str] = []

    class Closing:
        def __init__(self, name: str) -> None:
            self.name = name

        def close(self) -> None:
            closed.append(self.name)

    for name in ("first", "second"):
        process_state.one(name, lambda name=name: Closing(name))
    process_state.one("without close", dict)
    fresh_process_state()
    assert closed == ["second", "first"]


def test_a_reset_writes_what_was_submitted_then_ends_the_writer_thread_and_closes_the_open_stores(
        tmp_path, monkeypatch, fresh_process_state):
    location = str(tmp_path / "store")
    store = open_store(location)
    closed, close = [], store.close
    monkeypatch.setattr(store, "close", lambda: (closed.append(store), close()))
    meta, blobs, vectors = synthetic_entry("reset", 0, 64)
    meta.prompt = ""  # no text embedding needed
    writer = entry_writer()
    writer.submit(PendingEntry(store=store, meta=meta, blobs=blobs, cond_vector=vectors.cond))
    thread = writer._thread
    fresh_process_state()
    assert not thread.is_alive() and closed == [store]
    assert opened_stores() == {} and entry_writer() is not writer and open_store(location) is not store
    reader = ReuseStore(location)
    try:
        assert reader.get_meta(meta.entry_id) is not None
    finally:
        reader.close()

"""The reuse store: entries of earlier requests, shared by every worker that points at it.

A store lives on a key-value backend (backend.py): a local diskcache directory, the
default, shared by every ComfyUI process on the machine, or a Redis database shared by a
fleet of workers, selected by a `redis://` URL. All entry logic is here, once, for both.

Layout (string keys):

    carnator/schema   JSON   format marker and schema version
    carnator/bytes    int    logical bytes of all live entries (what the size limit bounds)
    (entry log)              the order entries were written in: `carnator/seq` + `seq/<n>` on
                             diskcache, the list `carnator/log` on Redis
    parts/<id>        JSON   names of the entry's blobs, so even a corrupt entry can be deleted whole
    meta/<id>         JSON   `EntryMeta`, the commit record of an entry
    emb/<id>          bytes  the index record: safetensors of the text/conditioning vectors, with the entry's
                             id, hard key, prompt and noise fingerprint as metadata (a worker builds its index
                             from these alone)
    blob/<id>/<name>  bytes  safetensors or PNG: checkpoints, masks, thumbnail
    stats/<id>        record hits, seconds saved, last hit, pinned, and the entry's bytes, sample seconds and
                             creation time (eviction ranks from these alone); JSON on diskcache, a hash on Redis

An entry is written by one atomic backend commit, so concurrent readers and a writer killed
mid-write never expose half an entry. Values are only ever bytes and numbers: never pickle.

A remote store can be down or slow, a local one damaged under the running worker (truncated or
deleted files). Reads then answer "nothing there" at once, writes raise `StoreUnavailable` (the
recorder drops the entry whole), the problem is logged once and shown in `unavailable`, and the
first call after the backend's retry interval (or, locally, once the damaged store was removed)
reconnects by itself. Unreadable values are skipped, logged once per entry; unreadable counters
are rebuilt from the entries.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

import torch

from carnator_core.store.backend import (
    CorruptValueError,
    KeyValueBackend,
    StoreError,
    StoreFull,
    StoreUnavailable,
    Unreadable,
    UnsafeValueError,
    is_store_url,
)
from carnator_core.store.blob_cache import BlobCache
from carnator_core.store.diskcache_backend import DiskcacheBackend
from carnator_core.store.entry import SCHEMA_VERSION, CorruptEntryError, EntryMeta, HardKey
from carnator_core.store.redis_backend import RedisBackend, parse_redis_url
from carnator_core.store.tensor_codec import CorruptBlobError, decode_metadata, decode_tensors, encode_tensors

__all__ = ["EntryStats", "IndexEntry", "IndexVectors", "ReuseStore"]

log = logging.getLogger("carnator.store")

STORE_FORMAT = "carnator-store"
DEFAULT_SIZE_LIMIT = 20 * 2**30
_EVICT_TARGET = 0.9  # evict down to this share of the limit so eviction does not run on every put
_BYTES = "carnator/bytes"
_SCHEMA = "carnator/schema"
_T = TypeVar("_T")


@dataclass
class EntryStats:
    """Mutable usage counters of an entry, kept apart from its immutable metadata."""

    hits: int = 0
    seconds_saved: float = 0.0
    last_hit_at: float = 0.0
    pinned: bool = False

    @classmethod
    def from_record(cls, record: dict[str, float]) -> EntryStats:
        return cls(hits=int(record["hits"]), seconds_saved=float(record["seconds_saved"]),
                   last_hit_at=float(record["last_hit_at"]), pinned=bool(record["pinned"]))


@dataclass
class IndexVectors:
    """What the shortlist needs of an entry: unit-norm text and conditioning embeddings."""

    text: torch.Tensor | None
    cond: torch.Tensor


@dataclass
class IndexEntry:
    """An entry as the shortlist index sees it."""

    entry_id: str
    hard_key: HardKey
    prompt: str
    vectors: IndexVectors
    noise: str = ""  # fingerprint of the initial noise: same-noise donors are ranked without a similarity floor


def _schema_marker() -> bytes:
    return json.dumps({"format": STORE_FORMAT, "schema_version": SCHEMA_VERSION}).encode()


def _backend_for(location: str) -> KeyValueBackend:
    return RedisBackend(parse_redis_url(location)) if is_store_url(location) else DiskcacheBackend(location)


class ReuseStore:
    """Entries of earlier requests, safe to share between processes, machines and restarts.

    `location` is a directory or a `redis://` URL. A remote store keeps blobs it fetched in a
    local read-through cache under `blob_cache_root` (none when not given).
    """

    def __init__(self, location: str, size_limit: int = DEFAULT_SIZE_LIMIT, blob_cache_root: str | None = None) -> None:
        if size_limit <= 0:
            raise StoreError(f"size limit must be positive, got {size_limit}")
        self.size_limit = int(size_limit)
        self.backend = _backend_for(location)
        self.location = self.backend.location  # the directory, or the URL without credentials
        self._blob_cache: BlobCache | None = None
        if isinstance(self.backend, RedisBackend) and blob_cache_root:
            self._blob_cache = BlobCache(BlobCache.directory_for(blob_cache_root, self.location),
                                         int(self.backend.redis_location.cache_gb * 2**30))
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._problem: str | None = None
        self._schema_checked = False
        try:
            self._check_schema()
        except StoreUnavailable as error:
            self._went_down(error)

    # ----------------------------------------------------------------- opening
    def _check_schema(self) -> None:
        try:
            raw = self.backend.get(_SCHEMA)
        except CorruptValueError as error:  # planted or torn: never unpickled, and as clear as any unreadable marker
            raise StoreError(f"{self.location} has an unreadable Carnator schema marker: {error}") from None
        if raw is None:
            if not self.backend.is_empty() and self.backend.get(_SCHEMA) is None:
                raise StoreError(f"{self.location} is not a Carnator store (it holds other data and no Carnator "
                                 "schema marker); choose an empty directory or Redis database")
            self.backend.set_if_absent(_SCHEMA, _schema_marker())
            raw = self.backend.get(_SCHEMA)
        try:
            schema = json.loads(raw)
            store_format, version = schema["format"], int(schema["schema_version"])
        except (TypeError, ValueError, KeyError) as error:
            raise StoreError(f"{self.location} has an unreadable Carnator schema marker: {error}") from error
        if store_format != STORE_FORMAT:
            raise StoreError(f"{self.location} is not a Carnator store (format {store_format!r})")
        if version > SCHEMA_VERSION:
            raise StoreError(f"{self.location} was written by a newer Carnator (store schema {version}); this version "
                             f"reads schema {SCHEMA_VERSION}. Update Carnator or point it at another store.")
        if version < SCHEMA_VERSION:
            raise StoreError(f"{self.location} holds an older Carnator store (schema {version}, current "
                             f"{SCHEMA_VERSION}); clear it or choose another store.")
        self._schema_checked = True

    def close(self) -> None:
        self.backend.close()
        if self._blob_cache is not None:
            self._blob_cache.close()

    # ----------------------------------------------------------------- availability
    @property
    def unavailable(self) -> str | None:
        """Why the store cannot be used right now (server down, slow, refusing us), or None."""
        return self._problem

    def _went_down(self, error: Exception) -> None:
        with self._lock:
            first = self._problem is None
            self._problem = str(error)
        if first:
            log.warning("Carnator store %s unavailable (%s): generating without reuse and not recording until it "
                        "is back; it reconnects by itself", self.location, error)

    def _attempt(self, operation: Callable[..., _T], *args) -> _T:
        """Run a backend call; an outage is remembered (and logged once) and re-raised as `StoreUnavailable`."""
        try:
            if self._problem is not None or not self._schema_checked:
                self._recover()
            return operation(*args)
        except StoreUnavailable as error:
            self._went_down(error)
            raise

    def _recover(self) -> None:
        try:
            self._check_schema()
        except StoreUnavailable:
            raise
        except StoreError as error:  # the server now holds something else: as good as unavailable
            raise StoreUnavailable(str(error)) from None
        if self._problem is not None:
            self._problem = None
            log.warning("Carnator store %s is reachable again: reuse and recording resume", self.location)

    def _quietly(self, default: _T, operation: Callable[..., _T], *args) -> _T:
        """A read that answers `default` while the store is unavailable."""
        try:
            return self._attempt(operation, *args)
        except StoreUnavailable:
            return default

    def budget(self) -> int:
        """Bytes the store may hold: the size limit, or less when the server's own memory limit is lower."""
        capacity = self._quietly(None, self.backend.capacity)
        return min(self.size_limit, capacity) if capacity else self.size_limit

    # ----------------------------------------------------------------- writing
    def put(self, meta: EntryMeta, blobs: dict[str, bytes], vectors: IndexVectors) -> None:
        """Write one entry atomically, then evict by value if the store is over its budget.

        Raises `StoreUnavailable` when the store is down, `StoreFull` when the server has no room even
        after evicting: the entry is then not written at all.
        """
        for name, blob in blobs.items():
            if not isinstance(blob, bytes) or not name.isidentifier():
                raise UnsafeValueError(f"blob {name!r} must be bytes under an identifier name")
        index_tensors = {"cond": vectors.cond.float().half()}
        if vectors.text is not None:
            index_tensors["text"] = vectors.text.float().half()
        key = meta.hard_key  # the index record also names the entry, so an index is built from it alone
        emb_blob = encode_tensors(index_tensors, {"entry_id": meta.entry_id, "model": key.model, "schedule": key.schedule,
                                                  "grid": ",".join(str(v) for v in key.grid),
                                                  "frame_rate": repr(key.frame_rate), "prompt": meta.prompt,
                                                  "noise": meta.noise_fingerprint, "scope": key.scope})
        meta.blob_bytes = {name: len(blob) for name, blob in blobs.items()}
        meta.blob_bytes["_index"] = len(emb_blob)
        entry_id = meta.entry_id
        meta_json = meta.to_json().encode("utf-8")
        values = {f"blob/{entry_id}/{name}": blob for name, blob in blobs.items()}
        values |= {f"emb/{entry_id}": emb_blob, f"parts/{entry_id}": json.dumps(sorted(blobs)).encode(),
                   f"meta/{entry_id}": meta_json}
        stats = {name: float(value) for name, value in asdict(EntryStats()).items()}
        stats |= {"bytes": float(meta.total_bytes + len(meta_json)), "sample_seconds": float(meta.sample_seconds),
                  "created_at": float(meta.created_at)}  # what eviction ranks by, so it need not read metadata
        # the schema marker rides along, so a server that lost all its data is a valid store again at once
        commit = (f"meta/{entry_id}", values, {f"stats/{entry_id}": stats},
                  {_BYTES: meta.total_bytes + len(meta_json)}, entry_id.encode(), {_SCHEMA: _schema_marker()})
        try:
            written = self._attempt(self.backend.commit, *commit)
        except StoreFull:  # the server has less room than the budget assumed (its overhead, other data): make some
            self.evict(int(self.used_bytes() * _EVICT_TARGET) - len(meta_json) - meta.total_bytes)
            written = self._attempt(self.backend.commit, *commit)
        except CorruptValueError as error:  # the bytes counter holds no number (planted, torn): recount, then write
            self._rebuild_bytes(error)
            written = self._attempt(self.backend.commit, *commit)
        if not written:
            raise StoreError(f"entry {entry_id} already exists")
        budget = self.budget()
        if self.used_bytes() > budget:
            self.evict(int(budget * _EVICT_TARGET))

    def _rebuild_bytes(self, error: CorruptValueError) -> None:
        """Recount the live entries' bytes into the counter, which was unreadable, so recording and eviction go on."""
        total = sum(record.get("bytes", 0.0) for record in self._ranking_records(list(self.entry_ids())) if record)
        self._attempt(self.backend.set_counter, _BYTES, int(total))
        log.warning("Carnator store %s: the bytes counter was unreadable (%s); recounted it from the entries: %d bytes",
                    self.location, error, int(total))

    def record_hit(self, entry_id: str, seconds_saved: float) -> None:
        """Count a reuse of `entry_id` with one atomic update, so concurrent hits add up (best effort)."""
        try:
            self._attempt(self.backend.update_record, f"stats/{entry_id}",
                          {"hits": 1.0, "seconds_saved": max(0.0, float(seconds_saved))}, {"last_hit_at": time.time()})
        except StoreUnavailable:
            pass  # the outage is logged once; a lost hit only makes eviction slightly less informed
        except CorruptValueError as error:
            self._warn_once(entry_id, f"stats: {error}")

    def set_pinned(self, entry_id: str, pinned: bool) -> bool:
        """Pin (never evicted) or unpin an entry; False when the entry does not exist."""
        try:
            return self._attempt(self.backend.update_record, f"stats/{entry_id}", {}, {"pinned": float(bool(pinned))})
        except CorruptValueError as error:
            self._warn_once(entry_id, f"stats: {error}")
            return False

    def delete(self, entry_id: str) -> bool:
        """Remove an entry and all its blobs atomically; False when it did not exist."""
        raw_meta = self._value(f"meta/{entry_id}", entry_id)
        meta = self._parse_meta(entry_id, raw_meta)
        freed = meta.total_bytes + len(raw_meta) if meta is not None else 0
        try:
            names = json.loads(self._value(f"parts/{entry_id}", entry_id) or b"[]")
        except (TypeError, ValueError):
            names = []
        names = [name for name in names if isinstance(name, str) and name.isidentifier()] if isinstance(names, list) else []
        blob_keys = [f"blob/{entry_id}/{name}" for name in names]
        existed = self._attempt(self.backend.delete, [*blob_keys, f"emb/{entry_id}", f"stats/{entry_id}",
                                                      f"parts/{entry_id}"], f"meta/{entry_id}", _BYTES, freed)
        if self._blob_cache is not None:
            for key in blob_keys:
                self._blob_cache.discard(key)
        return existed

    def clear(self) -> None:
        """Delete every entry but keep the store a valid (empty) Carnator store."""
        for entry_id in list(self.entry_ids()):
            self.delete(entry_id)

    # ----------------------------------------------------------------- documents
    def get_document(self, name: str) -> bytes | None:
        """A small document kept beside the entries (the calibration profiles), or None when absent, unreadable
        (logged once) or the store is unavailable. Clearing the entries keeps it."""
        return self._value(f"doc/{name}", f"doc/{name}")

    def set_document(self, name: str, value: bytes) -> None:
        """Write a document whole; raises `StoreUnavailable` when the store is down."""
        self._attempt(self.backend.set, f"doc/{name}", value)

    # ----------------------------------------------------------------- reading
    def _warn_once(self, entry_id: str, problem: str) -> None:
        with self._lock:
            if entry_id in self._warned:
                return
            self._warned.add(entry_id)
        log.warning("Carnator store %s: skipping entry %s: %s", self.location, entry_id, problem)

    def _checked(self, entry_id: str, key: str, value: _T | Unreadable | None) -> _T | None:
        """A value from a batched read; one the backend could not read is skipped, logged once."""
        if isinstance(value, Unreadable):
            self._warn_once(entry_id, f"{key}: {value}")
            return None
        return value

    def _value(self, key: str, entry_id: str) -> bytes | None:
        try:
            return self._quietly(None, self.backend.get, key)
        except CorruptValueError as error:
            self._warn_once(entry_id, f"{key}: {error}")
            return None

    def _parse_meta(self, entry_id: str, raw: bytes | None) -> EntryMeta | None:
        if raw is None:
            return None
        try:
            meta = EntryMeta.from_json(raw.decode("utf-8"))
        except (CorruptEntryError, UnicodeDecodeError) as error:
            self._warn_once(entry_id, str(error))
            return None
        if meta.entry_id != entry_id:
            self._warn_once(entry_id, "metadata names another entry")
            return None
        return meta

    def get_meta(self, entry_id: str) -> EntryMeta | None:
        """The entry's metadata, or None when absent, corrupt (logged once) or the store is unavailable."""
        return self._parse_meta(entry_id, self._value(f"meta/{entry_id}", entry_id))

    def get_metas(self, entry_ids: Sequence[str]) -> list[EntryMeta | None]:
        """Metadata of several entries in one round trip (None where absent, corrupt or unavailable)."""
        raws = self._quietly([None] * len(entry_ids), self.backend.get_many, [f"meta/{e}" for e in entry_ids])
        return [self._parse_meta(entry_id, self._checked(entry_id, f"meta/{entry_id}", raw))
                for entry_id, raw in zip(entry_ids, raws, strict=True)]

    def get_blob(self, entry_id: str, name: str) -> bytes | None:
        """Raw bytes of one blob, or None when missing, unreadable (logged once) or unavailable.

        A remote store serves a local copy when the upstream blob still has its length.
        """
        key = f"blob/{entry_id}/{name}"
        try:
            if self._blob_cache is not None:
                size = self._attempt(self.backend.size, key)
                if size == 0:  # evicted upstream: the local copy goes too
                    self._blob_cache.discard(key)
                    return None
                local = self._blob_cache.get(key, size)
                if local is not None:
                    return local
            raw = self._attempt(self.backend.get, key)
        except StoreUnavailable:
            return None
        except CorruptValueError as error:
            self._warn_once(entry_id, f"{key}: {error}")
            return None
        if raw is not None and self._blob_cache is not None:
            self._blob_cache.put(key, raw)
        return raw

    def get_tensors(self, entry_id: str, name: str) -> dict[str, torch.Tensor] | None:
        """A safetensors blob decoded, or None when missing or corrupt (logged once)."""
        blob = self.get_blob(entry_id, name)
        if blob is None:
            return None
        try:
            return decode_tensors(blob)
        except CorruptBlobError as error:
            self._warn_once(entry_id, f"blob {name}: {error}")
            return None

    def _parse_vectors(self, entry_id: str, blob: bytes | None) -> IndexVectors | None:
        if blob is None:
            return None
        try:
            tensors = decode_tensors(blob)
            cond = tensors["cond"].float()
        except (CorruptBlobError, KeyError) as error:
            self._warn_once(entry_id, f"index vectors: {error}")
            return None
        text = tensors.get("text")
        return IndexVectors(text=text.float() if text is not None else None, cond=cond)

    def get_vectors(self, entry_id: str) -> IndexVectors | None:
        """The entry's index vectors, or None when missing, corrupt (logged once) or unavailable."""
        return self._parse_vectors(entry_id, self._value(f"emb/{entry_id}", entry_id))

    def index_entries(self, entry_ids: Sequence[str]) -> list[IndexEntry]:
        """What the shortlist needs of several entries, in batched round trips; unreadable ones left out.

        Read from the compact index records alone (vectors plus key and prompt); lookup re-checks the
        metadata of the few candidates it returns.
        """
        raws = self._quietly([None] * len(entry_ids), self.backend.get_many, [f"emb/{e}" for e in entry_ids])
        found: list[IndexEntry] = []
        for entry_id, raw in zip(entry_ids, raws, strict=True):
            raw = self._checked(entry_id, f"emb/{entry_id}", raw)
            vectors = self._parse_vectors(entry_id, raw)
            if vectors is None:
                continue
            try:
                record = decode_metadata(raw)
                hard_key = HardKey(model=record["model"], grid=tuple(int(v) for v in record["grid"].split(",")),
                                   schedule=record["schedule"], frame_rate=float(record.get("frame_rate", 0.0)),
                                   scope=str(record.get("scope", "")))
                if record["entry_id"] != entry_id:
                    raise ValueError("index record names another entry")
            except (CorruptBlobError, KeyError, ValueError) as error:
                self._warn_once(entry_id, f"index record: {error}")
                continue
            found.append(IndexEntry(entry_id, hard_key, record.get("prompt", ""), vectors, str(record.get("noise", ""))))
        return found

    def stats(self, entry_id: str) -> EntryStats | None:
        """Usage counters; None when the entry is absent, defaults when they are unreadable (logged once)."""
        try:
            record = self._quietly(None, self.backend.get_record, f"stats/{entry_id}")
            return EntryStats.from_record(record) if record is not None else None
        except (CorruptValueError, KeyError) as error:
            self._warn_once(entry_id, f"stats: {error}")
            return EntryStats()

    def stats_many(self, entry_ids: Sequence[str]) -> list[EntryStats | None]:
        """Usage counters of several entries in batched round trips (None where absent or unreadable)."""
        records = self._quietly([None] * len(entry_ids), self.backend.get_records, [f"stats/{e}" for e in entry_ids])
        found: list[EntryStats | None] = []
        for entry_id, record in zip(entry_ids, records, strict=True):
            record = self._checked(entry_id, f"stats/{entry_id}", record)
            try:
                found.append(EntryStats.from_record(record) if record is not None else None)
            except KeyError:
                found.append(None)
        return found

    # ----------------------------------------------------------------- listing
    def sequence(self) -> int:
        """Number of entries ever written; changes whenever a new entry lands."""
        return self._quietly(0, self.backend.log_length)

    def entries_since(self, seq: int) -> tuple[list[str], int]:
        """Ids of entries written after sequence number `seq`, and the sequence number they reach.

        Lets an in-memory index refresh incrementally instead of rescanning the store. A result
        below `seq` means the log started over (the server lost its data): rebuild from 0.
        While the store is unavailable: nothing new, `seq` unchanged.
        """
        try:
            length = self._attempt(self.backend.log_length)
            if length < seq:
                return [], length
            values = self._attempt(self.backend.read_log, seq)
        except StoreUnavailable:
            return [], seq
        ids = []
        for position, value in enumerate(values, seq + 1):
            value = self._checked(f"at log position {position}", "entry log", value)
            try:
                entry_id = value.decode("ascii") if value is not None else ""
            except UnicodeDecodeError:
                entry_id = ""
            if entry_id.isalnum():
                ids.append(entry_id)
        return ids, seq + len(values)

    def entry_ids(self) -> Iterator[str]:
        """Ids of every live entry, oldest first."""
        ids, _ = self.entries_since(0)
        live = self._quietly([False] * len(ids), self.backend.exists_many, [f"meta/{e}" for e in ids])
        yield from (entry_id for entry_id, exists in zip(ids, live, strict=True) if exists)

    def volume(self) -> int:
        """Bytes the store occupies: on disk (SQLite plus blob files), or the Redis server's memory."""
        return self._quietly(0, self.backend.volume)

    def used_bytes(self) -> int:
        """Logical bytes of live entries: what `size_limit` bounds (storage adds its own overhead)."""
        return self._quietly(0, self.backend.counter, _BYTES)

    def totals(self) -> dict[str, float]:
        """Entry count, bytes, hits and seconds saved over the whole store."""
        ids = list(self.entry_ids())
        stats = [s or EntryStats() for s in self.stats_many(ids)]
        return {"entries": len(ids), "bytes": self.used_bytes(), "disk_bytes": self.volume(),
                "hits": sum(s.hits for s in stats), "seconds_saved": sum(s.seconds_saved for s in stats),
                "size_limit": self.size_limit}

    # ----------------------------------------------------------------- eviction
    def evict(self, target_bytes: int) -> list[str]:
        """Delete lowest-value entries until the store is at most `target_bytes`.

        Value = hits x seconds of work saved per hit / bytes, ties broken by age (oldest
        first). Pinned entries are never evicted; corrupt entries go first.
        """
        ids = list(self.entry_ids())
        ranked: list[tuple[float, float, str]] = []
        for entry_id, record in zip(ids, self._ranking_records(ids), strict=True):
            try:
                stats = EntryStats.from_record(record)
                size, seconds, created = (record[name] for name in ("bytes", "sample_seconds", "created_at"))
            except (KeyError, TypeError):  # gone meanwhile, or its record unreadable
                ranked.append((-1.0, 0.0, entry_id))
                continue
            if stats.pinned:
                continue
            ranked.append((stats.hits * max(seconds, 1e-3) / max(size, 1), created, entry_id))
        ranked.sort()
        evicted = []
        for _, _, entry_id in ranked:
            if self.used_bytes() <= target_bytes:
                break
            self.delete(entry_id)
            evicted.append(entry_id)
        if evicted:
            log.info("Carnator store %s: evicted %d entries to stay under %d bytes",
                     self.location, len(evicted), self.budget())
        self._quietly(None, self.backend.sweep)  # and what interrupted writes left, which no entry accounts for
        return evicted

    def _ranking_records(self, entry_ids: Sequence[str]) -> list[dict[str, float] | None]:
        """Stats records, which hold each entry's bytes, sample seconds and creation time; None where unreadable."""
        records = self._quietly([None] * len(entry_ids), self.backend.get_records, [f"stats/{e}" for e in entry_ids])
        return [self._checked(e, f"stats/{e}", record) for e, record in zip(entry_ids, records, strict=True)]

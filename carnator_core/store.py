"""The reuse store: a diskcache directory shared by every ComfyUI process on the machine.

Layout (one SQLite-backed cache, string keys only):

    carnator/schema   JSON   format marker and schema version
    carnator/seq      int    append counter; `seq/<n>` names the n-th entry ever written
    carnator/bytes    int    logical bytes of all live entries (what the size limit bounds)
    parts/<id>        JSON   names of the entry's blobs, so even a corrupt entry can be deleted whole
    meta/<id>         JSON   `EntryMeta`, the commit record of an entry
    emb/<id>          bytes  safetensors: the entry's text/conditioning index vectors
    blob/<id>/<name>  bytes  safetensors or PNG: checkpoints, masks, thumbnail
    stats/<id>        JSON   hits, seconds saved, last hit, pinned

An entry is written in one SQLite transaction, so concurrent readers and a writer killed
mid-write never expose half an entry. Values are only ever bytes, str or numbers: the
`SafeDisk` below refuses to pickle on write and refuses to unpickle on read, so a planted
pickle payload is reported as corruption and never executed.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import diskcache
import torch
from diskcache.core import MODE_PICKLE

from carnator_core.entry import SCHEMA_VERSION, CorruptEntryError, EntryMeta
from carnator_core.tensor_codec import CorruptBlobError, decode_tensors, encode_tensors

log = logging.getLogger("carnator.store")

STORE_FORMAT = "carnator-store"
DEFAULT_SIZE_LIMIT = 20 * 2**30
_EVICT_TARGET = 0.9  # evict down to this share of the limit so eviction does not run on every put


class StoreError(RuntimeError):
    """The store cannot be opened or used as asked; the message says what to do."""


class UnsafeValueError(TypeError):
    """A value that would need pickle was offered to, or found in, the store."""


class SafeDisk(diskcache.Disk):
    """diskcache serialisation restricted to bytes, str and numbers: never pickle."""

    def put(self, key):
        if type(key) not in (str, bytes, int, float):
            raise UnsafeValueError(f"store keys must be str/bytes/numbers, not {type(key).__name__}")
        return super().put(key)

    def get(self, key, raw):
        if not raw:
            raise UnsafeValueError("refusing to unpickle a store key")
        return super().get(key, raw)

    def store(self, value, read, key=diskcache.core.UNKNOWN):
        if read or type(value) not in (str, bytes, int, float):
            raise UnsafeValueError(f"store values must be bytes/str/numbers, not {type(value).__name__}")
        return super().store(value, read, key)

    def fetch(self, mode, filename, value, read):
        if mode == MODE_PICKLE:
            raise UnsafeValueError("refusing to unpickle a store value")
        if filename is not None and (os.path.isabs(filename) or ".." in filename.replace("\\", "/").split("/")):
            raise UnsafeValueError(f"store value points outside the store: {filename!r}")
        return super().fetch(mode, filename, value, read)


@dataclass
class EntryStats:
    """Mutable usage counters of an entry, kept apart from its immutable metadata."""

    hits: int = 0
    seconds_saved: float = 0.0
    last_hit_at: float = 0.0
    pinned: bool = False


@dataclass
class IndexVectors:
    """What the shortlist needs of an entry: unit-norm text and conditioning embeddings."""

    text: torch.Tensor | None
    cond: torch.Tensor


class ReuseStore:
    """Entries of earlier requests, safe to share between processes and across restarts."""

    def __init__(self, directory: str, size_limit: int = DEFAULT_SIZE_LIMIT) -> None:
        if size_limit <= 0:
            raise StoreError(f"size limit must be positive, got {size_limit}")
        self.directory = os.path.abspath(directory)
        self.size_limit = int(size_limit)
        self._check_directory()
        try:
            self._cache = diskcache.Cache(self.directory, disk=SafeDisk, eviction_policy="none",
                                          size_limit=2**62, timeout=60)
        except (sqlite3.DatabaseError, OSError) as error:
            raise StoreError(f"{self.directory} is not a usable Carnator store: {error}") from error
        self._check_schema()
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- opening
    def _check_directory(self) -> None:
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise StoreError(f"store path {self.directory} is a file, not a directory")
        if os.path.isdir(self.directory):
            contents = set(os.listdir(self.directory))
            if contents and "cache.db" not in contents:
                raise StoreError(f"{self.directory} is not a Carnator store (it holds other files and no cache.db); "
                                 "choose an empty or new directory")

    def _check_schema(self) -> None:
        try:
            raw = self._cache.get("carnator/schema")
        except (UnsafeValueError, OSError) as error:
            raise StoreError(f"{self.directory} is not a Carnator store: {error}") from error
        if raw is None:
            with self._cache.transact():
                if self._cache.get("carnator/schema") is None:
                    if len(self._cache) > 0:
                        raise StoreError(f"{self.directory} is a diskcache directory but not a Carnator store")
                    self._cache.set("carnator/schema", json.dumps(
                        {"format": STORE_FORMAT, "schema_version": SCHEMA_VERSION}))
            return
        try:
            schema = json.loads(raw)
            store_format, version = schema["format"], int(schema["schema_version"])
        except (TypeError, ValueError, KeyError) as error:
            raise StoreError(f"{self.directory} has an unreadable Carnator schema marker: {error}") from error
        if store_format != STORE_FORMAT:
            raise StoreError(f"{self.directory} is not a Carnator store (format {store_format!r})")
        if version > SCHEMA_VERSION:
            raise StoreError(f"{self.directory} was written by a newer Carnator (store schema {version}); this version "
                             f"reads schema {SCHEMA_VERSION}. Update Carnator or point it at another store directory.")
        if version < SCHEMA_VERSION:
            raise StoreError(f"{self.directory} holds an older Carnator store (schema {version}, current "
                             f"{SCHEMA_VERSION}); clear it or choose another directory.")

    def close(self) -> None:
        self._cache.close()

    # ----------------------------------------------------------------- writing
    def put(self, meta: EntryMeta, blobs: dict[str, bytes], vectors: IndexVectors) -> None:
        """Write one entry atomically, then evict by value if the store is over its limit."""
        for name, blob in blobs.items():
            if not isinstance(blob, bytes) or not name.isidentifier():
                raise UnsafeValueError(f"blob {name!r} must be bytes under an identifier name")
        index_tensors = {"cond": vectors.cond.float().half()}
        if vectors.text is not None:
            index_tensors["text"] = vectors.text.float().half()
        emb_blob = encode_tensors(index_tensors)
        meta.blob_bytes = {name: len(blob) for name, blob in blobs.items()}
        meta.blob_bytes["_index"] = len(emb_blob)
        entry_id = meta.entry_id
        meta_json = meta.to_json()
        with self._cache.transact():
            if f"meta/{entry_id}" in self._cache:
                raise StoreError(f"entry {entry_id} already exists")
            for name, blob in blobs.items():
                self._cache.set(f"blob/{entry_id}/{name}", blob)
            self._cache.set(f"emb/{entry_id}", emb_blob)
            self._cache.set(f"parts/{entry_id}", json.dumps(sorted(blobs)))
            self._cache.set(f"stats/{entry_id}", json.dumps(asdict(EntryStats())))
            self._cache.set(f"meta/{entry_id}", meta_json)
            self._cache.incr("carnator/bytes", meta.total_bytes + len(meta_json))
            seq = self._cache.incr("carnator/seq")
            self._cache.set(f"seq/{seq:012d}", entry_id)
        if self.used_bytes() > self.size_limit:
            self.evict(int(self.size_limit * _EVICT_TARGET))

    def record_hit(self, entry_id: str, seconds_saved: float) -> None:
        """Count a reuse of `entry_id`; read-modify-write inside one transaction, so concurrent hits add up."""
        with self._cache.transact():
            stats = self.stats(entry_id)
            if stats is None:
                return
            stats.hits += 1
            stats.seconds_saved += max(0.0, float(seconds_saved))
            stats.last_hit_at = time.time()
            self._cache.set(f"stats/{entry_id}", json.dumps(asdict(stats)))

    def set_pinned(self, entry_id: str, pinned: bool) -> bool:
        """Pin (never evicted) or unpin an entry; False when the entry does not exist."""
        with self._cache.transact():
            stats = self.stats(entry_id)
            if stats is None:
                return False
            stats.pinned = bool(pinned)
            self._cache.set(f"stats/{entry_id}", json.dumps(asdict(stats)))
        return True

    def delete(self, entry_id: str) -> bool:
        """Remove an entry and all its blobs in one transaction; False when it did not exist."""
        with self._cache.transact():
            raw_meta = self._read(f"meta/{entry_id}", entry_id)
            if raw_meta is None and f"meta/{entry_id}" not in self._cache:
                return False
            meta = self.get_meta(entry_id)
            freed = meta.total_bytes + len(raw_meta) if meta is not None and isinstance(raw_meta, str) else 0
            try:
                names = json.loads(self._read(f"parts/{entry_id}", entry_id) or "[]")
            except (TypeError, ValueError):
                names = []
            for name in names if isinstance(names, list) else []:
                if isinstance(name, str) and name.isidentifier():
                    self._cache.delete(f"blob/{entry_id}/{name}")
            for key in (f"meta/{entry_id}", f"emb/{entry_id}", f"stats/{entry_id}", f"parts/{entry_id}"):
                self._cache.delete(key)
            if freed:
                self._cache.incr("carnator/bytes", -freed)
        return True

    def clear(self) -> None:
        """Delete every entry but keep the directory a valid (empty) Carnator store."""
        for entry_id in list(self.entry_ids()):
            self.delete(entry_id)

    # ----------------------------------------------------------------- reading
    def _warn_once(self, entry_id: str, problem: str) -> None:
        with self._lock:
            if entry_id in self._warned:
                return
            self._warned.add(entry_id)
        log.warning("Carnator store %s: skipping entry %s: %s", self.directory, entry_id, problem)

    def _read(self, key: str, entry_id: str) -> bytes | str | None:
        try:
            return self._cache.get(key)
        except (UnsafeValueError, OSError, sqlite3.DatabaseError) as error:
            self._warn_once(entry_id, f"{key}: {error}")
            return None

    def get_meta(self, entry_id: str) -> EntryMeta | None:
        """The entry's metadata, or None when absent or corrupt (logged once)."""
        raw = self._read(f"meta/{entry_id}", entry_id)
        if raw is None:
            return None
        try:
            meta = EntryMeta.from_json(raw if isinstance(raw, str) else raw.decode("utf-8"))
        except (CorruptEntryError, UnicodeDecodeError) as error:
            self._warn_once(entry_id, str(error))
            return None
        if meta.entry_id != entry_id:
            self._warn_once(entry_id, "metadata names another entry")
            return None
        return meta

    def get_blob(self, entry_id: str, name: str) -> bytes | None:
        """Raw bytes of one blob, or None when missing or unreadable (logged once)."""
        raw = self._read(f"blob/{entry_id}/{name}", entry_id)
        if raw is not None and not isinstance(raw, bytes):
            self._warn_once(entry_id, f"blob {name} is not bytes")
            return None
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

    def get_vectors(self, entry_id: str) -> IndexVectors | None:
        """The entry's index vectors, or None when missing or corrupt (logged once)."""
        blob = self._read(f"emb/{entry_id}", entry_id)
        if not isinstance(blob, bytes):
            return None
        try:
            tensors = decode_tensors(blob)
            cond = tensors["cond"].float()
        except (CorruptBlobError, KeyError) as error:
            self._warn_once(entry_id, f"index vectors: {error}")
            return None
        text = tensors.get("text")
        return IndexVectors(text=text.float() if text is not None else None, cond=cond)

    def stats(self, entry_id: str) -> EntryStats | None:
        raw = self._read(f"stats/{entry_id}", entry_id)
        if raw is None:
            return None
        try:
            record = json.loads(raw)
            return EntryStats(hits=int(record["hits"]), seconds_saved=float(record["seconds_saved"]),
                              last_hit_at=float(record["last_hit_at"]), pinned=bool(record["pinned"]))
        except (TypeError, ValueError, KeyError) as error:
            self._warn_once(entry_id, f"stats: {error}")
            return EntryStats()

    # ----------------------------------------------------------------- listing
    def sequence(self) -> int:
        """Number of entries ever written; changes whenever a new entry lands."""
        value = self._cache.get("carnator/seq", 0)
        return value if isinstance(value, int) else 0

    def entries_since(self, seq: int) -> tuple[list[str], int]:
        """Ids of entries written after sequence number `seq`, and the current sequence number.

        Lets an in-memory index refresh incrementally instead of rescanning the store.
        """
        current = self.sequence()
        ids = []
        for n in range(seq + 1, current + 1):
            entry_id = self._read(f"seq/{n:012d}", f"seq/{n}")
            if isinstance(entry_id, str):
                ids.append(entry_id)
        return ids, current

    def entry_ids(self) -> Iterator[str]:
        """Ids of every live entry, oldest first."""
        ids, _ = self.entries_since(0)
        for entry_id in ids:
            if f"meta/{entry_id}" in self._cache:
                yield entry_id

    def volume(self) -> int:
        """Bytes the store occupies on disk (SQLite file plus blob files)."""
        return self._cache.volume()

    def used_bytes(self) -> int:
        """Logical bytes of live entries: what `size_limit` bounds (disk use adds SQLite overhead)."""
        value = self._cache.get("carnator/bytes", 0)
        return value if isinstance(value, int) else 0

    def totals(self) -> dict[str, float]:
        """Entry count, bytes, hits and seconds saved over the whole store."""
        entries = hits = 0
        saved = 0.0
        for entry_id in self.entry_ids():
            stats = self.stats(entry_id) or EntryStats()
            entries += 1
            hits += stats.hits
            saved += stats.seconds_saved
        return {"entries": entries, "bytes": self.used_bytes(), "disk_bytes": self.volume(), "hits": hits,
                "seconds_saved": saved, "size_limit": self.size_limit}

    # ----------------------------------------------------------------- eviction
    def evict(self, target_bytes: int) -> list[str]:
        """Delete lowest-value entries until the store is at most `target_bytes`.

        Value = hits x seconds of work saved per hit / bytes, ties broken by age (oldest
        first). Pinned entries are never evicted; corrupt entries go first.
        """
        ranked: list[tuple[float, float, str]] = []
        for entry_id in self.entry_ids():
            meta = self.get_meta(entry_id)
            stats = self.stats(entry_id)
            if meta is None or stats is None:
                ranked.append((-1.0, 0.0, entry_id))
                continue
            if stats.pinned:
                continue
            value = stats.hits * max(meta.sample_seconds, 1e-3) / max(meta.total_bytes, 1)
            ranked.append((value, meta.created_at, entry_id))
        ranked.sort()
        evicted = []
        for _, _, entry_id in ranked:
            if self.used_bytes() <= target_bytes:
                break
            self.delete(entry_id)
            evicted.append(entry_id)
        if evicted:
            log.info("Carnator store %s: evicted %d entries to stay under %d bytes",
                     self.directory, len(evicted), self.size_limit)
        return evicted


ALLOW_OUTSIDE_ENV = "CARNATOR_ALLOW_STORE_OUTSIDE_BASE"
_open_stores: dict[str, ReuseStore] = {}
_open_stores_lock = threading.Lock()


def resolve_store_directory(user_path: str, base_directory: str, default_directory: str,
                            allow_outside: bool | None = None) -> str:
    """Absolute store directory for a user-given path.

    Empty means the default (ComfyUI's user directory). Relative paths are taken from the
    ComfyUI base directory, and the result must stay inside it — workflows are shared files,
    and one must not be able to point a server's store at an arbitrary directory — unless the
    operator sets `CARNATOR_ALLOW_STORE_OUTSIDE_BASE=1`.
    """
    if allow_outside is None:
        allow_outside = os.environ.get(ALLOW_OUTSIDE_ENV, "").strip().lower() in ("1", "true", "yes")
    if not user_path.strip():
        return os.path.realpath(default_directory)
    base = os.path.realpath(base_directory)
    candidate = os.path.realpath(os.path.join(base, os.path.expanduser(user_path.strip())))
    if not allow_outside and os.path.commonpath([base, candidate]) != base:
        raise StoreError(f"store path {user_path!r} resolves to {candidate}, outside the ComfyUI base directory "
                         f"{base}; use a path inside it or set {ALLOW_OUTSIDE_ENV}=1 on the server")
    return candidate


def open_store(directory: str, size_limit: int | None = None) -> ReuseStore:
    """The process-wide store object of a directory (one SQLite connection set per process).

    `size_limit=None` keeps the limit the store was opened with (default for a new one).
    """
    directory = os.path.abspath(directory)
    with _open_stores_lock:
        store = _open_stores.get(directory)
        if store is None:
            store = _open_stores[directory] = ReuseStore(directory, size_limit or DEFAULT_SIZE_LIMIT)
        elif size_limit is not None:
            store.size_limit = int(size_limit)
        return store

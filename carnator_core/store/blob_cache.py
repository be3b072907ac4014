"""A worker's local copies of blobs it fetched from a remote store.

A hit reads a donor's checkpoints (megabytes to tens of megabytes); iterating users hit the
same donors again and again, so each worker keeps what it fetched in a bounded local
diskcache (least recently used goes first) and never pulls the same blob over the network
twice. Entries are immutable under their id, so a copy can only be wrong when the entry
was evicted upstream (or, by hand, rewritten): the store checks the upstream length, one
tiny round trip, before serving a copy, and drops copies of entries it deletes itself.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3

import diskcache

from carnator_core.store.backend import CorruptValueError, UnsafeValueError
from carnator_core.store.diskcache_backend import SafeDisk

DEFAULT_SIZE = 8 * 2**30


class BlobCache:
    """Bounded local diskcache of raw blob bytes, keyed like the store (`blob/<id>/<name>`)."""

    def __init__(self, directory: str, size_limit: int = DEFAULT_SIZE) -> None:
        self.directory = directory
        self._cache = diskcache.Cache(directory, disk=SafeDisk, eviction_policy="least-recently-used",
                                      size_limit=max(1, int(size_limit)), timeout=5,
                                      sqlite_mmap_size=0)  # a truncated file must fail reads, not kill the worker

    @staticmethod
    def directory_for(root: str, location: str) -> str:
        """One cache directory per store location under `root`, so two stores never share copies."""
        return os.path.join(root, hashlib.sha256(location.encode()).hexdigest()[:16])

    def get(self, key: str, size: int) -> bytes | None:
        """The local copy if it has the upstream length `size`; a stale copy is dropped."""
        try:
            value = self._cache.get(key)
        except (UnsafeValueError, CorruptValueError, OSError, sqlite3.DatabaseError):
            value = None
        if isinstance(value, bytes) and len(value) == size:
            return value
        if value is not None:
            self.discard(key)
        return None

    def put(self, key: str, value: bytes) -> None:
        try:
            self._cache.set(key, value)
        except (OSError, sqlite3.DatabaseError):
            pass  # a full or broken local disk only costs the network fetch next time

    def discard(self, key: str) -> None:
        try:
            self._cache.delete(key)
        except (OSError, sqlite3.DatabaseError):
            pass

    def close(self) -> None:
        self._cache.close()

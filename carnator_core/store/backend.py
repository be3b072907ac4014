"""The key-value layer under the reuse store, and the errors every backend reports in.

`ReuseStore` (reuse_store.py) holds all entry logic: layout, validation, eviction, schema. It only
needs a handful of operations from the storage it sits on, and this interface names them. A
backend stores bytes under string keys, small records of numbers that can be updated in
place atomically (hit counters), one append-only log (the order entries were written in),
and offers two compound atomic operations, `commit` and `delete`, so that a reader never
sees half an entry. Two implementations: a local diskcache directory (diskcache_backend.py)
and a Redis server shared by a fleet of workers (redis_backend.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

Record = dict[str, float]


def is_store_url(location: str) -> bool:
    """Whether a store location is a URL rather than a directory: anything with `://` in it. The one such test of
    the pack; a URL that is not `redis://` or `rediss://` is then refused by `parse_redis_url`, never taken for a
    directory."""
    return "://" in location


class StoreError(RuntimeError):
    """The store cannot be opened or used as asked; the message says what to do."""


class StoreUnavailable(StoreError):
    """The store's server is down, slow or refuses us for now; callers go on without reuse."""


class StoreFull(StoreError):
    """The server refused a write for lack of memory (Redis maxmemory); nothing was written."""


class UnsafeValueError(TypeError):
    """A value that would need pickle was offered to, or found in, the store."""


class CorruptValueError(ValueError):
    """A stored value cannot be read as what its key promises (wrong type, planted pickle, torn)."""


Unreadable = CorruptValueError  # what a batched read returns in place of a value it could not read


class KeyValueBackend(ABC):
    """Bytes under string keys plus the few atomic compound operations the entry logic needs.

    Reads of a single value raise `CorruptValueError` when the stored value is unreadable;
    batched reads put that error in its place (`Unreadable`), so the store can say which entry it
    skips. Every operation may raise `StoreUnavailable`, never the storage's own exceptions.
    """

    location: str  # where the data lives, fit for messages: a directory, or a URL without credentials

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value under `key`, or None when absent."""

    @abstractmethod
    def get_many(self, keys: Sequence[str]) -> list[bytes | Unreadable | None]:
        """Values of several keys in one round trip; absent ones are None, unreadable ones the error saying why."""

    @abstractmethod
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Which of `keys` hold a value."""

    @abstractmethod
    def size(self, key: str) -> int:
        """Byte length of the value under `key`; 0 when absent (lets a local copy be validated cheaply)."""

    @abstractmethod
    def counter(self, key: str) -> int:
        """An integer counter; 0 when absent or unreadable."""

    @abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Store raw bytes (tools and tests; entries are written with `commit`)."""

    @abstractmethod
    def set_counter(self, key: str, value: int) -> None:
        """Overwrite an integer counter (to rebuild one found unreadable)."""

    @abstractmethod
    def set_if_absent(self, key: str, value: bytes) -> bool:
        """Store `value` unless `key` exists; True when this call stored it."""

    @abstractmethod
    def is_empty(self) -> bool:
        """Whether the backend holds no key at all (a new store, or someone else's data)."""

    @abstractmethod
    def get_record(self, key: str) -> Record | None:
        """A record of numbers, or None when absent."""

    @abstractmethod
    def get_records(self, keys: Sequence[str]) -> list[Record | Unreadable | None]:
        """Several records in one round trip; absent ones are None, unreadable ones the error saying why."""

    @abstractmethod
    def update_record(self, key: str, add: Mapping[str, float], assign: Mapping[str, float]) -> bool:
        """Atomically add to and assign fields of an existing record; False when it does not exist."""

    @abstractmethod
    def log_length(self) -> int:
        """How many values were ever appended to the log."""

    @abstractmethod
    def read_log(self, start: int) -> list[bytes | Unreadable | None]:
        """Log values from position `start` (0-based) to the end; unreadable ones the error saying why."""

    @abstractmethod
    def commit(self, guard: str, values: Mapping[str, bytes], records: Mapping[str, Record],
               counters: Mapping[str, int], log_value: bytes, ensure: Mapping[str, bytes]) -> bool:
        """All or nothing: unless `guard` exists, write values and records, add to counters, append to the log,
        and write each of `ensure` where its key is absent.

        False (and nothing written) when `guard` already exists.
        """

    @abstractmethod
    def delete(self, keys: Sequence[str], guard: str, counter: str, amount: int) -> bool:
        """All or nothing: remove `keys` and `guard`; subtract `amount` from `counter` only if `guard` existed.

        Returns whether `guard` existed, so two concurrent deletes of one entry count its bytes once.
        """

    @abstractmethod
    def sweep(self) -> None:
        """Remove storage no entry references: what a commit killed or failed midway left behind."""

    @abstractmethod
    def volume(self) -> int:
        """Bytes the backend occupies (disk for diskcache, server memory for Redis)."""

    @abstractmethod
    def capacity(self) -> int | None:
        """The most logical bytes the store should hold, as the server sees it; None when unbounded."""

    @abstractmethod
    def close(self) -> None:
        """Release files or connections."""

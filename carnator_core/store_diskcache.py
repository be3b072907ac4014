"""The local backend: one diskcache directory shared by every ComfyUI process on the machine.

diskcache keeps small values in SQLite and large ones in files beside it, and its
transactions are SQLite transactions: a writer killed mid-entry leaves nothing behind. Values
are only ever bytes, str or numbers: `SafeDisk` refuses to pickle on write and to unpickle
on read, so a planted pickle payload is reported as corruption and never executed.

The append log is a counter (`carnator/seq`) plus one key per position (`seq/<n>`, 1-based,
zero-padded); records are JSON objects stored as text.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Mapping, Sequence

import diskcache
from diskcache.core import MODE_PICKLE

from carnator_core.store_backend import (
    CorruptValueError,
    KeyValueBackend,
    Record,
    StoreError,
    UnsafeValueError,
)

_SEQ = "carnator/seq"
_READ_ERRORS = (UnsafeValueError, OSError, sqlite3.DatabaseError)


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


def _as_bytes(value: bytes | str | int | float | None) -> bytes | None:
    """Stored value as bytes: text (how earlier versions kept JSON) is encoded; numbers are not values."""
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    raise CorruptValueError(f"expected bytes, found {type(value).__name__}")


def _as_record(value: bytes | None) -> Record | None:
    if value is None:
        return None
    try:
        record = json.loads(value)
        if not isinstance(record, dict):
            raise TypeError("not a JSON object")
        return {str(k): float(v) for k, v in record.items()}
    except (TypeError, ValueError) as error:
        raise CorruptValueError(f"unreadable record: {error}") from error


class DiskcacheBackend(KeyValueBackend):
    """A diskcache directory; refuses directories that hold other files."""

    def __init__(self, directory: str) -> None:
        self.location = os.path.abspath(directory)
        if os.path.exists(self.location) and not os.path.isdir(self.location):
            raise StoreError(f"store path {self.location} is a file, not a directory")
        if os.path.isdir(self.location):
            contents = set(os.listdir(self.location))
            if contents and "cache.db" not in contents:
                raise StoreError(f"{self.location} is not a Carnator store (it holds other files and no cache.db); "
                                 "choose an empty or new directory")
        try:
            self._cache = diskcache.Cache(self.location, disk=SafeDisk, eviction_policy="none",
                                          size_limit=2**62, timeout=60)
        except (sqlite3.DatabaseError, OSError) as error:
            raise StoreError(f"{self.location} is not a usable Carnator store: {error}") from error

    def _get(self, key: str) -> bytes | None:
        try:
            return _as_bytes(self._cache.get(key))
        except _READ_ERRORS as error:
            raise CorruptValueError(str(error)) from error

    def get(self, key: str) -> bytes | None:
        return self._get(key)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        values = []
        for key in keys:
            try:
                values.append(self._get(key))
            except CorruptValueError:
                values.append(None)
        return values

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [key in self._cache for key in keys]

    def size(self, key: str) -> int:
        value = self.get_many([key])[0]
        return len(value) if value is not None else 0

    def counter(self, key: str) -> int:
        try:
            value = self._cache.get(key, 0)
        except _READ_ERRORS:
            return 0
        return value if isinstance(value, int) else 0

    def set(self, key: str, value: bytes) -> None:
        if not isinstance(value, bytes):
            raise UnsafeValueError(f"store values must be bytes, not {type(value).__name__}")
        self._cache.set(key, value)

    def set_if_absent(self, key: str, value: bytes) -> bool:
        return self._cache.add(key, value)

    def is_empty(self) -> bool:
        return len(self._cache) == 0

    def get_record(self, key: str) -> Record | None:
        return _as_record(self._get(key))

    def get_records(self, keys: Sequence[str]) -> list[Record | None]:
        records = []
        for value in self.get_many(keys):
            try:
                records.append(_as_record(value))
            except CorruptValueError:
                records.append(None)
        return records

    def update_record(self, key: str, add: Mapping[str, float], assign: Mapping[str, float]) -> bool:
        with self._cache.transact():
            record = self.get_record(key)
            if record is None:
                return False
            for name, amount in add.items():
                record[name] = record.get(name, 0.0) + amount
            record.update(assign)
            self._cache.set(key, json.dumps(record))
        return True

    def log_length(self) -> int:
        return self.counter(_SEQ)

    def read_log(self, start: int) -> list[bytes | None]:
        return self.get_many([f"seq/{n:012d}" for n in range(start + 1, self.log_length() + 1)])

    def commit(self, guard: str, values: Mapping[str, bytes], records: Mapping[str, Record],
               counters: Mapping[str, int], log_value: bytes, ensure: Mapping[str, bytes]) -> bool:
        for key, value in values.items():
            if not isinstance(value, bytes):
                raise UnsafeValueError(f"{key}: store values must be bytes, not {type(value).__name__}")
        with self._cache.transact():
            if guard in self._cache:
                return False
            for key, value in values.items():
                self._cache.set(key, value)
            for key, record in records.items():
                self._cache.set(key, json.dumps(record))
            for key, amount in counters.items():
                self._cache.incr(key, amount)
            position = self._cache.incr(_SEQ)
            self._cache.set(f"seq/{position:012d}", log_value)
            for key, value in ensure.items():
                self._cache.add(key, value)
        return True

    def delete(self, keys: Sequence[str], guard: str, counter: str, amount: int) -> bool:
        with self._cache.transact():
            existed = guard in self._cache
            for key in (*keys, guard):
                self._cache.delete(key)
            if existed and amount:
                self._cache.incr(counter, -amount)
        return existed

    def volume(self) -> int:
        return self._cache.volume()

    def capacity(self) -> int | None:
        return None

    def close(self) -> None:
        self._cache.close()

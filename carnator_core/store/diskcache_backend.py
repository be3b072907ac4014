"""The local backend: one diskcache directory shared by every ComfyUI process on the machine.

diskcache keeps small values in SQLite and large ones in files beside it, and its
transactions are SQLite transactions: a writer killed mid-entry leaves no row behind. Values
are written as bytes, and counters as integers; JSON records stored as text read as their
bytes. `SafeDisk` refuses to pickle on write and to unpickle on read, so a planted pickle payload is reported as corruption and never executed,
and it reads value files only when they are regular files inside the store.

The append log is a counter (`carnator/seq`) plus one key per position (`seq/<n>`, 1-based,
zero-padded); records are JSON objects, written as UTF-8 bytes.

The directory is hostile ground: files can be truncated, deleted, replaced or planted under a
running worker. Database failures become `StoreUnavailable` (a damaged database stays so until
its file is replaced, so every thread sees the same store), a database that vanished is
noticed before the next write and started afresh where only Carnator's files are, and value
files that no row references (a commit killed or failed midway) are swept away.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import sqlite3
import stat
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeVar

import diskcache
from diskcache.core import MODE_PICKLE, MODE_TEXT

from carnator_core.store.backend import (
    CorruptValueError,
    KeyValueBackend,
    Record,
    StoreError,
    StoreUnavailable,
    Unreadable,
    UnsafeValueError,
)

log = logging.getLogger("carnator.store")

_SEQ = "carnator/seq"
_DATABASE = "cache.db"
_JOURNALS = ("cache.db-wal", "cache.db-shm", "cache.db-journal")
_HEX_DIRECTORY = re.compile(r"[0-9a-f]{2}")
_VALUE_FILE = re.compile(r"[0-9a-f]{28}\.val")  # diskcache's names: `ab/cd/<28 hex digits>.val`
_LOG_POSITION = "seq/[0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9]"  # GLOB of a `seq/<n>` key
_DAMAGE = ("malformed", "not a database", "no such table", "disk I/O error")  # SQLite's words for broken files
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
               | getattr(os, "O_CLOEXEC", 0))
_T = TypeVar("_T")


def _read_value_file(directory: str, filename: str) -> bytes:
    """A value file's bytes, read only when it is a regular file inside the store.

    A planted symlink would serve any file of the machine, a FIFO would block the reader for good and
    a device may act on being opened: each is refused before it is opened, and again on the open file.
    A file that is simply gone raises FileNotFoundError (diskcache reads that as "deleted meanwhile").
    """
    if os.path.isabs(filename) or ".." in filename.replace("\\", "/").split("/"):
        raise CorruptValueError(f"store value points outside the store: {filename!r}")
    path = os.path.join(directory, filename)
    if os.path.realpath(path) != os.path.join(os.path.realpath(directory), os.path.normpath(filename)):
        raise CorruptValueError(f"store value {filename!r} leads outside the store through a link")
    found = os.lstat(path)
    if not stat.S_ISREG(found.st_mode):
        raise CorruptValueError(f"store value {filename!r} is not a regular file")
    try:
        descriptor = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as error:
        raise CorruptValueError(f"store value {filename!r} cannot be opened: {error}") from None
    with os.fdopen(descriptor, "rb") as file:
        opened = os.fstat(descriptor)
        if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (found.st_dev, found.st_ino):
            raise CorruptValueError(f"store value {filename!r} was replaced while being opened")
        return file.read()


class SafeDisk(diskcache.Disk):
    """diskcache serialisation restricted to bytes values and integer counters (keys: str): never pickle."""

    def put(self, key):
        if type(key) not in (str, bytes, int, float):
            raise UnsafeValueError(f"store keys must be str/bytes/numbers, not {type(key).__name__}")
        return super().put(key)

    def get(self, key, raw):
        if not raw:
            raise UnsafeValueError("refusing to unpickle a store key")
        return super().get(key, raw)

    def store(self, value, read, key=diskcache.core.UNKNOWN):
        if read or type(value) not in (bytes, int):
            raise UnsafeValueError(f"store values must be bytes or integer counters, not {type(value).__name__}")
        return super().store(value, read, key)

    def fetch(self, mode, filename, value, read):
        if mode == MODE_PICKLE:
            raise UnsafeValueError("refusing to unpickle a store value")
        if filename is None:
            return super().fetch(mode, filename, value, read)
        data = _read_value_file(self._directory, filename)
        if mode != MODE_TEXT:
            return data
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise CorruptValueError(f"store value {filename!r} is not text: {error}") from None


def _as_bytes(value: bytes | str | int | float | None) -> bytes | None:
    """A stored value as bytes (or absent). Stores hold their JSON records as text too, which reads as its UTF-8
    bytes; a counter or anything else planted under a value's key is no value."""
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


def _contents(directory: str, depth: int = 0) -> Iterator[tuple[os.DirEntry, str, bool]]:
    """Every entry of a store directory with its path relative to it, and whether it is Carnator's own: the database
    and its journals, and diskcache's value files. Directories are entered only where value files belong."""
    with os.scandir(directory) as entries:
        for entry in entries:
            if depth < 2 and _HEX_DIRECTORY.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                for inner, relative, ours in _contents(entry.path, depth + 1):
                    yield inner, os.path.join(entry.name, relative), ours
                continue
            named = entry.name in (_DATABASE, *_JOURNALS) if depth == 0 else bool(_VALUE_FILE.fullmatch(entry.name))
            yield entry, entry.name, depth != 1 and named and entry.is_file(follow_symlinks=False)


def _identity(path: str) -> tuple[int, int] | None:
    """Which file `path` is (device and inode), or None when there is none."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino


def _guarded(write: bool = False) -> Callable[[Callable[..., _T]], Callable[..., _T]]:
    """Backend operations answer in the store's errors; writes first make sure the database is still the store's."""

    def decorate(method: Callable[..., _T]) -> Callable[..., _T]:
        @functools.wraps(method)
        def guarded(self: DiskcacheBackend, *args) -> _T:
            self._check_database(write)
            try:
                return method(self, *args)
            except sqlite3.DatabaseError as error:
                raise self._failed(str(error)) from None
            except diskcache.Timeout:
                raise StoreUnavailable(f"{self.location}: its database refused a write transaction (locked by "
                                       "another process, or its files are damaged)") from None
            except OSError as error:  # disk full, permissions: this call fails, the next one tries again
                raise StoreUnavailable(f"{self.location}: {error}") from None

        return guarded

    return decorate


class DiskcacheBackend(KeyValueBackend):
    """A diskcache directory; refuses directories that hold other files."""

    def __init__(self, directory: str) -> None:
        self.location = os.path.abspath(directory)
        self._database = os.path.join(self.location, _DATABASE)
        self._reopen_lock = threading.Lock()
        self._damage: str | None = None
        self._cache, self._identity = self._open()

    # ----------------------------------------------------------------- the directory
    def _open(self) -> tuple[diskcache.Cache, tuple[int, int] | None]:
        """Open the store, creating directory and database where needed, and sweep away leftovers.

        A directory without a database may hold only Carnator's own files (value files and journals
        of a database deleted under a running worker): those are cleared; anything else is refused.
        """
        if os.path.exists(self.location) and not os.path.isdir(self.location):
            raise StoreError(f"store path {self.location} is a file, not a directory")
        if os.path.isdir(self.location) and not os.path.isfile(self._database):
            if not all(ours for _, _, ours in _contents(self.location)):
                raise StoreError(f"{self.location} is not a Carnator store (it holds other files and no cache.db); "
                                 "choose an empty or new directory")
            for name in _JOURNALS:  # a lost database's journal must not be replayed into the new one
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.location, name))
        try:
            # no memory map: a database file truncated under a running worker must fail reads, not kill the process
            cache = diskcache.Cache(self.location, disk=SafeDisk, eviction_policy="none", size_limit=2**62,
                                    timeout=60, sqlite_mmap_size=0)
            self._sweep(cache)
        except (sqlite3.DatabaseError, diskcache.Timeout, OSError) as error:
            raise StoreError(f"{self.location} is not a usable Carnator store: {error}") from error
        return cache, _identity(self._database)

    def _check_database(self, write: bool) -> None:
        """Before a write (and every call while damaged): is the database file still the one opened?

        Removed or replaced, it is opened afresh (said once), so writes never go into an unlinked
        database whose entries would be lost and whose value files would litter the new directory.
        """
        if (write or self._damage) and _identity(self._database) != self._identity:
            with self._reopen_lock:
                if _identity(self._database) != self._identity:
                    previous = self._cache
                    try:
                        self._cache, self._identity = self._open()
                    except StoreError as error:
                        raise StoreUnavailable(str(error)) from None
                    self._damage = None
                    previous.close()
                    log.warning("Carnator store %s lost its database while in use (the directory was removed or "
                                "replaced): continuing in a fresh store there; earlier entries are gone", self.location)
        if self._damage:
            raise StoreUnavailable(self._damage)

    def _failed(self, message: str) -> StoreUnavailable:
        """A database error as the store's: damage sticks (every thread's connection must agree), the rest passes."""
        if not any(word in message for word in _DAMAGE):
            return StoreUnavailable(f"{self.location}: {message}")
        self._damage = (f"database damaged ({message}); remove the store directory {self.location} and Carnator "
                        "starts a fresh store there")
        return StoreUnavailable(self._damage)

    def _sweep(self, cache: diskcache.Cache) -> None:
        """Delete value files no row references: what a commit killed or failed midway wrote.

        Commits write their files inside their transaction, so once this sweep holds the write
        lock every file listed before it is either committed or abandoned.
        """
        found = [relative for _, relative, ours in _contents(self.location) if ours and relative.endswith(".val")]
        if not found:
            return
        with cache.transact():
            referenced = {name for (name,) in cache._sql("SELECT filename FROM Cache WHERE filename IS NOT NULL")}
        leftovers = [name for name in found if name not in referenced]
        for name in leftovers:
            cache.disk.remove(name)
        if leftovers:
            log.info("Carnator store %s: removed %d value files no entry references (left by an interrupted write)",
                     self.location, len(leftovers))

    @_guarded(write=True)
    def sweep(self) -> None:
        self._sweep(self._cache)

    # ----------------------------------------------------------------- values
    def _get(self, key: str) -> bytes | None:
        try:
            return _as_bytes(self._cache.get(key))
        except (UnsafeValueError, CorruptValueError) as error:
            raise CorruptValueError(str(error)) from error

    def _get_or_error(self, key: str) -> bytes | Unreadable | None:
        try:
            return self._get(key)
        except CorruptValueError as error:
            return error

    @_guarded()
    def get(self, key: str) -> bytes | None:
        return self._get(key)

    @_guarded()
    def get_many(self, keys: Sequence[str]) -> list[bytes | Unreadable | None]:
        return [self._get_or_error(key) for key in keys]

    @_guarded()
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [key in self._cache for key in keys]

    @_guarded()
    def size(self, key: str) -> int:
        value = self._get_or_error(key)
        return len(value) if isinstance(value, bytes) else 0

    def _stored_int(self, cache: diskcache.Cache, key: str) -> int | None:
        """A counter's value (0 when absent), or None when what is stored there is no integer."""
        try:
            value = cache.get(key, 0)
        except (UnsafeValueError, CorruptValueError):
            return None
        return value if type(value) is int else None

    @_guarded()
    def counter(self, key: str) -> int:
        return self._stored_int(self._cache, key) or 0

    @_guarded(write=True)
    def set(self, key: str, value: bytes) -> None:
        if not isinstance(value, bytes):
            raise UnsafeValueError(f"store values must be bytes, not {type(value).__name__}")
        cache = self._cache
        with cache.transact():  # its file is written under the write lock, so a sweep never takes it for a leftover
            cache.set(key, value)

    @_guarded(write=True)
    def set_counter(self, key: str, value: int) -> None:
        self._cache.set(key, int(value))

    @_guarded(write=True)
    def set_if_absent(self, key: str, value: bytes) -> bool:
        return self._cache.add(key, value)

    @_guarded()
    def is_empty(self) -> bool:
        return len(self._cache) == 0

    # ----------------------------------------------------------------- records
    @_guarded()
    def get_record(self, key: str) -> Record | None:
        return _as_record(self._get(key))

    @_guarded()
    def get_records(self, keys: Sequence[str]) -> list[Record | Unreadable | None]:
        records: list[Record | Unreadable | None] = []
        for key in keys:
            try:
                records.append(_as_record(self._get(key)))
            except CorruptValueError as error:
                records.append(error)
        return records

    @_guarded(write=True)
    def update_record(self, key: str, add: Mapping[str, float], assign: Mapping[str, float]) -> bool:
        cache = self._cache
        with cache.transact():
            record = _as_record(self._get(key))
            if record is None:
                return False
            for name, amount in add.items():
                record[name] = record.get(name, 0.0) + amount
            record.update(assign)
            cache.set(key, json.dumps(record).encode())
        return True

    # ----------------------------------------------------------------- log and entries
    def _log_position(self, cache: diskcache.Cache) -> int:
        """The log's length; rebuilt from its positions (logged) when the counter holds no integer."""
        position = self._stored_int(cache, _SEQ)
        if position is not None:
            return position
        with cache.transact():
            position = self._stored_int(cache, _SEQ)
            if position is None:
                ((position,),) = cache._sql("SELECT COUNT(*) FROM Cache WHERE raw = 1 AND key GLOB ?",
                                            (_LOG_POSITION,)).fetchall()
                cache.set(_SEQ, position)
                log.warning("Carnator store %s: the entry log counter was unreadable; rebuilt it from the log "
                            "(%d positions)", self.location, position)
        return position

    @_guarded()
    def log_length(self) -> int:
        return self._log_position(self._cache)

    @_guarded()
    def read_log(self, start: int) -> list[bytes | Unreadable | None]:
        end = self._log_position(self._cache)
        return [self._get_or_error(f"seq/{n:012d}") for n in range(start + 1, end + 1)]

    @_guarded(write=True)
    def commit(self, guard: str, values: Mapping[str, bytes], records: Mapping[str, Record],
               counters: Mapping[str, int], log_value: bytes, ensure: Mapping[str, bytes]) -> bool:
        for key, value in values.items():
            if not isinstance(value, bytes):
                raise UnsafeValueError(f"{key}: store values must be bytes, not {type(value).__name__}")
        cache = self._cache
        try:
            with cache.transact():
                if guard in cache:
                    return False
                for key in counters:
                    if self._stored_int(cache, key) is None:
                        raise CorruptValueError(f"counter {key} holds no integer")
                position = self._log_position(cache) + 1
                for key, value in values.items():
                    cache.set(key, value)
                for key, record in records.items():
                    cache.set(key, json.dumps(record).encode())
                for key, amount in counters.items():
                    cache.incr(key, amount)
                cache.set(_SEQ, position)
                cache.set(f"seq/{position:012d}", log_value)
                for key, value in ensure.items():
                    cache.add(key, value)
        except Exception:  # nothing committed, but the value files written so far are on disk: remove them
            with contextlib.suppress(sqlite3.DatabaseError, diskcache.Timeout, OSError):
                self._sweep(cache)
            raise
        return True

    @_guarded(write=True)
    def delete(self, keys: Sequence[str], guard: str, counter: str, amount: int) -> bool:
        cache = self._cache
        with cache.transact():
            existed = guard in cache
            for key in (*keys, guard):
                cache.delete(key)
            if existed and amount and self._stored_int(cache, counter) is not None:
                cache.incr(counter, -amount)
        return existed

    @_guarded()
    def volume(self) -> int:
        """Bytes on disk: the database with its journals and every value file, referenced by an entry or not."""
        return sum(entry.stat(follow_symlinks=False).st_size for entry, _, _ in _contents(self.location)
                   if entry.is_file(follow_symlinks=False))

    def capacity(self) -> int | None:
        return None

    def close(self) -> None:
        self._cache.close()

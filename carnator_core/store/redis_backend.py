"""The fleet backend: one Redis database shared by every ComfyUI worker of a deployment.

Selected by a URL, `redis://[[user]:password@]host[:port][/db][?option=value...]` (`rediss://`
for TLS). Options, all optional: `timeout_ms` (connect and reply timeout of every call made
while a request waits, default 500), `write_timeout_ms` (for the background writer's entry
commits, which may carry tens of megabytes, default 30000), `retry_ms` (how long a worker
stays off an unreachable server before it tries again, default 2000) and `cache_gb` (this
worker's local read-through blob cache, default 8).

Values are raw bytes (blobs, safetensors, JSON text); records (hit counters) are Redis hashes
updated with HINCRBYFLOAT; the entry log is a list (`carnator/log`). An entry is committed
and deleted by one Lua script each, which Redis runs atomically: a reader never sees an
entry whose blobs are missing, and a client that dies mid-command writes nothing.

Failure handling: connection errors and timeouts raise `StoreUnavailable` and keep the
backend "down" for `retry_ms`, during which every call fails at once without touching the
network; the first call after that reconnects. redis-py's own retries are off, so no call
ever waits longer than its timeout.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from carnator_core.store.backend import (
    CorruptValueError,
    KeyValueBackend,
    Record,
    StoreError,
    StoreFull,
    StoreUnavailable,
    Unreadable,
    UnsafeValueError,
)

log = logging.getLogger("carnator.store")

SCHEMES = ("redis", "rediss")
_LOG = "carnator/log"
_BATCH = 1000  # keys per pipelined round trip: bounded replies, and Redis never blocks long on one command
_CAPACITY_SHARE = 0.75  # of maxmemory: room for Redis' per-key overhead, fragmentation and other data
_T = TypeVar("_T")

# KEYS: guard, log, value keys..., record keys..., counter keys..., keys to write only where absent...
# ARGV: n_values, n_records, n_counters, log_value, values..., per record (n_fields, field, value, ...), amounts...,
#       values to write only where absent...
_COMMIT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local nv, nr, nc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local log_type = redis.call('TYPE', KEYS[2]).ok
if log_type ~= 'none' and log_type ~= 'list' then return redis.error_reply('WRONGTYPE entry log is not a list') end
for i = 1, nc do
  local current = redis.call('GET', KEYS[2 + nv + nr + i])
  if current and not tonumber(current) then return redis.error_reply('WRONGTYPE counter is not an integer') end
end
for i = 1, nv do redis.call('SET', KEYS[2 + i], ARGV[4 + i]) end
local a = 4 + nv
for i = 1, nr do
  local key, n = KEYS[2 + nv + i], tonumber(ARGV[a + 1])
  redis.call('DEL', key)
  if n > 0 then redis.call('HSET', key, unpack(ARGV, a + 2, a + 1 + 2 * n)) end
  a = a + 1 + 2 * n
end
for i = 1, nc do redis.call('INCRBY', KEYS[2 + nv + nr + i], ARGV[a + i]) end
redis.call('RPUSH', KEYS[2], ARGV[4])
for i = 3 + nv + nr + nc, #KEYS do redis.call('SET', KEYS[i], ARGV[a + nc + i - (2 + nv + nr + nc)], 'NX') end
return 1
"""

# KEYS: guard, counter, keys...; ARGV: amount
_DELETE = """
local existed = redis.call('EXISTS', KEYS[1])
redis.call('DEL', unpack(KEYS, 3))
redis.call('DEL', KEYS[1])
if existed == 1 and ARGV[1] ~= '0' then
  local current = redis.call('GET', KEYS[2])
  if not current or tonumber(current) then redis.call('DECRBY', KEYS[2], ARGV[1]) end
end
return existed
"""

# KEYS: record; ARGV: n_add, field, amount, ..., field, value, ...
_UPDATE = """
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'none' then return 0 end
if kind ~= 'hash' then return redis.error_reply('WRONGTYPE record is not a hash') end
local n = tonumber(ARGV[1])
for i = 0, n - 1 do redis.call('HINCRBYFLOAT', KEYS[1], ARGV[2 + 2 * i], ARGV[3 + 2 * i]) end
for i = 2 + 2 * n, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""


@dataclass(frozen=True)
class RedisLocation:
    """A parsed store URL: where the server is, how to log in, and this client's timeouts."""

    host: str
    port: int
    db: int
    username: str | None
    password: str | None
    tls: bool
    timeout_ms: int = 500
    write_timeout_ms: int = 30_000
    retry_ms: int = 2_000
    cache_gb: float = 8.0

    @property
    def public_url(self) -> str:
        """The URL without credentials or client options: the store's name in messages, reports and registries."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'rediss' if self.tls else 'redis'}://{host}:{self.port}/{self.db}"


_OPTIONS: dict[str, tuple[type, float, float]] = {
    "timeout_ms": (int, 1, 600_000), "write_timeout_ms": (int, 1, 3_600_000), "retry_ms": (int, 0, 3_600_000),
    "cache_gb": (float, 0, 100_000),
}


def parse_redis_url(url: str) -> RedisLocation:
    """A `RedisLocation`, or StoreError saying what is wrong with the URL (never a connection attempt)."""
    shown = url if "@" not in url else "<URL with credentials>"
    try:
        parts = urllib.parse.urlsplit(url.strip())
        port = parts.port or 6379
    except ValueError as error:
        raise StoreError(f"Redis URL {shown!r} does not parse: {error}") from None
    if parts.scheme.lower() not in SCHEMES:
        raise StoreError(f"store URL {shown!r}: scheme must be redis:// or rediss://")
    if not parts.hostname:
        raise StoreError(f"Redis URL {shown!r} names no host; expected redis://host:port/db")
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise StoreError(f"Redis URL {shown!r}: the path must be a database number (redis://host:port/0)")
    options: dict[str, int | float] = {}
    for name, values in urllib.parse.parse_qs(parts.query, keep_blank_values=True).items():
        if name not in _OPTIONS:
            raise StoreError(f"Redis URL {shown!r}: unknown option {name!r}; known: {', '.join(_OPTIONS)}")
        kind, low, high = _OPTIONS[name]
        try:
            value = kind(values[-1])
        except ValueError:
            raise StoreError(f"Redis URL {shown!r}: {name} must be a number") from None
        if not low <= value <= high:
            raise StoreError(f"Redis URL {shown!r}: {name} must lie between {low:g} and {high:g}")
        options[name] = value
    return RedisLocation(host=parts.hostname, port=port, db=int(path or 0),
                         username=urllib.parse.unquote(parts.username) if parts.username else None,
                         password=urllib.parse.unquote(parts.password) if parts.password is not None else None,
                         tls=parts.scheme.lower() == "rediss", **options)


def _record(fields: Mapping[bytes, bytes]) -> Record | None:
    if not fields:
        return None
    try:
        return {name.decode("utf-8"): float(value) for name, value in fields.items()}
    except (UnicodeDecodeError, ValueError) as error:
        raise CorruptValueError(f"unreadable record: {error}") from error


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _number(value: float) -> str:
    return repr(float(value))


class RedisBackend(KeyValueBackend):
    """A Redis database (no cluster: the entry scripts touch keys of one entry in one database)."""

    def __init__(self, location: RedisLocation) -> None:
        self.redis_location = location
        self.location = location.public_url
        self._fast = self._client(location.timeout_ms)
        self._bulk = self._client(location.write_timeout_ms)
        self._scripts = {name: (self._fast.register_script(source), self._bulk.register_script(source))
                         for name, source in (("commit", _COMMIT), ("delete", _DELETE), ("update", _UPDATE))}
        self._down_until = 0.0
        self._down_reason = ""
        self._capacity: int | None | bool = False  # False: not asked yet
        self._check_server()

    def _client(self, timeout_ms: int) -> redis.Redis:
        location = self.redis_location
        return redis.Redis(host=location.host, port=location.port, db=location.db, username=location.username,
                           password=location.password, ssl=location.tls, socket_timeout=timeout_ms / 1000,
                           socket_connect_timeout=timeout_ms / 1000, retry=Retry(NoBackoff(), 0),
                           health_check_interval=0, client_name="carnator")

    def _check_server(self) -> None:
        """Bad input is a StoreError now; an unreachable server only marks the backend down (retried later)."""
        try:
            if self._fast.ping() is not True:
                raise StoreError(f"{self.location} did not answer PING like a Redis server")
        except (redis.AuthenticationError, redis.ResponseError) as error:
            if self.redis_location.password is None and (isinstance(error, redis.AuthenticationError)
                                                         or str(error).startswith("NOAUTH")):
                raise StoreError(f"Redis at {self.location} needs a password: use redis://:PASSWORD@host:port/db "
                                 f"({error})") from None
            if isinstance(error, redis.AuthenticationError) or str(error).startswith("WRONGPASS"):
                raise StoreError(f"Redis at {self.location} refused the credentials in the store URL: "
                                 f"{error}") from None
            raise StoreError(f"Redis at {self.location} refused the connection: {error}") from None
        except redis.exceptions.InvalidResponse as error:
            raise StoreError(f"{self.location} is not a Redis server (it answered {error})") from None
        except (redis.ConnectionError, redis.TimeoutError, OSError) as error:
            self._went_down(error)  # not wrong, only unreachable: the store retries by itself

    # ----------------------------------------------------------------- failure handling
    def _went_down(self, error: Exception) -> None:
        self._down_until = time.monotonic() + self.redis_location.retry_ms / 1000
        self._down_reason = str(error) or type(error).__name__

    def _call(self, operation: Callable[[], _T]) -> _T:
        if time.monotonic() < self._down_until:
            raise StoreUnavailable(self._down_reason)
        try:
            return operation()
        except redis.ResponseError as error:
            message = str(error)
            if "WRONGTYPE" in message:
                raise CorruptValueError(message) from None
            if isinstance(error, redis.exceptions.OutOfMemoryError) or "maxmemory" in message:
                raise StoreFull(f"Redis at {self.location} is out of memory (maxmemory): {message}") from None
            self._went_down(error)
            raise StoreUnavailable(self._down_reason) from None
        except (redis.RedisError, OSError) as error:  # connection, timeout, auth, protocol
            self._went_down(error)
            raise StoreUnavailable(self._down_reason) from None

    # ----------------------------------------------------------------- values
    def get(self, key: str) -> bytes | None:
        return self._call(lambda: self._fast.get(key))

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        values: list[bytes | None] = []
        for start in range(0, len(keys), _BATCH):
            chunk = list(keys[start:start + _BATCH])
            values.extend(self._call(lambda chunk=chunk: self._fast.mget(chunk)))  # MGET: non-strings read as None
        return values

    def _pipelined(self, command: str, keys: Sequence[str]) -> list:
        """One command per key, `_BATCH` per round trip; per-key errors come back as exception objects."""
        results: list = []
        for start in range(0, len(keys), _BATCH):
            def run(chunk=keys[start:start + _BATCH]):
                pipe = self._fast.pipeline(transaction=False)
                for key in chunk:
                    getattr(pipe, command)(key)
                return pipe.execute(raise_on_error=False)
            results.extend(self._call(run))
        return results

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [result == 1 for result in self._pipelined("exists", keys)]

    def size(self, key: str) -> int:
        return int(self._call(lambda: self._fast.strlen(key)))

    def counter(self, key: str) -> int:
        value = self._call(lambda: self._fast.get(key))
        try:
            return int(value) if value is not None else 0
        except ValueError:
            return 0

    def set(self, key: str, value: bytes) -> None:
        if not isinstance(value, bytes):
            raise UnsafeValueError(f"store values must be bytes, not {type(value).__name__}")
        self._call(lambda: self._fast.set(key, value))

    def set_counter(self, key: str, value: int) -> None:
        self._call(lambda: self._fast.set(key, int(value)))

    def set_if_absent(self, key: str, value: bytes) -> bool:
        return bool(self._call(lambda: self._fast.set(key, value, nx=True)))

    def is_empty(self) -> bool:
        return self._call(self._fast.dbsize) == 0

    # ----------------------------------------------------------------- records
    def get_record(self, key: str) -> Record | None:
        return _record(self._call(lambda: self._fast.hgetall(key)))

    def get_records(self, keys: Sequence[str]) -> list[Record | Unreadable | None]:
        records: list[Record | Unreadable | None] = []
        for fields in self._pipelined("hgetall", keys):
            try:
                records.append(CorruptValueError(str(fields)) if isinstance(fields, Exception) else _record(fields))
            except CorruptValueError as error:
                records.append(error)
        return records

    def update_record(self, key: str, add: Mapping[str, float], assign: Mapping[str, float]) -> bool:
        args = [len(add)]
        for name, amount in add.items():
            args += [name, _number(amount)]
        for name, value in assign.items():
            args += [name, _number(value)]
        return bool(self._call(lambda: self._scripts["update"][0](keys=[key], args=args)))

    # ----------------------------------------------------------------- log and entries
    def log_length(self) -> int:
        return int(self._call(lambda: self._fast.llen(_LOG)))

    def read_log(self, start: int) -> list[bytes | None]:
        values: list[bytes | None] = []
        while True:
            position = start + len(values)
            chunk = self._call(lambda p=position: self._fast.lrange(_LOG, p, p + 10 * _BATCH - 1))
            values.extend(chunk)
            if len(chunk) < 10 * _BATCH:
                return values

    def commit(self, guard: str, values: Mapping[str, bytes], records: Mapping[str, Record],
               counters: Mapping[str, int], log_value: bytes, ensure: Mapping[str, bytes]) -> bool:
        for key, value in values.items():
            if not isinstance(value, bytes):
                raise UnsafeValueError(f"{key}: store values must be bytes, not {type(value).__name__}")
        keys = [guard, _LOG, *values, *records, *counters, *ensure]
        args: list = [len(values), len(records), len(counters), log_value, *values.values()]
        for record in records.values():
            args.append(len(record))
            for name, number in record.items():
                args += [name, _number(number)]
        args += [int(amount) for amount in counters.values()]
        args += list(ensure.values())
        return bool(self._call(lambda: self._scripts["commit"][1](keys=keys, args=args)))

    def delete(self, keys: Sequence[str], guard: str, counter: str, amount: int) -> bool:
        return bool(self._call(lambda: self._scripts["delete"][1](keys=[guard, counter, *keys], args=[int(amount)])))

    def sweep(self) -> None:
        """Nothing to sweep: an entry's commit is one script, which Redis runs whole or not at all."""

    # ----------------------------------------------------------------- server
    def volume(self) -> int:
        return int(self._call(lambda: self._fast.info("memory"))["used_memory"])

    def capacity(self) -> int | None:
        """`_CAPACITY_SHARE` of the server's maxmemory (asked once); None when unlimited or not allowed to ask.

        Logs once when the server's eviction policy may drop parts of entries: Carnator sets no
        TTLs, so `noeviction` or any `volatile-*` policy leaves its keys to its own value-based
        eviction; `allkeys-*` lets Redis remove single blobs (the entry is then skipped as corrupt).
        """
        if self._capacity is False:
            if time.monotonic() < self._down_until:
                return None  # ask again once the server is back
            try:
                config = self._fast.config_get("maxmemory*")
            except redis.ResponseError:
                config = {}  # CONFIG renamed or disabled (managed Redis): rely on the size limit alone
            except (redis.RedisError, OSError) as error:
                self._went_down(error)
                return None
            config = {_text(name): _text(value) for name, value in config.items()}
            limit = int(config.get("maxmemory") or 0)
            policy = config.get("maxmemory-policy", "")
            if policy.startswith("allkeys"):
                log.warning("Carnator store %s: Redis maxmemory-policy is %s, which may evict single blobs of "
                            "Carnator entries; use noeviction or a volatile-* policy", self.location, policy)
            self._capacity = int(limit * _CAPACITY_SHARE) if limit > 0 else None
        return self._capacity

    def close(self) -> None:
        self._fast.close()
        self._bulk.close()

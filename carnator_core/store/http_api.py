"""What the `/carnator/store/...` HTTP routes do, without the web framework: validation, listing, actions.

The routes are reachable by any page the user's browser opens, so everything that comes from a
request is checked here before it touches a store: a request picks one of the stores the server
itself opened (never a directory or URL of its own), entry ids must be the 32-hex-digit uuids the
store writes (no path can be smuggled into a key), page sizes and search texts are bounded, and
state-changing requests must name this server as Host (a DNS-rebinding page names its own domain)
and come from its own origin. Every route answers for the caller's scope alone (`carnator_core.store.scopes`): an
entry or profile of another scope is as absent as one that never was. Errors are `ApiError`s that carry an HTTP status and a message meant
for the user; the route layer turns them into JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import re
import sqlite3
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from carnator_core.judging.calibration_profile import Profile, ProfileError, profile_key
from carnator_core.store import profiles
from carnator_core.store.backend import CorruptValueError, StoreError, StoreUnavailable, is_store_url
from carnator_core.store.entry import EntryMeta
from carnator_core.store.location import host_address, is_loopback_host, opened_stores, store_key
from carnator_core.store.reuse_store import EntryStats, ReuseStore

ENTRY_ID = re.compile(r"[0-9a-f]{32}")
FINGERPRINT = re.compile(r"[0-9a-f]{1,64}")
DEFAULT_PAGE = 50
MAX_PAGE = 100
MAX_QUERY = 200
MAX_OFFSET = 10**9
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
# What a damaged, read-only or vanished store raises beyond the store's own errors (SQLite and file-system errors).
_STORE_FAILURES = (StoreError, CorruptValueError, sqlite3.DatabaseError, OSError)
_T = TypeVar("_T")


class ApiError(Exception):
    """A request the routes refuse: HTTP `status` and a message for the user (never a stack trace)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# ------------------------------------------------------------------ request checks
def entry_id(value: str) -> str:
    """The entry id from a URL, or ApiError 400: only lowercase 32-digit hex (what `EntryMeta.new_id` makes)."""
    if not isinstance(value, str) or not ENTRY_ID.fullmatch(value):
        raise ApiError(400, "invalid entry id: expected 32 lowercase hexadecimal digits")
    return value


def _int_param(query: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ApiError(400, f"{name} must be an integer") from None
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be between {low} and {high}")
    return value


def page_params(query: Mapping[str, str]) -> tuple[int, int, str]:
    """(offset, limit, search text) of a listing request, each bounded."""
    offset = _int_param(query, "offset", 0, 0, MAX_OFFSET)
    limit = _int_param(query, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
    text = query.get("q") or ""
    if len(text) > MAX_QUERY:
        raise ApiError(400, f"search text longer than {MAX_QUERY} characters")
    return offset, limit, text


def flag_param(value: Any, name: str) -> bool:
    """A boolean from JSON (true/false) or a query string ("true"/"false"/"1"/"0")."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "false", "0"):
        return value.lower() in ("true", "1")
    raise ApiError(400, f"{name} must be true or false")


def _host_port(netloc: str, scheme: str) -> tuple[str, int | None]:
    """(host name, port) of a Host header or an origin's netloc; ("", None) when it is not a bare host[:port]."""
    try:
        parsed = urllib.parse.urlsplit(f"//{netloc}")
        port = parsed.port
    except ValueError:  # a bad port or IPv6 literal
        return "", None
    if parsed.path or parsed.query or parsed.fragment or parsed.username is not None:
        return "", None
    return (parsed.hostname or "").lower(), port if port is not None else _DEFAULT_PORTS.get(scheme)


def trusted_host(host: str, listen: Iterable[str], local_address: str | None) -> bool:
    """Whether a Host name names this server: a loopback name or address, a name or address ComfyUI was told to
    listen on (`--listen`, comma-separated), or, where it listens on every address (0.0.0.0, ::), the address this
    connection reached. A DNS-rebinding page reaches the server under its own domain, which is none of these."""
    if is_loopback_host(host):
        return True
    address = host_address(host)
    for entry in (entry.strip().lower() for entry in listen):
        listened = host_address(entry)
        if listened is None:
            if entry == host:
                return True
        elif listened.is_unspecified:
            if address is not None and local_address is not None and address == host_address(local_address):
                return True
        elif address == listened:
            return True
    return False


def refused_origin(headers: Mapping[str, str], scheme: str, listen: Iterable[str],
                   local_address: str | None) -> str | None:
    """Why a state-changing request must be refused, or None when it may proceed.

    Host must name this server (`trusted_host`): a page that rebinds its own domain to this machine sends that
    domain as Host and Origin, which agree with each other. Browsers send `Origin` (and `Sec-Fetch-Site`) with
    every POST/DELETE, and it must be this server's own origin exactly, scheme included, so a page on another
    site cannot pin or delete entries. Requests without them come from non-browser clients (scripts, the queue
    runner) and are allowed.
    """
    site = headers.get("Sec-Fetch-Site")
    if site is not None and site.lower() not in ("same-origin", "none"):
        return f"cross-site request refused (Sec-Fetch-Site: {site})"
    host = headers.get("Host", "")
    hostname, port = _host_port(host, scheme)
    if not hostname or not trusted_host(hostname, listen, local_address):
        return f"request for host {host[:200]!r} refused: not a name or address this server listens on"
    origin = headers.get("Origin")
    if origin is None:
        return None
    origin_scheme, separator, origin_host = origin.partition("://")
    if not separator or origin_scheme.lower() != scheme or _host_port(origin_host, scheme) != (hostname, port):
        return f"cross-origin request from {origin[:200]!r} to {scheme}://{host} refused"
    return None


# ------------------------------------------------------------------ store selection
def store_id(key: str) -> str:
    """A store's id in the routes: a digest of its registry key (directory, or URL without credentials)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class ServedStores:
    """The stores the routes serve: the server's default store and every store this process opened (Carnator
    Store nodes, the configured store), picked by id or name, never by a directory or URL the request names: a
    page must not make the server open, create or connect to anything.

    Only the default store is opened here, when no node has opened it yet, into the one store object this class
    keeps, and outside `open_store`'s lock, so no request can hold up sampling.
    """

    def __init__(self, default_location: Callable[[], str]) -> None:
        self._default_location = default_location
        self._own: tuple[str, ReuseStore] | None = None
        self._lock = threading.Lock()  # the routes' own: sampling never takes it

    def _known(self) -> tuple[str, str, dict[str, ReuseStore]]:
        """The default store's location and key, and every open store the routes serve, by key."""
        try:
            location = self._default_location()
            key = store_key(location)
        except StoreError as error:
            raise ApiError(409, f"the configured store cannot be used: {error}") from None
        served = {key: self._own[1]} if self._own is not None and self._own[0] == key else {}
        return location, key, {**served, **opened_stores()}

    def listing(self) -> dict[str, Any]:
        """The stores a request may pick (the default first), with why each is unavailable, if it is."""
        _, default, served = self._known()
        keys = [default, *sorted(key for key in served if key != default)]
        return {"stores": [{"id": store_id(key), "name": key, "default": key == default,
                            "unavailable": served[key].unavailable if key in served else None} for key in keys]}

    def select(self, requested: str) -> ReuseStore | None:
        """The store `requested` names by id or name (empty: the default), or ApiError 404; None is an empty store."""
        location, default, served = self._known()
        if requested in ("", default, store_id(default)):
            return served.get(default) or self._open_default(location, default)
        for key, store in served.items():
            if requested in (key, store_id(key)):
                return store
        raise ApiError(404, "no such store on this server: GET /carnator/store/stores lists the stores it serves")

    def _open_default(self, location: str, key: str) -> ReuseStore | None:
        """The default store before any node opened it; None while its directory holds no store (no request
        creates one: there is nothing to list, pin or delete there anyway)."""
        with self._lock, _store_failures(key, "opened"):
            if not is_store_url(location) and not os.path.isfile(os.path.join(location, "cache.db")):
                if os.path.exists(location) and (not os.path.isdir(location) or os.listdir(location)):
                    raise ApiError(409, f"{location} is not a Carnator store")
                return None
            if self._own is None or self._own[0] != key:
                previous, self._own = self._own, (key, ReuseStore(location))
                if previous is not None:  # the operator configured another default store meanwhile
                    previous[1].close()
            return self._own[1]

    def close(self) -> None:
        """Close the default store opened here (`process_state.reset`); the others are `open_store`'s to close."""
        with self._lock:
            own, self._own = self._own, None
        if own is not None:
            own[1].close()


@contextlib.contextmanager
def _store_failures(name: str, verb: str) -> Iterator[None]:
    """A store that is down, damaged or read-only is a JSON error for the user, not a stack trace."""
    try:
        yield
    except StoreUnavailable as error:
        raise ApiError(503, f"store {name} is unavailable: {error}") from None
    except _STORE_FAILURES as error:
        raise ApiError(409, f"store {name} cannot be {verb}: {error}") from None


def _on_store(verb: str) -> Callable[[Callable[..., _T]], Callable[..., _T]]:
    """Run a route's store work under `_store_failures`; an answer from a store that went down meanwhile is a
    503, not an empty listing or a 404."""

    def decorate(work: Callable[..., _T]) -> Callable[..., _T]:
        @functools.wraps(work)
        def guarded(store: ReuseStore | None, *args: Any) -> _T:
            if store is None:
                return work(store, *args)
            with _store_failures(store.location, verb):
                try:
                    result = work(store, *args)
                except ApiError:
                    _raise_if_down(store)
                    raise
                _raise_if_down(store)
                return result

        return guarded

    return decorate


def _raise_if_down(store: ReuseStore) -> None:
    if store.unavailable:
        raise StoreUnavailable(store.unavailable)


# ------------------------------------------------------------------ reading
def _summary(entry: str, meta: EntryMeta, stats: EntryStats | None) -> dict[str, Any]:
    """What the store panel shows of one entry."""
    stats = stats or EntryStats()
    return {
        "id": entry,
        "prompt": meta.prompt,
        "created_at": meta.created_at,
        "bytes": meta.total_bytes,
        "hits": stats.hits,
        "seconds_saved": stats.seconds_saved,
        "last_hit_at": stats.last_hit_at or None,
        "pinned": stats.pinned,
        "thumbnail": "thumb" in meta.blob_bytes,
        "total_steps": meta.total_steps,
        "sample_seconds": meta.sample_seconds,
        "latent_shape": list(meta.latent_shape),
        "seed": meta.seed,
        "cfg": meta.cfg,
        "donor_id": meta.lineage.get("donor_id"),
        "donor_depth": meta.lineage.get("depth"),
        "model": meta.hard_key.model,
        "schedule": meta.hard_key.schedule,
    }


def _readable(store: ReuseStore, scope: str) -> list[tuple[str, EntryMeta]]:
    """The scope's live entries (oldest first) with their metadata, in one batched read."""
    ids = list(store.entry_ids())
    return [(entry, meta) for entry, meta in zip(ids, store.get_metas(ids), strict=True)
            if meta is not None and meta.hard_key.scope == scope]


def _own(store: ReuseStore | None, scope: str, entry: str) -> ReuseStore:
    """The store, where `entry` is in it and of `scope`; else ApiError 404 (another scope's entry is no entry)."""
    meta = store.get_meta(entry) if store is not None else None
    if meta is None or meta.hard_key.scope != scope:
        raise ApiError(404, f"no entry {entry}")
    return store


@_on_store("read")
def list_entries(store: ReuseStore | None, scope: str, offset: int, limit: int, text: str) -> dict[str, Any]:
    """One page of the scope's entries, newest first, whose prompt contains every word of `text` (any case)."""
    terms = text.lower().split()
    matching: list[tuple[str, EntryMeta]] = []
    if store is not None:
        matching = [(entry, meta) for entry, meta in _readable(store, scope)
                    if all(term in meta.prompt.lower() for term in terms)][::-1]
    page = matching[offset:offset + limit]
    stats = store.stats_many([entry for entry, _ in page]) if page else []
    return {"entries": [_summary(entry, meta, s) for (entry, meta), s in zip(page, stats, strict=True)],
            "total": len(matching), "offset": offset, "limit": limit, "q": text,
            "store": store.location if store is not None else None}


@_on_store("read")
def store_totals(store: ReuseStore | None, scope: str) -> dict[str, Any]:
    """Totals of the scope's entries for the panel: entries, bytes, hits, time saved and the hit rate of recorded
    requests (the store's own size on disk only in the single-user scope: it counts every scope's entries).

    The hit rate is the share of recorded requests that themselves reused a donor (their lineage
    names one); `hits` counts how often entries served as donors.
    """
    if store is None:
        return {"store": None, "entries": 0, "bytes": 0, "disk_bytes": 0, "size_limit": None, "hits": 0,
                "seconds_saved": 0.0, "pinned": 0, "reused": 0, "hit_rate": None}
    live = _readable(store, scope)
    stats = [s or EntryStats() for s in store.stats_many([entry for entry, _ in live])]
    reused = sum(1 for _, meta in live if meta.lineage.get("donor_id"))
    whole = scope == ""
    return {"store": store.location, "entries": len(live),
            "bytes": store.used_bytes() if whole else sum(meta.total_bytes for _, meta in live),
            "disk_bytes": store.volume() if whole else None,
            "size_limit": store.size_limit, "hits": sum(s.hits for s in stats),
            "seconds_saved": sum(s.seconds_saved for s in stats), "pinned": sum(1 for s in stats if s.pinned),
            "reused": reused, "hit_rate": reused / len(live) if live else None}


@_on_store("read")
def thumbnail(store: ReuseStore | None, scope: str, entry: str) -> bytes:
    """The entry's PNG preview, or ApiError 404."""
    png = _own(store, scope, entry).get_blob(entry, "thumb")
    if png is None:
        raise ApiError(404, f"entry {entry} has no thumbnail")
    return png


# ------------------------------------------------------------------ changing
@_on_store("changed")
def set_pinned(store: ReuseStore | None, scope: str, entry: str, pinned: bool) -> dict[str, Any]:
    if not _own(store, scope, entry).set_pinned(entry, pinned):
        raise ApiError(404, f"no entry {entry}")
    return {"id": entry, "pinned": pinned}


@_on_store("changed")
def delete_entry(store: ReuseStore | None, scope: str, entry: str) -> dict[str, Any]:
    if not _own(store, scope, entry).delete(entry):
        raise ApiError(404, f"no entry {entry}")
    return {"id": entry, "deleted": True}


@_on_store("changed")
def clear_store(store: ReuseStore | None, scope: str, confirm: Any) -> dict[str, Any]:
    """Delete every entry of the scope; refused unless the request confirms it explicitly (`confirm=true`)."""
    if confirm is None or not flag_param(confirm, "confirm"):
        raise ApiError(400, "clearing the store deletes every entry: repeat the request with confirm=true")
    if store is None:
        return {"deleted": 0}
    own = [entry for entry, _ in _readable(store, scope)]
    if len(own) == sum(1 for _ in store.entry_ids()):
        store.clear()
        return {"deleted": len(own)}
    return {"deleted": sum(store.delete(entry) for entry in own)}


# ------------------------------------------------------------------ calibration profiles
def fingerprint(value: str, name: str) -> str:
    """A model or schedule fingerprint from a request: hex digits only, so nothing else reaches a key."""
    if not FINGERPRINT.fullmatch(value):
        raise ApiError(400, f"{name} must be a fingerprint of hex digits")
    return value


@_on_store("read")
def list_profiles(store: ReuseStore | None, scope: str) -> dict[str, Any]:
    """Every calibration profile of the scope in the store, whole (the export) with how it is named and its
    equal-quality verdict in sentences, and the refused ones with the reason."""
    if store is None:
        return {"profiles": [], "refused": {}}
    usable, refused = profiles.stored_profiles(store, scope)
    return {"profiles": [{**profile.as_dict(), "key": key, "description": profile.describe(),
                          "verdict": profile.verdict_lines()}
                         for key, profile in sorted(usable.items())], "refused": refused}


@_on_store("changed")
def import_profile(store: ReuseStore | None, scope: str, body: dict[str, Any]) -> dict[str, Any]:
    """File the profile in `body` (a profile.json as calibration writes it) in the caller's scope, whatever scope it
    names, replacing the one for its model and schedule there; a profile with a missing, NaN or out-of-range field is
    refused with the field named."""
    if store is None:
        raise ApiError(409, "the default store does not exist yet: run a Carnator node once first")
    try:
        profile = dataclasses.replace(Profile.from_dict(body), scope=scope)
    except ProfileError as error:
        raise ApiError(400, str(error)) from None
    profiles.save_profile(store, profile)
    return {"key": profile.key, "description": profile.describe(), "in_force": profile.in_force,
            "reason": profile.reason}


@_on_store("changed")
def remove_profile(store: ReuseStore | None, scope: str, model: str, schedule: str) -> dict[str, Any]:
    key = profile_key(model, schedule, scope)
    if store is None or not profiles.delete_profile(store, key):
        raise ApiError(404, f"no profile {profile_key(model, schedule)}")
    return {"key": key, "deleted": True}

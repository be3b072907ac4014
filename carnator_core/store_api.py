"""What the `/carnator/store/...` HTTP routes do, without the web framework: validation, listing, actions.

The routes are reachable by any page the user's browser opens, so everything that comes from a
request is checked here before it touches the store: entry ids must be the 32-hex-digit uuids the
store writes (no path can be smuggled into a key), page sizes and search texts are bounded, and
state-changing requests from another origin are refused. Errors are `ApiError`s that carry an HTTP
status and a message meant for the user; the route layer turns them into JSON.
"""

from __future__ import annotations

import functools
import os
import re
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from carnator_core.entry import EntryMeta
from carnator_core.store import EntryStats, ReuseStore, StoreError, StoreUnavailable
from carnator_core.store_redis import is_redis_url

ENTRY_ID = re.compile(r"[0-9a-f]{32}")
DEFAULT_PAGE = 50
MAX_PAGE = 100
MAX_QUERY = 200
MAX_OFFSET = 10**9
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


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
    parsed = urllib.parse.urlsplit(f"//{netloc}")
    try:
        port = parsed.port
    except ValueError:
        port = None
    return (parsed.hostname or "").lower(), port if port is not None else _DEFAULT_PORTS.get(scheme)


def cross_origin(headers: Mapping[str, str], scheme: str = "http") -> str | None:
    """Why a state-changing request must be refused as cross-origin, or None when it may proceed.

    Browsers send `Origin` (and `Sec-Fetch-Site`) with every POST/DELETE; a page on another site
    must not be able to delete or pin entries on the user's local server. Requests without these
    headers come from non-browser clients (scripts, the queue runner) and are allowed.
    """
    site = headers.get("Sec-Fetch-Site")
    if site is not None and site.lower() not in ("same-origin", "none"):
        return f"cross-site request refused (Sec-Fetch-Site: {site})"
    origin = headers.get("Origin")
    if origin is None:
        return None
    host = headers.get("Host", "")
    parsed = urllib.parse.urlsplit(origin)
    if origin == "null" or not parsed.scheme or not parsed.netloc or not host:
        return f"request from origin {origin!r} refused"
    if _host_port(parsed.netloc, parsed.scheme) != _host_port(host, parsed.scheme):
        return f"cross-origin request from {origin} to {host} refused"
    return None


# ------------------------------------------------------------------ store selection
def select_store(user_path: str, resolve: Callable[[str], str], open_path: Callable[[str], ReuseStore]
                 ) -> ReuseStore | None:
    """The store a request names (the `store` parameter), by the rule of the Carnator Store node.

    `resolve` maps the parameter to a directory or Redis URL (empty: the server's default store) and
    `open_path` opens it, both as the nodes do. A directory without a store is None, an empty store
    to the caller: no request creates directories on the server (there is nothing to list, pin or
    delete there anyway).
    """
    if len(user_path) > 4096:
        raise ApiError(400, "store path too long")
    try:
        location = resolve(user_path)
    except StoreError as error:
        raise ApiError(400, str(error)) from None
    if not is_redis_url(location) and not os.path.isfile(os.path.join(location, "cache.db")):
        if os.path.exists(location) and (not os.path.isdir(location) or os.listdir(location)):
            raise ApiError(409, f"{location} is not a Carnator store")
        return None
    try:
        store = open_path(user_path)
    except StoreError as error:
        raise ApiError(409, str(error)) from None
    if store.unavailable:
        raise ApiError(503, f"store {store.directory} is unavailable: {store.unavailable}")
    return store


def _changes(work: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """A write to a store whose server went down meanwhile is a 503, not a stack trace."""

    @functools.wraps(work)
    def guarded(*args, **kwargs) -> dict[str, Any]:
        try:
            return work(*args, **kwargs)
        except StoreUnavailable as error:
            raise ApiError(503, f"store unavailable: {error}") from None

    return guarded


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
    }


def _readable(store: ReuseStore) -> tuple[list[str], list[EntryMeta | None]]:
    """Live entry ids (oldest first) and their metadata, in one batched read."""
    ids = list(store.entry_ids())
    return ids, store.get_metas(ids)


def list_entries(store: ReuseStore | None, offset: int, limit: int, text: str) -> dict[str, Any]:
    """One page of entries, newest first, whose prompt contains every word of `text` (any case)."""
    terms = text.lower().split()
    matching: list[tuple[str, EntryMeta]] = []
    if store is not None:
        ids, metas = _readable(store)
        matching = [(entry, meta) for entry, meta in zip(ids, metas, strict=True)
                    if meta is not None and all(term in meta.prompt.lower() for term in terms)][::-1]
    page = matching[offset:offset + limit]
    stats = store.stats_many([entry for entry, _ in page]) if page else []
    return {"entries": [_summary(entry, meta, s) for (entry, meta), s in zip(page, stats, strict=True)],
            "total": len(matching), "offset": offset, "limit": limit, "q": text,
            "store": store.directory if store is not None else None}


def store_totals(store: ReuseStore | None) -> dict[str, Any]:
    """Totals for the panel: entries, bytes, hits, time saved and the hit rate of recorded requests.

    The hit rate is the share of recorded requests that themselves reused a donor (their lineage
    names one); `hits` counts how often entries served as donors.
    """
    if store is None:
        return {"store": None, "entries": 0, "bytes": 0, "disk_bytes": 0, "size_limit": None, "hits": 0,
                "seconds_saved": 0.0, "pinned": 0, "reused": 0, "hit_rate": None}
    ids, metas = _readable(store)
    live = [(entry, meta) for entry, meta in zip(ids, metas, strict=True) if meta is not None]
    stats = [s or EntryStats() for s in store.stats_many([entry for entry, _ in live])]
    reused = sum(1 for _, meta in live if meta.lineage.get("donor_id"))
    return {"store": store.directory, "entries": len(live), "bytes": store.used_bytes(), "disk_bytes": store.volume(),
            "size_limit": store.size_limit, "hits": sum(s.hits for s in stats),
            "seconds_saved": sum(s.seconds_saved for s in stats), "pinned": sum(1 for s in stats if s.pinned),
            "reused": reused, "hit_rate": reused / len(live) if live else None}


def thumbnail(store: ReuseStore | None, entry: str) -> bytes:
    """The entry's PNG preview, or ApiError 404."""
    png = store.get_blob(entry, "thumb") if store is not None else None
    if png is None:
        exists = store is not None and store.get_meta(entry) is not None
        raise ApiError(404, f"entry {entry} has no thumbnail" if exists else f"no entry {entry}")
    return png


# ------------------------------------------------------------------ changing
@_changes
def set_pinned(store: ReuseStore | None, entry: str, pinned: bool) -> dict[str, Any]:
    if store is None or not store.set_pinned(entry, pinned):
        raise ApiError(404, f"no entry {entry}")
    return {"id": entry, "pinned": pinned}


@_changes
def delete_entry(store: ReuseStore | None, entry: str) -> dict[str, Any]:
    if store is None or not store.delete(entry):
        raise ApiError(404, f"no entry {entry}")
    return {"id": entry, "deleted": True}


@_changes
def clear_store(store: ReuseStore | None, confirm: Any) -> dict[str, Any]:
    """Delete every entry; refused unless the request confirms it explicitly (`confirm=true`)."""
    if confirm is None or not flag_param(confirm, "confirm"):
        raise ApiError(400, "clearing the store deletes every entry: repeat the request with confirm=true")
    if store is None:
        return {"deleted": 0}
    count = sum(1 for _ in store.entry_ids())
    store.clear()
    return {"deleted": count}

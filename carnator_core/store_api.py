"""What the `/carnator/store/...` HTTP routes do, without the web framework: validation, listing, actions.

The routes are reachable by any page the user's browser opens, so everything that comes from a
request is checked here before it touches the store: entry ids must be the 32-hex-digit uuids the
store writes (no path can be smuggled into a key), page sizes and search texts are bounded, and
state-changing requests from another origin are refused. Errors are `ApiError`s that carry an HTTP
status and a message meant for the user; the route layer turns them into JSON.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

from carnator_core.store import EntryStats, ReuseStore, StoreError, open_store, resolve_store_directory

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
def select_store(user_path: str, base_directory: str, default_directory: str) -> ReuseStore | None:
    """The store a request names (the `store` parameter, same rule as the Carnator Store node).

    A store that does not exist yet is None, an empty store to the caller: no request creates
    directories on the server (it has no entries to list, pin or delete anyway).
    """
    if len(user_path) > 4096:
        raise ApiError(400, "store path too long")
    try:
        directory = resolve_store_directory(user_path, base_directory, default_directory)
    except StoreError as error:
        raise ApiError(400, str(error)) from None
    if not os.path.isfile(os.path.join(directory, "cache.db")):
        if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
            raise ApiError(409, f"{directory} is not a Carnator store")
        return None
    try:
        return open_store(directory)
    except StoreError as error:
        raise ApiError(409, str(error)) from None


# ------------------------------------------------------------------ reading
def entry_summary(store: ReuseStore, entry: str) -> dict[str, Any] | None:
    """What the store panel shows of one entry; None when it is gone or unreadable."""
    meta = store.get_meta(entry)
    if meta is None:
        return None
    stats = store.stats(entry) or EntryStats()
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


def _matches(prompt: str, terms: list[str]) -> bool:
    text = prompt.lower()
    return all(term in text for term in terms)


def list_entries(store: ReuseStore | None, offset: int, limit: int, text: str) -> dict[str, Any]:
    """One page of entries, newest first, whose prompt contains every word of `text` (any case)."""
    terms = text.lower().split()
    page: list[dict[str, Any]] = []
    total = 0
    for entry in reversed(list(store.entry_ids()) if store is not None else []):
        summary = entry_summary(store, entry)
        if summary is None or not _matches(summary["prompt"], terms):
            continue
        if offset <= total < offset + limit:
            page.append(summary)
        total += 1
    return {"entries": page, "total": total, "offset": offset, "limit": limit, "q": text,
            "store": store.directory if store is not None else None}


def store_totals(store: ReuseStore | None) -> dict[str, Any]:
    """Totals for the panel: entries, bytes, hits, time saved and the hit rate of recorded requests.

    The hit rate is the share of recorded requests that themselves reused a donor (their lineage
    names one); `hits` counts how often entries served as donors.
    """
    if store is None:
        return {"store": None, "entries": 0, "bytes": 0, "disk_bytes": 0, "size_limit": None, "hits": 0,
                "seconds_saved": 0.0, "pinned": 0, "reused": 0, "hit_rate": None}
    entries = hits = pinned = reused = 0
    saved = 0.0
    for entry in store.entry_ids():
        meta = store.get_meta(entry)
        if meta is None:
            continue
        stats = store.stats(entry) or EntryStats()
        entries += 1
        hits += stats.hits
        saved += stats.seconds_saved
        pinned += stats.pinned
        reused += bool(meta.lineage.get("donor_id"))
    return {"store": store.directory, "entries": entries, "bytes": store.used_bytes(), "disk_bytes": store.volume(),
            "size_limit": store.size_limit, "hits": hits, "seconds_saved": saved, "pinned": pinned,
            "reused": reused, "hit_rate": reused / entries if entries else None}


def thumbnail(store: ReuseStore | None, entry: str) -> bytes:
    """The entry's PNG preview, or ApiError 404."""
    png = store.get_blob(entry, "thumb") if store is not None else None
    if png is None:
        raise ApiError(404, f"entry {entry} has no thumbnail" if _exists(store, entry) else f"no entry {entry}")
    return png


def _exists(store: ReuseStore | None, entry: str) -> bool:
    return store is not None and store.get_meta(entry) is not None


# ------------------------------------------------------------------ changing
def set_pinned(store: ReuseStore | None, entry: str, pinned: bool) -> dict[str, Any]:
    if store is None or not store.set_pinned(entry, pinned):
        raise ApiError(404, f"no entry {entry}")
    return {"id": entry, "pinned": pinned}


def delete_entry(store: ReuseStore | None, entry: str) -> dict[str, Any]:
    if store is None or not store.delete(entry):
        raise ApiError(404, f"no entry {entry}")
    return {"id": entry, "deleted": True}


def clear_store(store: ReuseStore | None, confirm: Any) -> dict[str, Any]:
    """Delete every entry; refused unless the request confirms it explicitly (`confirm=true`)."""
    if confirm is None or not flag_param(confirm, "confirm"):
        raise ApiError(400, "clearing the store deletes every entry: repeat the request with confirm=true")
    if store is None:
        return {"deleted": 0}
    count = sum(1 for _ in store.entry_ids())
    store.clear()
    return {"deleted": count}

"""Where a store lives: the directory or Redis URL a workflow names, checked against the server's policy.

Workflows are shared files, so a store path must stay inside the ComfyUI base directory and a Redis
URL must name this machine or the configured fleet store, unless the operator allows more. Every
process keeps one store object per location, so all nodes share its connections and index.
"""

from __future__ import annotations

import ipaddress
import os
import threading

from carnator_core import process_state
from carnator_core.store.backend import StoreError, is_store_url
from carnator_core.store.redis_backend import parse_redis_url
from carnator_core.store.reuse_store import DEFAULT_SIZE_LIMIT, ReuseStore

ALLOW_OUTSIDE_ENV = "CARNATOR_ALLOW_STORE_OUTSIDE_BASE"
_open_stores_lock = threading.Lock()


class OpenStores(dict[str, ReuseStore]):
    """The stores this process opened through `open_store`, by `store_key`; `close` (`process_state.reset`) closes
    every one."""

    def close(self) -> None:
        for store in self.values():
            store.close()


def _open_stores() -> OpenStores:
    return process_state.one("open stores", OpenStores)


def _allow_outside(allow_outside: bool | None) -> bool:
    if allow_outside is None:
        return os.environ.get(ALLOW_OUTSIDE_ENV, "").strip().lower() in ("1", "true", "yes")
    return allow_outside


def resolve_store_directory(user_path: str, base_directory: str, default_directory: str,
                            allow_outside: bool | None = None) -> str:
    """Absolute store directory for a user-given path.

    Empty means the default (ComfyUI's user directory). Relative paths are taken from the
    ComfyUI base directory, and the result must stay inside it — workflows are shared files,
    and one must not be able to point a server's store at an arbitrary directory — unless the
    operator sets `CARNATOR_ALLOW_STORE_OUTSIDE_BASE=1`.
    """
    if not user_path.strip():
        return os.path.realpath(default_directory)
    if "\0" in user_path:
        raise StoreError(f"store path {user_path!r} contains a NUL character; no file name can")
    base = os.path.realpath(base_directory)
    candidate = os.path.realpath(os.path.join(base, os.path.expanduser(user_path.strip())))
    if not _allow_outside(allow_outside) and os.path.commonpath([base, candidate]) != base:
        raise StoreError(f"store path {user_path!r} resolves to {candidate}, outside the ComfyUI base directory "
                         f"{base}; use a path inside it or set {ALLOW_OUTSIDE_ENV}=1 on the server")
    return candidate


def host_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address a host name spells (brackets and IPv4-mapped IPv6 undone), or None for a name."""
    try:
        address = ipaddress.ip_address(text.strip().strip("[]"))
    except ValueError:
        return None
    return getattr(address, "ipv4_mapped", None) or address


def is_loopback_host(host: str) -> bool:
    """Whether a host name or address names this machine: `localhost` (any case) or a loopback address
    (127.0.0.0/8, ::1, bracketed or IPv4-mapped). The one such test of the pack."""
    if host.strip().lower() == "localhost":
        return True
    address = host_address(host)
    return address is not None and address.is_loopback


def resolve_store_location(user_path: str, base_directory: str, default_location: str,
                           configured_url: str | None = None, allow_outside: bool | None = None) -> str:
    """A store directory or Redis URL for what a workflow names (empty: `default_location`).

    Directories follow `resolve_store_directory`. A workflow may name a Redis server on this
    machine or the server the operator configured (`configured_url`); any other host needs
    `CARNATOR_ALLOW_STORE_OUTSIDE_BASE=1`, so a shared workflow cannot make a worker talk to
    arbitrary servers of its network.
    """
    text = user_path.strip()
    if not text:
        return default_location
    if not is_store_url(text):
        return resolve_store_directory(text, base_directory, default_location, allow_outside)
    location = parse_redis_url(text)
    configured = parse_redis_url(configured_url) if configured_url else None
    known = configured is not None and (configured.host, configured.port) == (location.host, location.port)
    if not (is_loopback_host(location.host) or known or _allow_outside(allow_outside)):
        raise StoreError(f"store URL {location.public_url} names a server other than this machine and the "
                         f"configured store; set {ALLOW_OUTSIDE_ENV}=1 on the server to allow it")
    if configured is not None and location.public_url == configured.public_url and location.password is None:
        return configured_url  # a workflow (or report) names the configured store without its credentials
    return text


def store_key(location: str) -> str:
    """The registry name of a location: the absolute directory, or the URL without credentials and options."""
    return parse_redis_url(location).public_url if is_store_url(location) else os.path.abspath(location)


def opened_stores() -> dict[str, ReuseStore]:
    """Every store this process opened through `open_store`, by `store_key`: a snapshot taken without the lock, which
    `open_store` holds while it connects, so a caller (an HTTP route) never waits on a store being opened."""
    return dict(_open_stores())


def open_store(location: str, size_limit: int | None = None, blob_cache_root: str | None = None) -> ReuseStore:
    """The process-wide store object of a directory or Redis URL (one connection set per process).

    `size_limit=None` keeps the limit the store was opened with (default for a new one).
    """
    key = store_key(location)
    with _open_stores_lock:
        stores = _open_stores()
        store = stores.get(key)
        if store is None:
            store = stores[key] = ReuseStore(location, size_limit or DEFAULT_SIZE_LIMIT, blob_cache_root)
        elif size_limit is not None:
            store.size_limit = int(size_limit)
        return store

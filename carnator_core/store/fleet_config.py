"""Which store a worker uses when a workflow names none, and the namespace that bounds its scopes: the deployment's
configured fleet store.

API-queue deployments set the shared Redis store once per worker instead of in every
workflow: the environment variable `CARNATOR_STORE_URL`, else `"store_url"` in the JSON
settings file `<ComfyUI user directory>/carnator/settings.json`. Neither set: the local
diskcache directory. A configured URL that does not parse is an error at once (at start-up
and at every node that would use it), never a silent fallback to the local store. The namespace
(`CARNATOR_NAMESPACE`, else `"namespace"` in the same file) bounds every scope of the worker
(`carnator_core.store.scopes`); one outside the safe set is refused at start-up.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from carnator_core.store.backend import StoreError
from carnator_core.store.redis_backend import parse_redis_url
from carnator_core.store.scopes import checked_namespace

STORE_URL_ENV = "CARNATOR_STORE_URL"
NAMESPACE_ENV = "CARNATOR_NAMESPACE"
SETTINGS_FILE = "settings.json"


def _setting(settings_path: str, environ: Mapping[str, str], variable: str, name: str) -> tuple[str, str]:
    """A setting from the environment variable, else from the settings file, and where it came from ("" if unset)."""
    value = environ.get(variable, "").strip()
    if value or not os.path.isfile(settings_path):
        return value, variable
    try:
        with open(settings_path, encoding="utf-8") as file:
            settings = json.load(file)
    except (OSError, ValueError) as error:
        raise StoreError(f"Carnator settings file {settings_path} is unreadable: {error}") from None
    value = settings.get(name, "") if isinstance(settings, dict) else None
    if not isinstance(value, str):
        raise StoreError(f"Carnator settings file {settings_path}: \"{name}\" must be a string")
    return value.strip(), settings_path


def configured_namespace(settings_path: str, environ: Mapping[str, str] = os.environ) -> str:
    """The configured namespace, checked (`scopes.checked_namespace`: ScopeError names the bad one); "" if none."""
    namespace, source = _setting(settings_path, environ, NAMESPACE_ENV, "namespace")
    return checked_namespace(namespace, source)


def configured_store_url(settings_path: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """The configured store URL, validated; None when the deployment configures none."""
    url, source = _setting(settings_path, environ, STORE_URL_ENV, "store_url")
    if not url:
        return None
    try:
        parse_redis_url(url)
    except StoreError as error:
        raise StoreError(f"store configured in {source}: {error}") from None
    return url

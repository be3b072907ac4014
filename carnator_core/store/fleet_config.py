"""Which store a worker uses when a workflow names none: the deployment's configured fleet store.

API-queue deployments set the shared Redis store once per worker instead of in every
workflow: the environment variable `CARNATOR_STORE_URL`, else `"store_url"` in the JSON
settings file `<ComfyUI user directory>/carnator/settings.json`. Neither set: the local
diskcache directory. A configured URL that does not parse is an error at once (at start-up
and at every node that would use it), never a silent fallback to the local store.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from carnator_core.store.backend import StoreError
from carnator_core.store.redis_backend import parse_redis_url

STORE_URL_ENV = "CARNATOR_STORE_URL"
SETTINGS_FILE = "settings.json"


def configured_store_url(settings_path: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """The configured store URL, validated; None when the deployment configures none."""
    url = environ.get(STORE_URL_ENV, "").strip()
    source = STORE_URL_ENV
    if not url and os.path.isfile(settings_path):
        try:
            with open(settings_path, encoding="utf-8") as file:
                settings = json.load(file)
        except (OSError, ValueError) as error:
            raise StoreError(f"Carnator settings file {settings_path} is unreadable: {error}") from None
        value = settings.get("store_url", "") if isinstance(settings, dict) else None
        if not isinstance(value, str):
            raise StoreError(f"Carnator settings file {settings_path}: \"store_url\" must be a string")
        url, source = value.strip(), settings_path
    if not url:
        return None
    try:
        parse_redis_url(url)
    except StoreError as error:
        raise StoreError(f"store configured in {source}: {error}") from None
    return url

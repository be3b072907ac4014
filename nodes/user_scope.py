"""Whose work a sampling run and a store request are (`carnator_core.store.scopes`), read from ComfyUI.

Under `--multi-user`, ComfyUI names the user of a request by its `comfy-user` header and checks it against its users
(`user_manager.get_request_user_id`: an unknown or system user is refused). ComfyUI keeps no user with a queued prompt,
so Carnator reads it where the prompt is posted: a middleware notes the poster of each POST /prompt, and an on-prompt
handler writes the scope (or why there is none) into the prompt's `extra_data`, replacing whatever the client put
there; a sampling run reads it from the prompt ComfyUI is executing. Without `--multi-user` every run and request is
the single-user scope (bounded by the fleet's namespace where one is configured).
"""

from __future__ import annotations

import contextvars
import logging
import os
import weakref
from typing import Any

import folder_paths
from aiohttp import web

from carnator_core import process_state
from carnator_core.store.fleet_config import SETTINGS_FILE, configured_namespace
from carnator_core.store.http_api import ApiError
from carnator_core.store.scopes import UNKNOWN_USER, scope_for

from .host import prompt_server

log = logging.getLogger("carnator")

SCOPE_KEY = "carnator_scope"  # the prompt's extra_data key: {"scope": ...} or {"refused": why}
_posted_by: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("carnator_posted_by", default=None)


def namespace() -> str:
    """The fleet's configured namespace ("" where none); ScopeError where it is outside the safe set."""
    return configured_namespace(os.path.join(folder_paths.get_user_directory(), "carnator", SETTINGS_FILE))


def multi_user() -> bool:
    from comfy.cli_args import args

    return bool(getattr(args, "multi_user", False))


def _user_scope(request: web.Request) -> dict[str, str]:
    """{"scope": ...} for the request's user, or {"refused": why}."""
    if not multi_user():
        return {"scope": scope_for(namespace(), None)}
    try:
        user = prompt_server().user_manager.get_request_user_id(request)
    except (KeyError, AttributeError):
        return {"refused": UNKNOWN_USER}
    return {"scope": scope_for(namespace(), user)}


def request_scope(request: web.Request) -> str:
    """The scope a store route answers for; ApiError 403 for an unknown or system user (and no data)."""
    scoped = _user_scope(request)
    if "refused" in scoped:
        raise ApiError(403, "unknown user")
    return scoped["scope"]


@web.middleware
async def note_poster(request: web.Request, handler):
    """Note who posts a prompt, for `tag_queued_prompt` (which ComfyUI calls while handling the same request)."""
    if request.method != "POST" or request.path.rstrip("/") not in ("/prompt", "/api/prompt"):
        return await handler(request)
    token = _posted_by.set(_user_scope(request))
    try:
        return await handler(request)
    finally:
        _posted_by.reset(token)


def tag_queued_prompt(json_data: Any) -> Any:
    """The on-prompt handler: the poster's scope into the prompt's extra_data, whatever the client sent there."""
    if isinstance(json_data, dict):
        extra = json_data.get("extra_data")
        if not isinstance(extra, dict):
            extra = json_data["extra_data"] = {}
        extra.pop(SCOPE_KEY, None)
        posted = _posted_by.get()
        if posted is not None:
            extra[SCOPE_KEY] = dict(posted)
    return json_data


def run_scope() -> tuple[str, str]:
    """(the executing prompt's scope, why reuse is refused: "" where it is not)."""
    if not multi_user():
        return scope_for(namespace(), None), ""
    from comfy_execution.utils import get_executing_context

    context = get_executing_context()
    server = prompt_server()
    running = getattr(getattr(server, "prompt_queue", None), "currently_running", {}) or {}
    for item in list(running.values()):
        if context is not None and len(item) > 3 and item[1] == context.prompt_id and isinstance(item[3], dict):
            tagged = item[3].get(SCOPE_KEY)
            if isinstance(tagged, dict) and isinstance(tagged.get("scope"), str):
                return tagged["scope"], ""
            return "", (tagged or {}).get("refused", UNKNOWN_USER) if isinstance(tagged, dict) else UNKNOWN_USER
    return "", "prompt queued without a known user (--multi-user): sampled without reuse"


def register_scopes() -> None:
    """The middleware and the on-prompt handler on ComfyUI's server, once per server (before its app starts); a
    no-op without a server. A namespace outside the safe set stops the pack here, with the error."""
    namespace()
    server = prompt_server()
    registered: weakref.WeakSet = process_state.one("servers with Carnator scopes", weakref.WeakSet)
    if server is None or server in registered or not hasattr(server, "add_on_prompt_handler"):
        return
    registered.add(server)
    app = getattr(server, "app", None)
    if app is not None and not app.frozen:
        app.middlewares.append(note_poster)
    elif multi_user():
        log.error("Carnator: the server started before the pack loaded; under --multi-user every prompt samples "
                  "without reuse")
    server.add_on_prompt_handler(tag_queued_prompt)

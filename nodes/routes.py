"""HTTP routes of the store panel, `/carnator/store/...` (and `/api/carnator/store/...`), on ComfyUI's server.

Thin: every check and every store operation is `carnator_core.store.http_api`; this module binds them to
aiohttp, runs store work off the event loop, and turns refusals into JSON errors. `store` is the id (or
name) of one of the stores the server serves, as `/stores` lists them; empty: the default store.

    GET    /carnator/store/stores                         the stores the panel may choose from
    GET    /carnator/store/entries?offset&limit&q&store   one page of entries, newest first
    GET    /carnator/store/stats?store                    totals and hit rate
    GET    /carnator/store/entries/{id}/thumbnail?store   PNG preview
    POST   /carnator/store/entries/{id}/pin?store         body {"pinned": true|false}
    DELETE /carnator/store/entries/{id}?store
    POST   /carnator/store/clear?confirm=true&store
    GET    /carnator/store/profiles?store                 calibration profiles, whole (export), and refused ones
    POST   /carnator/store/profiles?store                 body: a profile.json (import)
    DELETE /carnator/store/profiles/{model}/{schedule}?store
    GET    /carnator/calibration                          the Calibrate node's background calibration, where it stands
    POST   /carnator/calibration/stop                     stop it after its current run
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import weakref
from collections.abc import Awaitable, Callable

from aiohttp import web
from comfy.cli_args import args as comfy_args

from carnator_core import process_state
from carnator_core.store import http_api as store_api
from carnator_core.store.http_api import ApiError

from .calibrate_node import calibration
from .host import prompt_server, store_location
from .user_scope import request_scope

log = logging.getLogger("carnator")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_MAX_BODY = 64 * 1024


def _served_stores() -> store_api.ServedStores:
    """The stores the routes serve (`process_state`)."""
    return process_state.one("served stores", lambda: store_api.ServedStores(store_location))


def _json_errors(handler: Handler) -> Handler:
    """Refusals become `{"error": message}` with their status; anything unexpected a logged 500, no trace."""

    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as error:
            return web.json_response({"error": error.message}, status=error.status)
        except Exception:
            log.exception("Carnator: %s %s failed", request.method, request.path)
            return web.json_response({"error": "internal error (see the ComfyUI log)"}, status=500)

    return wrapped


def _local_address(request: web.Request) -> str | None:
    """The address of this machine the request's connection reached."""
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    return sockname[0] if isinstance(sockname, tuple) else None


def _same_origin(request: web.Request) -> None:
    reason = store_api.refused_origin(request.headers, request.scheme, comfy_args.listen.split(","),
                                      _local_address(request))
    if reason:
        log.warning("Carnator: %s %s: %s", request.method, request.path, reason)
        raise ApiError(403, reason)


async def _json_body(request: web.Request) -> dict:
    if request.content_length is not None and request.content_length > _MAX_BODY:
        raise ApiError(413, "request body too large")
    raw = await request.content.read(_MAX_BODY + 1)
    if len(raw) > _MAX_BODY:
        raise ApiError(413, "request body too large")
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise ApiError(400, "request body is not JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


async def _in_store(request: web.Request, work: Callable, *args):
    """Run `work(store, scope, *args)` in a worker thread on the store the request picks (store calls block), for the
    caller's scope (an unknown user: 403, before any store is read)."""
    scope = request_scope(request)
    requested = request.query.get("store", "")
    return await asyncio.to_thread(lambda: work(_served_stores().select(requested), scope, *args))


@_json_errors
async def stores(request: web.Request) -> web.Response:
    request_scope(request)
    return web.json_response(await asyncio.to_thread(_served_stores().listing))


@_json_errors
async def list_entries(request: web.Request) -> web.Response:
    offset, limit, text = store_api.page_params(request.query)
    return web.json_response(await _in_store(request, store_api.list_entries, offset, limit, text))


@_json_errors
async def stats(request: web.Request) -> web.Response:
    return web.json_response(await _in_store(request, store_api.store_totals))


@_json_errors
async def thumbnail(request: web.Request) -> web.Response:
    entry = store_api.entry_id(request.match_info["entry_id"])
    png = await _in_store(request, store_api.thumbnail, entry)
    return web.Response(body=png, content_type="image/png", headers={"Cache-Control": "private, max-age=3600"})


@_json_errors
async def pin(request: web.Request) -> web.Response:
    _same_origin(request)
    entry = store_api.entry_id(request.match_info["entry_id"])
    pinned = store_api.flag_param((await _json_body(request)).get("pinned"), "pinned")
    return web.json_response(await _in_store(request, store_api.set_pinned, entry, pinned))


@_json_errors
async def delete(request: web.Request) -> web.Response:
    _same_origin(request)
    entry = store_api.entry_id(request.match_info["entry_id"])
    return web.json_response(await _in_store(request, store_api.delete_entry, entry))


@_json_errors
async def clear(request: web.Request) -> web.Response:
    _same_origin(request)
    confirm = request.query.get("confirm", (await _json_body(request)).get("confirm"))
    return web.json_response(await _in_store(request, store_api.clear_store, confirm))


@_json_errors
async def profiles(request: web.Request) -> web.Response:
    return web.json_response(await _in_store(request, store_api.list_profiles))


@_json_errors
async def import_profile(request: web.Request) -> web.Response:
    _same_origin(request)
    return web.json_response(await _in_store(request, store_api.import_profile, await _json_body(request)))


@_json_errors
async def delete_profile(request: web.Request) -> web.Response:
    _same_origin(request)
    model = store_api.fingerprint(request.match_info["model"], "model")
    schedule = store_api.fingerprint(request.match_info["schedule"], "schedule")
    return web.json_response(await _in_store(request, store_api.remove_profile, model, schedule))


@_json_errors
async def calibration_state(request: web.Request) -> web.Response:
    request_scope(request)
    return web.json_response(calibration().state())


@_json_errors
async def stop_calibration(request: web.Request) -> web.Response:
    _same_origin(request)
    request_scope(request)
    return web.json_response(calibration().stop())


def register_routes() -> None:
    """Add the routes to ComfyUI's server, once per server; a no-op when ComfyUI runs without one.

    ComfyUI copies `PromptServer.instance.routes` into its web app (with and without the /api prefix)
    after every pack has loaded, so registering while the pack loads is in time.
    """
    server = prompt_server()
    registered: weakref.WeakSet = process_state.one("servers with the store routes", weakref.WeakSet)
    if server is None or server in registered:
        return
    registered.add(server)
    routes = server.routes
    routes.get("/carnator/store/stores")(stores)
    routes.get("/carnator/store/entries")(list_entries)
    routes.get("/carnator/store/stats")(stats)
    routes.get("/carnator/store/entries/{entry_id}/thumbnail")(thumbnail)
    routes.post("/carnator/store/entries/{entry_id}/pin")(pin)
    routes.delete("/carnator/store/entries/{entry_id}")(delete)
    routes.post("/carnator/store/clear")(clear)
    routes.get("/carnator/store/profiles")(profiles)
    routes.post("/carnator/store/profiles")(import_profile)
    routes.delete("/carnator/store/profiles/{model}/{schedule}")(delete_profile)
    routes.get("/carnator/calibration")(calibration_state)
    routes.post("/carnator/calibration/stop")(stop_calibration)

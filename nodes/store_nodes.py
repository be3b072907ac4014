"""Nodes that open the reuse store and show what it holds."""

from __future__ import annotations

import json
import logging
import math

from comfy_api.latest import io

from carnator_core.store.backend import StoreError
from carnator_core.store.http_api import store_totals
from carnator_core.store.reuse_store import DEFAULT_SIZE_LIMIT

from .host import configured_store, store_at
from .types import StoreType
from .user_scope import run_scope

_GIB = 2**30
log = logging.getLogger("carnator")


def check_configured_store() -> None:
    """At start-up: open the configured fleet store, so a bad URL, password or schema shows in the log at once."""
    try:
        url = configured_store()
        if url is not None:
            store = store_at()
            log.info("Carnator: using the configured store %s%s", store.location,
                     f" (unavailable for now: {store.unavailable})" if store.unavailable else "")
    except StoreError as error:
        log.error("Carnator: the configured store cannot be used; Carnator nodes will fail until it is fixed: %s",
                  error)


check_configured_store()


class CarnatorStore(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorStore",
            display_name="Carnator Store",
            category="Carnator/store",
            description="Opens the persistent reuse store that Carnator nodes read donors from and record into. "
                        "Without this node, Carnator uses the default store in ComfyUI's user directory.",
            inputs=[
                io.String.Input("path", default="", tooltip="Store directory, or redis://host:port/db for a store "
                                "shared by several workers. Empty: the server's configured store "
                                "(CARNATOR_STORE_URL), else <user dir>/carnator/store. Relative paths start at the "
                                "ComfyUI base directory and must stay inside it; Redis URLs must name this machine "
                                "or the configured server (the server may allow others with "
                                "CARNATOR_ALLOW_STORE_OUTSIDE_BASE=1)."),
                io.Float.Input("size_limit_gb", default=DEFAULT_SIZE_LIMIT / _GIB, min=0.01, max=100000.0, step=0.5,
                               tooltip="Bound on the store's size; the least valuable entries (hits x saved "
                                       "time / bytes, then oldest) are evicted beyond it. Pinned entries stay."),
            ],
            outputs=[StoreType.Output(display_name="store")],
        )

    @classmethod
    def execute(cls, path: str, size_limit_gb: float) -> io.NodeOutput:
        if not math.isfinite(size_limit_gb) or size_limit_gb <= 0:  # NaN passes the input's min/max checks
            raise ValueError(f"Carnator Store: size_limit_gb must be a positive number of GiB, got {size_limit_gb}")
        try:
            store = store_at(path, int(size_limit_gb * _GIB))
        except StoreError as error:
            raise ValueError(f"Carnator Store: {error}") from error
        return io.NodeOutput(store)


class CarnatorStoreInfo(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorStoreInfo",
            display_name="Carnator Store Info",
            category="Carnator/store",
            description="Shows how many entries the store holds, its size and how often entries were reused.",
            is_output_node=True,
            not_idempotent=True,
            inputs=[StoreType.Input("store", optional=True,
                                    tooltip="Store to describe; the default store when not connected.")],
            outputs=[io.String.Output(display_name="summary")],
        )

    @classmethod
    def execute(cls, store=None) -> io.NodeOutput:
        try:
            store = store if store is not None else store_at()
        except StoreError as error:
            raise ValueError(f"Carnator Store Info: {error}") from error
        scope, refusal = run_scope()
        if refusal:
            raise ValueError(f"Carnator Store Info: {refusal}")
        totals = store.totals() if not scope else store_totals(store, scope)  # a named scope: its own entries
        storage = "" if totals["disk_bytes"] is None else f" (storage uses {totals['disk_bytes'] / 2**20:.1f} MiB)"
        summary = (f"Carnator store {store.location}\n"
                   f"entries: {totals['entries']}\n"
                   f"size: {totals['bytes'] / 2**20:.1f} MiB of {totals['size_limit'] / 2**30:.1f} GiB{storage}\n"
                   f"hits: {totals['hits']}, time saved: {totals['seconds_saved']:.1f} s")
        if store.unavailable:
            summary += f"\nunavailable: {store.unavailable}"
        info = {**totals, "store": store.location}  # the location names the store in the /carnator/store routes
        return io.NodeOutput(summary, ui={"text": [summary], "carnator_store": [json.dumps(info)]})


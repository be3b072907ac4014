"""Fixtures shared by the server tests: the module's headless server and its default store."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.comfy_host import ComfyServer

from carnator_core.store.reuse_store import ReuseStore


@pytest.fixture(scope="module")
def server(comfy_server: ComfyServer) -> ComfyServer:
    return comfy_server


@pytest.fixture
def store(server: ComfyServer) -> Iterator[ReuseStore]:
    """The server's default store, emptied after the test."""
    store = ReuseStore(str(server.base_dir / "user" / "carnator" / "store"))
    try:
        yield store
    finally:
        store.clear()
        store.close()

"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from carnator_core.store.reuse_store import ReuseStore


@pytest.fixture
def store(tmp_path) -> Iterator[ReuseStore]:
    """An empty local store of the test's own."""
    store = ReuseStore(str(tmp_path / "store"))
    try:
        yield store
    finally:
        store.close()

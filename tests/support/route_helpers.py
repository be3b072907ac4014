"""Helpers of the store-route tests: entries written like the recorder writes them, stores opened inside the
server by a Carnator Store node, JSON answers checked, a store's state captured, a store made read-only."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import requests
import torch

from carnator_core.store.entry import EntryMeta, HardKey
from carnator_core.store.reuse_store import IndexVectors, ReuseStore
from carnator_core.store.tensor_codec import encode_tensors
from carnator_core.store.thumbnail import preview_png
from support.comfy_host import ComfyServer


def add_entry(store: ReuseStore, prompt: str, *, thumb: bool = True, donor: str | None = None) -> str:
    """Write an entry like the recorder does (a checkpoint blob, a thumbnail, lineage when it reused one)."""
    meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=HardKey("model", (2, 4, 4), "schedule"), prompt=prompt,
                     total_steps=8, sample_seconds=3.0, lineage={"donor_id": donor, "depth": 4} if donor else {})
    blobs = {"checkpoints": encode_tensors({"x_2": torch.randn(1, 16, 2, 8, 8).half()})}
    vectors = IndexVectors(text=None, cond=torch.nn.functional.normalize(torch.randn(64), dim=0))
    if thumb:
        blobs["thumb"] = preview_png(torch.randn(16, 8, 8), [[0.1, 0.2, 0.3]] * 16)
    store.put(meta, blobs, vectors)
    return meta.entry_id


def json_answer(response: requests.Response) -> dict:
    """The JSON body of a route's answer; never a stack trace."""
    assert response.headers["Content-Type"].startswith("application/json"), (response.status_code, response.text[:200])
    assert "Traceback" not in response.text
    return response.json()


def delete(server: ComfyServer, path: str, **kwargs) -> requests.Response:
    return requests.delete(f"{server.url}{path}", timeout=kwargs.pop("timeout", 30), **kwargs)


def open_in_server(server: ComfyServer, path: str) -> dict:
    """Open the store `path` in the server as a workflow does (Carnator Store → Store Info); its /stores row."""
    server.client.run({"1": {"class_type": "CarnatorStore", "inputs": {"path": path, "size_limit_gb": 1.0}},
                       "2": {"class_type": "CarnatorStoreInfo", "inputs": {"store": ["1", 0]}}}, timeout=300)
    rows = json_answer(server.get("/carnator/store/stores"))["stores"]
    opened = [row for row in rows if row["name"] in (path, os.path.realpath(server.base_dir / path))]
    assert len(opened) == 1, (path, rows)
    return opened[0]


def state(store: ReuseStore) -> list[tuple[str, bool]]:
    """What a refused request must leave alone: the live entries and their pins."""
    ids = list(store.entry_ids())
    return [(entry, bool(stats and stats.pinned)) for entry, stats in zip(ids, store.stats_many(ids), strict=True)]


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """The directory and its files become unwritable for connections opened meanwhile; root ignores permission
    bits, so there it is made immutable instead (as a read-only mount would)."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-R", "+i", str(directory)], check=True)
        undo = ["chattr", "-R", "-i", str(directory)]
    else:
        subprocess.run(["chmod", "-R", "a-w", str(directory)], check=True)
        undo = ["chmod", "-R", "u+w", str(directory)]
    try:
        yield
    finally:
        subprocess.run(undo, check=True)

"""The store panel's HTTP routes on a real headless ComfyUI server: listing, paging, search, thumbnails,
pin, delete, clear, and every kind of bad input (ids, paths, parameters, bodies, foreign origins).

Entries are written straight into the server's default store (`<base>/user/carnator/store`) by this
process, as a second ComfyUI process sharing the store would; each test writes its own and cleans up.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import requests
import torch
from comfy_host import ComfyServer, free_port

from carnator_core.entry import EntryMeta, HardKey
from carnator_core.store import IndexVectors, ReuseStore
from carnator_core.store_api import cross_origin
from carnator_core.tensor_codec import encode_tensors
from carnator_core.thumbnail import preview_png

pytestmark = pytest.mark.server

BAD_IDS = ["abc", "0" * 31, "0" * 33, "A" * 32, "g" * 32, "%2e%2e%2f%2e%2e%2fcache.db", "..%2Fcache.db",
           "%2e%2e", "0" * 32 + "%00", "0" * 32 + ".png"]
MISSING_ID = "0123456789abcdef0123456789abcdef"


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


def _add(store: ReuseStore, prompt: str, *, thumb: bool = True, donor: str | None = None) -> str:
    """Write an entry like the recorder does (a checkpoint blob, a thumbnail, lineage when it reused one)."""
    meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=HardKey("model", (2, 4, 4), "schedule"), prompt=prompt,
                     total_steps=8, sample_seconds=3.0, lineage={"donor_id": donor, "depth": 4} if donor else {})
    blobs = {"checkpoints": encode_tensors({"x_2": torch.randn(1, 16, 2, 8, 8).half()})}
    vectors = IndexVectors(text=None, cond=torch.nn.functional.normalize(torch.randn(64), dim=0))
    if thumb:
        blobs["thumb"] = preview_png(torch.randn(16, 8, 8), [[0.1, 0.2, 0.3]] * 16)
    store.put(meta, blobs, vectors)
    return meta.entry_id


def _json(response) -> dict:
    assert response.headers["Content-Type"].startswith("application/json"), response.text[:200]
    body = response.json()
    assert "Traceback" not in response.text
    return body


def test_empty_and_missing_stores_list_nothing(server, store):
    for params in ({}, {"store": "user/no_such_store"}):
        listing = _json(server.get("/carnator/store/entries", params=params))
        assert listing["entries"] == [] and listing["total"] == 0
        assert _json(server.get("/carnator/store/stats", params=params))["entries"] == 0
    assert not (server.base_dir / "user" / "no_such_store").exists()  # reading never creates a store


def test_list_pages_newest_first_and_searches_prompt_words(server, store):
    ids = [_add(store, prompt) for prompt in ("A red ball rolls left", "a blue box", "red BALL bouncing", "grey sky")]
    first = _json(server.get("/carnator/store/entries", params={"limit": 2}))
    assert [e["id"] for e in first["entries"]] == ids[::-1][:2] and first["total"] == 4
    second = _json(server.get("/api/carnator/store/entries", params={"limit": 2, "offset": 2}))  # the frontend's path
    assert [e["id"] for e in second["entries"]] == ids[::-1][2:]
    found = _json(server.get("/carnator/store/entries", params={"q": "ball RED"}))
    assert [e["id"] for e in found["entries"]] == [ids[2], ids[0]] and found["total"] == 2
    entry = found["entries"][0]
    assert entry["prompt"] == "red BALL bouncing" and entry["thumbnail"] is True and entry["bytes"] > 0
    assert entry["hits"] == 0 and entry["pinned"] is False and entry["created_at"] > 0


def test_stats_count_entries_bytes_hits_and_hit_rate(server, store):
    donor = _add(store, "a red ball")
    _add(store, "a red ball, rolling", donor=donor)
    store.record_hit(donor, 2.5)
    totals = _json(server.get("/carnator/store/stats"))
    assert totals["entries"] == 2 and totals["bytes"] == store.used_bytes() > 0
    assert totals["hits"] == 1 and totals["seconds_saved"] == pytest.approx(2.5)
    assert totals["reused"] == 1 and totals["hit_rate"] == pytest.approx(0.5)


def test_thumbnail_is_the_stored_png(server, store):
    entry = _add(store, "a red ball")
    response = server.get(f"/carnator/store/entries/{entry}/thumbnail")
    assert response.status_code == 200 and response.headers["Content-Type"] == "image/png"
    assert response.content == store.get_blob(entry, "thumb") and response.content.startswith(b"\x89PNG")
    bare = _add(store, "no preview", thumb=False)
    assert server.get(f"/carnator/store/entries/{bare}/thumbnail").status_code == 404
    missing = server.get(f"/carnator/store/entries/{MISSING_ID}/thumbnail")
    assert missing.status_code == 404 and "error" in _json(missing)


def test_pin_unpin_delete_and_clear(server, store):
    keep, gone = _add(store, "keep me"), _add(store, "delete me")
    assert _json(server.post(f"/carnator/store/entries/{keep}/pin", json={"pinned": True}))["pinned"] is True
    assert store.stats(keep).pinned
    assert server.post(f"/carnator/store/entries/{keep}/pin", json={"pinned": False}).status_code == 200
    assert not store.stats(keep).pinned
    assert _json(requests_delete(server, f"/carnator/store/entries/{gone}"))["deleted"] is True
    assert store.get_meta(gone) is None and store.get_meta(keep) is not None
    assert requests_delete(server, f"/carnator/store/entries/{gone}").status_code == 404
    refused = server.post("/carnator/store/clear")
    assert refused.status_code == 400 and "confirm" in _json(refused)["error"]
    assert server.post("/carnator/store/clear", params={"confirm": "false"}).status_code == 400
    assert list(store.entry_ids()) == [keep]
    assert _json(server.post("/carnator/store/clear", params={"confirm": "true"}))["deleted"] == 1
    assert list(store.entry_ids()) == []


def requests_delete(server: ComfyServer, path: str, **kwargs) -> requests.Response:
    return requests.delete(f"{server.url}{path}", timeout=30, **kwargs)


@pytest.mark.parametrize("bad", BAD_IDS)
def test_bad_ids_are_refused_with_json(server, store, bad):
    entry = _add(store, "must survive")
    for response in (server.get(f"/carnator/store/entries/{bad}/thumbnail"),
                     server.post(f"/carnator/store/entries/{bad}/pin", json={"pinned": True}),
                     requests_delete(server, f"/carnator/store/entries/{bad}")):
        assert response.status_code in (400, 404), (bad, response.status_code, response.text[:200])
        assert not response.content.startswith(b"SQLite")  # never a file from the store directory
        assert response.status_code == 404 or "error" in _json(response)
    assert store.get_meta(entry) is not None


@pytest.mark.parametrize("params", [{"limit": "0"}, {"limit": "101"}, {"limit": "ten"}, {"offset": "-1"},
                                    {"q": "x" * 201}, {"store": "../../outside"}, {"store": "/etc"},
                                    {"store": "redis://192.0.2.1:6379/0"}])  # another machine's Redis
def test_bad_list_parameters_are_400(server, store, params):
    response = server.get("/carnator/store/entries", params=params)
    assert response.status_code == 400 and _json(response)["error"]


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"pinned": "maybe"}', b"{}"])
def test_bad_pin_bodies_are_400(server, store, body):
    entry = _add(store, "a red ball")
    response = server.post(f"/carnator/store/entries/{entry}/pin", data=body,
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and _json(response)["error"]
    assert not store.stats(entry).pinned


def test_a_directory_that_is_not_a_store_is_409(server, store):
    (server.base_dir / "user" / "not_a_store").mkdir(exist_ok=True)
    (server.base_dir / "user" / "not_a_store" / "notes.txt").write_text("mine")
    response = server.get("/carnator/store/entries", params={"store": "user/not_a_store"})
    assert response.status_code == 409 and "not a Carnator store" in _json(response)["error"]


def test_an_unreachable_redis_store_is_503(server, store):
    url = f"redis://127.0.0.1:{free_port()}/0"  # this machine, nothing listening
    for response in (server.get("/carnator/store/entries", params={"store": url}),
                     server.post(f"/carnator/store/entries/{MISSING_ID}/pin", params={"store": url}, json={"pinned": True})):
        assert response.status_code == 503 and "unavailable" in _json(response)["error"]


def test_store_parameter_selects_another_store_inside_the_base_directory(server, store):
    other = ReuseStore(str(server.base_dir / "user" / "other_store"))
    try:
        entry = _add(other, "only in the other store")
        listing = _json(server.get("/carnator/store/entries", params={"store": "user/other_store"}))
        assert [e["id"] for e in listing["entries"]] == [entry]
        assert _json(server.get("/carnator/store/entries"))["total"] == 0
        response = requests_delete(server, f"/carnator/store/entries/{entry}", params={"store": "user/other_store"})
        assert response.status_code == 200 and other.get_meta(entry) is None
    finally:
        other.close()


@pytest.mark.parametrize("headers", [
    {"Origin": "http://evil.example"},  # loopback Host: ComfyUI's own origin middleware answers
    {"Origin": "http://evil.example", "Host": "192.0.2.10:8188"},  # not loopback: Carnator's check answers
    {"Origin": "null", "Host": "192.0.2.10:8188"},
    {"Sec-Fetch-Site": "cross-site"},
])
def test_cross_origin_state_changes_are_refused(server, store, headers):
    entry = _add(store, "a red ball")
    responses = [server.post(f"/carnator/store/entries/{entry}/pin", json={"pinned": True}, headers=headers),
                 requests_delete(server, f"/carnator/store/entries/{entry}", headers=headers),
                 server.post("/carnator/store/clear", params={"confirm": "true"}, headers=headers)]
    assert [r.status_code for r in responses] == [403, 403, 403]
    if "Host" in headers:  # requests ComfyUI's loopback-only middleware lets through: Carnator's check answers
        assert all("refused" in _json(r)["error"] for r in responses)
    for response in responses:  # a cross-site fetch: newer hosts' middleware answers first, with an empty body
        if response.headers.get("Content-Type", "").startswith("application/json"):
            assert "refused" in _json(response)["error"]
    assert store.get_meta(entry) is not None and not store.stats(entry).pinned


def test_same_origin_browser_requests_are_allowed(server, store):
    entry = _add(store, "a red ball")
    headers = {"Origin": server.url, "Sec-Fetch-Site": "same-origin"}
    assert server.post(f"/carnator/store/entries/{entry}/pin", json={"pinned": True}, headers=headers).ok
    assert requests_delete(server, f"/carnator/store/entries/{entry}", headers=headers).ok


@pytest.mark.parametrize(("headers", "refused"), [
    ({}, False),
    ({"Origin": "http://127.0.0.1:8188", "Host": "127.0.0.1:8188"}, False),
    ({"Origin": "http://LOCALHOST", "Host": "localhost:80"}, False),
    ({"Origin": "https://comfy.lan", "Host": "comfy.lan:443"}, False),
    ({"Sec-Fetch-Site": "none"}, False),
    ({"Origin": "http://127.0.0.1:9999", "Host": "127.0.0.1:8188"}, True),
    ({"Origin": "http://127.0.0.1.evil.example:8188", "Host": "127.0.0.1:8188"}, True),
    ({"Origin": "http://comfy.lan", "Host": "comfy.lan:8188"}, True),
    ({"Origin": "http://127.0.0.1:8188"}, True),
    ({"Sec-Fetch-Site": "same-site"}, True),
])
def test_cross_origin_rule(headers, refused):
    assert (cross_origin(headers) is not None) == refused, json.dumps(headers)

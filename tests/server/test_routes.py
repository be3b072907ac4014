"""The store panel's HTTP routes on a real headless ComfyUI server: listing, paging, search, thumbnails,
pin, delete, clear, the stores a request may pick, and every kind of bad input (ids, store names, parameters,
bodies, foreign origins and hosts, read-only, damaged and foreign stores).

Entries are written straight into the server's stores (the default `<base>/user/carnator/store`, or one a
Carnator Store node opened) by this process, as a second ComfyUI process sharing the store would; each test
writes its own and cleans up.
"""

from __future__ import annotations

import json
import os
import select
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.comfy_host import ComfyServer, free_port
from support.route_helpers import add_entry, delete, json_answer, open_in_server, read_only, state

from carnator_core.store.http_api import refused_origin, store_id
from carnator_core.store.reuse_store import ReuseStore

pytestmark = [pytest.mark.server, pytest.mark.shared_server]  # see tests/conftest.py: comfy_server

BAD_IDS = ["abc", "0" * 31, "0" * 33, "A" * 32, "g" * 32, "%2e%2e%2f%2e%2e%2fcache.db", "..%2Fcache.db",
           "%2e%2e", "0" * 32 + "%00", "0" * 32 + ".png"]
MISSING_ID = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def node_store(server: ComfyServer, request: pytest.FixtureRequest) -> Callable[[int], tuple[Path, str]]:
    """Give the test a store of its own (`user/<test name>`) with `count` entries, opened in the server by a
    Carnator Store node: its directory and its id."""

    def make(count: int) -> tuple[Path, str]:
        name = f"user/{request.node.name}"
        writer = ReuseStore(str(server.base_dir / name))
        for number in range(count):
            add_entry(writer, f"entry {number}")
        writer.close()
        return server.base_dir / name, open_in_server(server, name)["id"]

    return make


def _actions(server: ComfyServer, entry: str, **kwargs) -> list:
    """Pin, delete and clear `entry`'s store: the state-changing routes."""
    return [server.post(f"/carnator/store/entries/{entry}/pin", json={"pinned": True}, **kwargs),
            delete(server, f"/carnator/store/entries/{entry}", **kwargs),
            server.post("/carnator/store/clear", **{**kwargs, "params": {**kwargs.get("params", {}), "confirm": "true"}})]


def _reads(server: ComfyServer, entry: str, **kwargs) -> list:
    return [server.get("/carnator/store/entries", **kwargs), server.get("/carnator/store/stats", **kwargs),
            server.get(f"/carnator/store/entries/{entry}/thumbnail", **kwargs)]


def test_empty_and_missing_stores_list_nothing(server, store):
    listing = json_answer(server.get("/carnator/store/entries"))
    assert listing["entries"] == [] and listing["total"] == 0
    assert json_answer(server.get("/carnator/store/stats"))["entries"] == 0
    unknown = server.get("/carnator/store/entries", params={"store": "user/no_such_store"})
    assert unknown.status_code == 404 and "stores" in json_answer(unknown)["error"]
    assert not (server.base_dir / "user" / "no_such_store").exists()  # reading never creates a store


def test_list_pages_newest_first_and_searches_prompt_words(server, store):
    ids = [add_entry(store, prompt) for prompt in ("A red ball rolls left", "a blue box", "red BALL bouncing", "grey sky")]
    first = json_answer(server.get("/carnator/store/entries", params={"limit": 2}))
    assert [e["id"] for e in first["entries"]] == ids[::-1][:2] and first["total"] == 4
    second = json_answer(server.get("/api/carnator/store/entries", params={"limit": 2, "offset": 2}))  # the frontend's path
    assert [e["id"] for e in second["entries"]] == ids[::-1][2:]
    found = json_answer(server.get("/carnator/store/entries", params={"q": "ball RED"}))
    assert [e["id"] for e in found["entries"]] == [ids[2], ids[0]] and found["total"] == 2
    entry = found["entries"][0]
    assert entry["prompt"] == "red BALL bouncing" and entry["thumbnail"] is True and entry["bytes"] > 0
    assert entry["hits"] == 0 and entry["pinned"] is False and entry["created_at"] > 0


def test_stats_count_entries_bytes_hits_and_hit_rate(server, store):
    donor = add_entry(store, "a red ball")
    add_entry(store, "a red ball, rolling", donor=donor)
    store.record_hit(donor, 2.5)
    totals = json_answer(server.get("/carnator/store/stats"))
    assert totals["entries"] == 2 and totals["bytes"] == store.used_bytes() > 0
    assert totals["hits"] == 1 and totals["seconds_saved"] == pytest.approx(2.5)
    assert totals["reused"] == 1 and totals["hit_rate"] == pytest.approx(0.5)


def test_thumbnail_is_the_stored_png(server, store):
    entry = add_entry(store, "a red ball")
    response = server.get(f"/carnator/store/entries/{entry}/thumbnail")
    assert response.status_code == 200 and response.headers["Content-Type"] == "image/png"
    assert response.content == store.get_blob(entry, "thumb") and response.content.startswith(b"\x89PNG")
    bare = add_entry(store, "no preview", thumb=False)
    assert server.get(f"/carnator/store/entries/{bare}/thumbnail").status_code == 404
    missing = server.get(f"/carnator/store/entries/{MISSING_ID}/thumbnail")
    assert missing.status_code == 404 and "error" in json_answer(missing)


def test_pin_unpin_delete_and_clear(server, store):
    keep, gone = add_entry(store, "keep me"), add_entry(store, "delete me")
    assert json_answer(server.post(f"/carnator/store/entries/{keep}/pin", json={"pinned": True}))["pinned"] is True
    assert store.stats(keep).pinned
    assert server.post(f"/carnator/store/entries/{keep}/pin", json={"pinned": False}).status_code == 200
    assert not store.stats(keep).pinned
    assert json_answer(delete(server, f"/carnator/store/entries/{gone}"))["deleted"] is True
    assert store.get_meta(gone) is None and store.get_meta(keep) is not None
    assert delete(server, f"/carnator/store/entries/{gone}").status_code == 404
    refused = server.post("/carnator/store/clear")
    assert refused.status_code == 400 and "confirm" in json_answer(refused)["error"]
    assert server.post("/carnator/store/clear", params={"confirm": "false"}).status_code == 400
    assert list(store.entry_ids()) == [keep]
    assert json_answer(server.post("/carnator/store/clear", params={"confirm": "true"}))["deleted"] == 1
    assert list(store.entry_ids()) == []


@pytest.mark.parametrize("bad", BAD_IDS)
def test_bad_ids_are_refused_with_json(server, store, bad):
    entry = add_entry(store, "must survive")
    for response in (server.get(f"/carnator/store/entries/{bad}/thumbnail"),
                     server.post(f"/carnator/store/entries/{bad}/pin", json={"pinned": True}),
                     delete(server, f"/carnator/store/entries/{bad}")):
        assert response.status_code in (400, 404), (bad, response.status_code, response.text[:200])
        assert not response.content.startswith(b"SQLite")  # never a file from the store directory
        assert response.status_code == 404 or "error" in json_answer(response)
    assert store.get_meta(entry) is not None


@pytest.mark.parametrize("params", [{"limit": "0"}, {"limit": "101"}, {"limit": "ten"}, {"offset": "-1"},
                                    {"q": "x" * 201}])
def test_bad_list_parameters_are_400(server, store, params):
    response = server.get("/carnator/store/entries", params=params)
    assert response.status_code == 400 and json_answer(response)["error"]


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"pinned": "maybe"}', b"{}", b'{"pinned": NaN}',
                                  b"[" * 50_000])  # nested deeper than Python's JSON parser goes
def test_bad_pin_bodies_are_400(server, store, body):
    entry = add_entry(store, "a red ball")
    response = server.post(f"/carnator/store/entries/{entry}/pin", data=body,
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and json_answer(response)["error"]
    assert not store.stats(entry).pinned


def test_the_store_list_offers_the_default_and_the_stores_nodes_opened(server, store):
    other = ReuseStore(str(server.base_dir / "user" / "listed_store"))
    entry = add_entry(other, "only in the other store")
    other.close()
    before = json_answer(server.get("/carnator/store/stores"))["stores"]
    assert before[0]["default"] and before[0]["name"] == str(server.base_dir / "user" / "carnator" / "store")
    assert all(not row["default"] for row in before[1:])
    assert server.get("/carnator/store/entries", params={"store": "user/listed_store"}).status_code == 404

    opened = open_in_server(server, "user/listed_store")  # a workflow's Carnator Store node opens it
    assert opened["id"] == store_id(opened["name"]) and not opened["default"] and opened["unavailable"] is None
    for chosen in (opened["id"], opened["name"]):
        listing = json_answer(server.get("/carnator/store/entries", params={"store": chosen}))
        assert [e["id"] for e in listing["entries"]] == [entry] and listing["store"] == opened["name"]
    assert json_answer(server.get("/carnator/store/entries", params={"store": before[0]["id"]}))["total"] == 0
    assert json_answer(server.get("/carnator/store/entries"))["total"] == 0
    response = delete(server, f"/carnator/store/entries/{entry}", params={"store": opened["id"]})
    assert response.status_code == 200 and json_answer(server.get(
        "/carnator/store/stats", params={"store": opened["id"]}))["entries"] == 0


@pytest.mark.parametrize("named", ["user/no_such_store", "../../outside", "/etc", "user", "\x00", "user/\x00x",
                                   "redis://192.0.2.1:6379/0", "x" * 5000])
def test_a_store_named_by_a_request_is_never_opened(server, store, named):
    entry = add_entry(store, "must survive")
    for response in (*_reads(server, entry, params={"store": named}), *_actions(server, entry, params={"store": named})):
        assert response.status_code == 404 and "no such store" in json_answer(response)["error"]
    assert state(store) == [(entry, False)]


def test_a_redis_url_in_a_request_connects_nowhere(server, store):
    """The review's stall: a loopback port that accepts but never answers, with the longest timeout a URL takes."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0?timeout_ms=600000"
        started = time.monotonic()
        for response in (*_reads(server, MISSING_ID, params={"store": url}),
                         *_actions(server, MISSING_ID, params={"store": url})):
            assert response.status_code == 404, response.text[:200]
        assert time.monotonic() - started < 10
        assert select.select([listener], [], [], 0.5)[0] == []  # nobody connected


def test_request_named_stores_leave_nothing_behind(server, store):
    """Distinct URLs and paths: no store object, blob cache, directory or file descriptor per request."""
    descriptors = lambda: len(os.listdir(f"/proc/{server.pid}/fd"))  # noqa: E731
    json_answer(server.get("/carnator/store/stats"))  # the default store, open once
    before, user_dirs = descriptors(), sorted(os.listdir(server.base_dir / "user"))
    served = json_answer(server.get("/carnator/store/stores"))
    for number in range(60):
        named = f"redis://127.0.0.1:{free_port()}/{number % 16}" if number % 2 else f"user/store_{number}"
        assert server.get("/carnator/store/stats", params={"store": named}).status_code == 404
    assert descriptors() <= before + 10  # the review saw 3 more per distinct URL
    assert sorted(os.listdir(server.base_dir / "user")) == user_dirs
    assert not (server.base_dir / "user" / "carnator" / "blob-cache").exists()
    assert json_answer(server.get("/carnator/store/stores")) == served


def _foreign_file(directory: Path) -> None:
    directory.mkdir(parents=True)
    (directory / "notes.txt").write_text("mine")


def _damaged_database(directory: Path) -> None:
    writer = ReuseStore(str(directory))
    for number in range(20):
        add_entry(writer, f"entry {number}")
    writer.close()
    with open(directory / "cache.db", "r+b") as file:  # every page after the first four: tables and indexes unreadable
        file.seek(16384)
        file.write(b"\xff" * ((directory / "cache.db").stat().st_size - 16384))


@pytest.mark.parametrize(("spoil", "says"), [(_foreign_file, "not a Carnator store"), (_damaged_database, "")])
def test_a_default_store_that_cannot_be_opened_is_an_error_not_a_500(comfy_server_factory, new_base_dir, spoil, says):
    base = new_base_dir()
    spoil(base / "user" / "carnator" / "store")
    server = comfy_server_factory(base)
    for response in (*_reads(server, MISSING_ID), *_actions(server, MISSING_ID)):
        assert response.status_code in (409, 503), (response.status_code, response.text[:300])
        assert says in json_answer(response)["error"]
    assert server.get("/system_stats").ok
    if spoil is _foreign_file:
        assert (base / "user" / "carnator" / "store" / "notes.txt").read_text() == "mine"


def test_an_unreachable_redis_store_is_503(server, store):
    url = f"redis://127.0.0.1:{free_port()}/0"  # this machine, nothing listening: the node opens it unavailable
    opened = open_in_server(server, url)
    assert opened["unavailable"]
    for response in (server.get("/carnator/store/entries", params={"store": opened["id"]}),
                     server.post(f"/carnator/store/entries/{MISSING_ID}/pin", params={"store": opened["id"]},
                                 json={"pinned": True})):
        assert response.status_code == 503 and "unavailable" in json_answer(response)["error"]


def test_a_read_only_store_serves_reads_and_refuses_changes_with_json(server, node_store):
    directory, other_id = node_store(1)
    other = ReuseStore(str(directory))
    before = state(other)
    keep = before[0][0]
    with read_only(directory):
        assert json_answer(server.get("/carnator/store/entries", params={"store": other_id}))["total"] == 1
        assert server.get(f"/carnator/store/entries/{keep}/thumbnail", params={"store": other_id}).ok
        for response in _actions(server, keep, params={"store": other_id}):
            assert response.status_code in (409, 503), (response.status_code, response.text[:300])
            assert json_answer(response)["error"]
        assert json_answer(server.get("/carnator/store/stats", params={"store": other_id}))["entries"] == 1
    assert state(other) == before
    other.close()


@pytest.mark.parametrize("headers", [
    {"Origin": "http://evil.example"},  # loopback Host: ComfyUI's own origin middleware answers
    {"Origin": "http://evil.example", "Host": "192.0.2.10:8188"},  # not loopback: Carnator's check answers
    {"Origin": "null", "Host": "192.0.2.10:8188"},
    {"Sec-Fetch-Site": "cross-site"},
    {"Host": "evil.example:{port}", "Origin": "http://evil.example:{port}"},  # DNS rebinding: they agree
    {"Host": "evil.example:{port}"},
    {"Host": "127.0.0.1.evil.example:{port}", "Origin": "http://127.0.0.1.evil.example:{port}"},
    {"Origin": "https://127.0.0.1:{port}"},  # another scheme than this server's
    {"Host": "localhost:{port}", "Origin": "https://localhost:{port}"},
])
def test_cross_origin_state_changes_are_refused(server, store, headers):
    headers = {name: value.format(port=server.port) for name, value in headers.items()}
    entry = add_entry(store, "a red ball")
    responses = _actions(server, entry, headers=headers)
    assert [r.status_code for r in responses] == [403, 403, 403]
    if "Host" in headers:  # requests ComfyUI's loopback-only middleware lets through: Carnator's check answers
        assert all("refused" in json_answer(r)["error"] for r in responses)
    for response in responses:  # a cross-site fetch: newer hosts' middleware answers first, with an empty body
        if response.headers.get("Content-Type", "").startswith("application/json"):
            assert "refused" in json_answer(response)["error"]
    assert store.get_meta(entry) is not None and not store.stats(entry).pinned


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "[::1]:{port}"])
def test_same_origin_browser_requests_are_allowed(server, store, host):
    host = host.format(port=server.port)
    entry = add_entry(store, "a red ball")
    headers = {"Host": host, "Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"}
    assert server.post(f"/carnator/store/entries/{entry}/pin", json={"pinned": True}, headers=headers).ok
    assert delete(server, f"/carnator/store/entries/{entry}", headers=headers).ok


@pytest.mark.parametrize(("headers", "listen", "refused"), [
    ({"Host": "127.0.0.1:8188"}, "127.0.0.1", False),
    ({"Origin": "http://127.0.0.1:8188", "Host": "127.0.0.1:8188"}, "127.0.0.1", False),
    ({"Origin": "http://LOCALHOST", "Host": "localhost:80"}, "127.0.0.1", False),
    ({"Origin": "http://[::1]:8188", "Host": "[::1]:8188"}, "127.0.0.1", False),
    ({"Host": "127.0.0.1:8188", "Sec-Fetch-Site": "none"}, "127.0.0.1", False),
    ({"Origin": "http://192.0.2.7:8188", "Host": "192.0.2.7:8188"}, "127.0.0.1,192.0.2.7", False),  # listed
    ({"Origin": "http://comfy.lan:8188", "Host": "comfy.lan:8188"}, "comfy.lan", False),  # a listed name
    ({"Host": "192.0.2.9:8188"}, "0.0.0.0,::", False),  # every address: the one this connection reached
    ({"Host": "[::ffff:192.0.2.9]:8188"}, "::", False),
    ({"Host": "192.0.2.8:8188"}, "0.0.0.0,::", True),  # every address, but not the one reached
    ({"Host": "192.0.2.7:8188"}, "127.0.0.1", True),  # not listened on
    ({"Host": "comfy.lan:8188"}, "0.0.0.0", True),  # a name: any domain can point here (DNS rebinding)
    ({"Origin": "http://evil.example:8188", "Host": "evil.example:8188"}, "0.0.0.0,::", True),
    ({"Origin": "http://localhost.:8188", "Host": "localhost.:8188"}, "127.0.0.1", True),
    ({"Origin": "https://127.0.0.1:8188", "Host": "127.0.0.1:8188"}, "127.0.0.1", True),  # another scheme
    ({"Origin": "https://comfy.lan", "Host": "comfy.lan:443"}, "comfy.lan", True),
    ({"Origin": "http://127.0.0.1:9999", "Host": "127.0.0.1:8188"}, "127.0.0.1", True),
    ({"Origin": "http://127.0.0.1.evil.example:8188", "Host": "127.0.0.1:8188"}, "127.0.0.1", True),
    ({"Origin": "http://127.0.0.1:8188/x", "Host": "127.0.0.1:8188"}, "127.0.0.1", True),
    ({"Origin": "null", "Host": "127.0.0.1:8188"}, "127.0.0.1", True),
    ({"Origin": "http://127.0.0.1:8188"}, "127.0.0.1", True),  # no Host
    ({"Host": "[::1:8188"}, "127.0.0.1", True),  # malformed
    ({"Origin": "http://[::1", "Host": "127.0.0.1:8188"}, "127.0.0.1", True),
    ({"Host": "127.0.0.1:http"}, "127.0.0.1", True),
    ({"Host": "127.0.0.1:99999"}, "127.0.0.1", True),
    ({"Host": "user@127.0.0.1:8188"}, "127.0.0.1", True),
    ({"Host": "127.0.0.1:8188", "Sec-Fetch-Site": "same-site"}, "127.0.0.1", True),
])
def test_cross_origin_rule(headers, listen, refused):
    reason = refused_origin(headers, "http", listen.split(","), "192.0.2.9")
    assert (reason is not None) == refused, (json.dumps(headers), listen, reason)

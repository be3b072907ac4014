"""A bounded, fixed set of hostile values sent to every store route of a real headless ComfyUI server.

Ids with path separators, NUL, very long strings, unicode, negative/NaN/huge numbers, wrong JSON types,
missing and extra parameters, Host/Origin pairs (DNS rebinding, scheme mismatches, malformed hosts) and raw
requests `requests` cannot send. Every answer must be below 500 and, where a Carnator route answered, JSON
with an "error"; no refused request may change the store; the server must keep serving afterwards.
"""

from __future__ import annotations

import json
import socket
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import requests
from support.comfy_host import ComfyServer
from support.route_helpers import add_entry, json_answer, state

from carnator_core.judging.calibration_profile import Profile

pytestmark = [pytest.mark.server, pytest.mark.shared_server]  # see tests/conftest.py: comfy_server

TEXTS = ["", "\x00", "a\x00b", "../../etc/passwd", "..\\..\\boot.ini", "/etc", "%2e%2e%2f", "x" * 5000, "é" * 40,
         "\u202e" + "0" * 31, "😀" * 8, "٠" * 32, "null", "[]", "{}", "-1", "NaN", "redis://127.0.0.1:1/0?timeout_ms=600000",
         "rediss://[::1]:6379/0", "file:///etc/passwd", "user/carnator/store", "C:\\Windows"]
NUMBERS = ["-1", "-0x1", "NaN", "inf", "-inf", "1e309", "1e3", "0x10", "9" * 5000, "١٠", " ", "\x00", "10.5", "True",
           "1000000001", "18446744073709551617", "1_000_000_000_000"]
IDS = ["", ".", "..", "../cache.db", "..%2F..%2Fcache.db", "%00", "0" * 32 + "%00", "0" * 32 + "\n", "0" * 64,
       "a" * 4000, "A" * 32, "é" * 32, "٠" * 32, "0" * 31 + "g", "0" * 32 + "/thumbnail", "%ff" * 16, "%"]
BODIES = [b"null", b"[]", b'"true"', b"1", b"{", b"[" * 50_000, b'{"pinned": NaN}', b'{"pinned": Infinity}',
          b'{"pinned": 1}', b'{"pinned": "yes"}', b'{"pinned": null}', b'{"pinned": [true]}', b'{"pinned": {"$ne": false}}',
          b'{"confirm": 1}', b'{"confirm": "yes"}', b'{"confirm": [true]}', b"\xff\xfe\x00", b'{"pinned": ' + b"1" * 5000 + b"}",
          b" " * 70_000, json.dumps({"pinned": "é" * 1000}).encode()]
CONFIRMS = ["", "yes", "TRUE ", "\x00", "2", "-1", "NaN", "null", "[true]", "t" * 5000]
SITES = ["cross-site", "same-site", "", "CROSS-SITE"]


def host_origin_pairs(port: int) -> list[tuple[str, str | None]]:
    """Host/Origin pairs a state change must be refused with; DNS-rebinding pairs agree with each other."""
    # Not here: an Origin urllib cannot split ("http://[::1"), which ComfyUI's own origin middleware answers with a
    # 500 on every route before any pack's handler runs (test_cross_origin_rule covers Carnator's parsing of it).
    return [(f"evil.example:{port}", f"http://evil.example:{port}"), (f"evil.example:{port}", None),
            (f"127.0.0.1.nip.io:{port}", f"http://127.0.0.1.nip.io:{port}"), (f"localhost.:{port}", None),
            (f"évil.example:{port}", None), (f"192.0.2.10:{port}", f"http://192.0.2.10:{port}"),
            (f"0.0.0.0:{port}", None), (f"2130706433:{port}", None), (f"0x7f000001:{port}", None), ("x" * 3000, None),
            ("[::1", None), ("127.0.0.1:abc", None), ("127.0.0.1:99999", None), (f"user@127.0.0.1:{port}", None),
            (f"127.0.0.1:{port}", f"https://127.0.0.1:{port}"), (f"127.0.0.1:{port}", f"ws://127.0.0.1:{port}"),
            (f"localhost:{port}", f"https://localhost:{port}"), (f"127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"),
            (f"127.0.0.1:{port}", "null"), (f"127.0.0.1:{port}", ""), (f"127.0.0.1:{port}", f"http://127.0.0.1:{port}/"),
            (f"127.0.0.1:{port}", f"http://user@127.0.0.1:{port}"), (f"127.0.0.1:{port}", f"http://evil.example:{port}")]


@dataclass
class Attempt:
    """One hostile request; `changes` when the route it targets writes."""

    method: str
    path: str
    params: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None

    @property
    def changes(self) -> bool:
        return self.method != "GET"

    def send(self, server: ComfyServer) -> requests.Response:
        return requests.request(self.method, f"{server.url}{self.path}", params=self.params, headers=self.headers,
                                data=self.body, timeout=30)


VALID_PROFILE = Profile(model="abc", schedule="def", name="fuzz", thresholds={
    "structure": 0.9, "structure_slope": 0.0, "guidance": 0.5, "guidance_slope": 0.0}).to_json().encode()


def attempts(server: ComfyServer, entry: str) -> Iterator[Attempt]:
    """Every route, each hostile value in each place it can go (bounded: a few hundred requests)."""
    pin, remove = f"/carnator/store/entries/{entry}/pin", f"/carnator/store/entries/{entry}"
    json_type = {"Content-Type": "application/json"}
    yield Attempt("GET", "/carnator/store/stores", {"store": TEXTS[1], "extra": "x" * 5000})
    for text in TEXTS:
        yield Attempt("GET", "/carnator/store/entries", {"q": text[:200]})
        for path in ("/carnator/store/entries", "/carnator/store/stats", f"/carnator/store/entries/{entry}/thumbnail",
                     "/carnator/store/profiles"):
            yield Attempt("GET", path, {"store": text})
        if text:  # empty: the default store, where these would be granted
            yield Attempt("POST", pin, {"store": text}, json_type, b'{"pinned": true}')
            yield Attempt("DELETE", remove, {"store": text})
            yield Attempt("POST", "/carnator/store/clear", {"store": text, "confirm": "true"})
    for number in NUMBERS:
        yield Attempt("GET", "/carnator/store/entries", {"offset": number})
        yield Attempt("GET", "/carnator/store/entries", {"limit": number})
    yield Attempt("GET", "/carnator/store/entries", {"limit": "1", "offset": "0", "q": "x" * 201, "store": "", "zzz": ""})
    for bad in IDS:
        quoted = urllib.parse.quote(bad, safe="%/")
        yield Attempt("GET", f"/carnator/store/entries/{quoted}/thumbnail")
        yield Attempt("POST", f"/carnator/store/entries/{quoted}/pin", headers=json_type, body=b'{"pinned": true}')
        yield Attempt("DELETE", f"/carnator/store/entries/{quoted}")
        yield Attempt("DELETE", f"/carnator/store/profiles/{quoted}/{quoted}")
    for body in BODIES:
        yield Attempt("POST", "/carnator/store/profiles", headers=json_type, body=body)
        yield Attempt("POST", pin, headers=json_type, body=body)
        yield Attempt("POST", pin, headers={"Content-Type": "text/plain"}, body=body)
        yield Attempt("POST", "/carnator/store/clear", headers=json_type, body=body)
    for confirm in CONFIRMS:
        yield Attempt("POST", "/carnator/store/clear", {"confirm": confirm})
    for host, origin in host_origin_pairs(server.port):
        headers = {"Host": host, **({"Origin": origin} if origin is not None else {})}
        yield Attempt("POST", pin, headers={**headers, **json_type}, body=b'{"pinned": true}')
        yield Attempt("DELETE", remove, headers=headers)
        yield Attempt("POST", "/carnator/store/clear", {"confirm": "true"}, headers)
        yield Attempt("POST", "/carnator/store/profiles", headers={**headers, **json_type}, body=VALID_PROFILE)
    for site in SITES:
        yield Attempt("DELETE", remove, headers={"Sec-Fetch-Site": site})
    yield Attempt("PUT", remove)
    yield Attempt("GET", pin)


def raw_request(server: ComfyServer, head: bytes) -> tuple[int, bytes]:
    """Send bytes `requests` would not (no Host, two Hosts, raw non-ASCII); (status, body)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as connection:
        connection.sendall(head)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def _is_carnator_answer_or_hosts(response: requests.Response) -> bool:
    """A Carnator route answered (a refusal in JSON with an "error"), or ComfyUI/aiohttp refused before any route
    ran: its origin middleware (403, empty body), no route for the path (404/405), a request line too long."""
    if response.ok:
        return True
    if response.headers.get("Content-Type", "").startswith("application/json"):
        return bool(json_answer(response).get("error"))
    return (response.status_code == 403 and not response.content) or response.status_code in (400, 404, 405, 431)


def test_hostile_values_on_every_route_are_refused_cleanly(server, store):
    entries = [add_entry(store, prompt) for prompt in ("a red ball", "a blue box", "é 😀 \u202e")]
    store.set_pinned(entries[1], True)
    before = state(store)
    sent = 0
    for attempt in attempts(server, entries[0]):
        response = attempt.send(server)
        sent += 1
        described = (attempt.method, attempt.path[:100], {k: v[:60] for k, v in attempt.params.items()},
                     {k: v[:60] for k, v in attempt.headers.items()}, (attempt.body or b"")[:60])
        assert response.status_code < 500, (described, response.status_code, response.text[:300])
        assert _is_carnator_answer_or_hosts(response), (described, response.status_code, response.text[:300])
        if attempt.changes:
            assert not response.ok, (described, response.text[:300])
            assert state(store) == before, described
    assert sent > 300
    assert server.get("/carnator/store/profiles").json()["profiles"] == []  # no hostile request filed one
    for head in (b"POST /carnator/store/clear?confirm=true HTTP/1.0\r\n\r\n",  # no Host at all
                 b"POST /carnator/store/clear?confirm=true HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n"
                 b"Connection: close\r\n\r\n",
                 b"POST /carnator/store/clear?confirm=true HTTP/1.1\r\nHost: \xe9vil.example\r\nConnection: close\r\n\r\n",
                 f"DELETE /carnator/store/entries/{entries[0]} HTTP/1.1\r\nHost: evil.example\r\n"
                 "Origin: http://evil.example\r\nConnection: close\r\n\r\n".encode()):
        status, body = raw_request(server, head)
        assert 400 <= status < 500 and b"Traceback" not in body, (head, status, body[:300])
        assert state(store) == before, head

    assert server.get("/system_stats").ok  # still serving, and still right
    listing = json_answer(server.get("/carnator/store/entries"))
    assert [e["id"] for e in listing["entries"]] == entries[::-1]
    assert server.post(f"/carnator/store/entries/{entries[0]}/pin", json={"pinned": True}).ok
    assert store.stats(entries[0]).pinned

"""The store panel as two users of one ComfyUI started with --multi-user, each in a browser of their own (headless
Chromium on the real frontend, each signed in as ComfyUI's user selection signs in): each panel lists, shows and
clears only its own user's entries, and the other user's prompts and thumbnails appear nowhere on the page."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import pytest
from playwright.sync_api import sync_playwright
from support.browser import EDITOR_SETTINGS, TIMEOUT_MS, launch_chromium
from support.comfy_host import REPO_ROOT, ComfyServer, ServerFactory

from carnator_core.client import ComfyClient
from carnator_core.demo import graphs

pytestmark = [pytest.mark.server, pytest.mark.slow]

DEMO_WEIGHTS = "carnator_demo_wan21_t2v.safetensors"
PROMPTS = {"alice": "a red circle moving left on a black background",
           "bob": "a green square moving up on a gray background"}
ARTIFACTS = REPO_ROOT / "artifacts" / "browser" / "two-users"


@pytest.fixture(scope="module")
def multi_user(comfyui_path, new_base_dir) -> Iterator[tuple[ComfyServer, dict[str, str]]]:
    """A --multi-user server and its two users, created through its /users route: (server, user id by name)."""
    factory = ServerFactory(comfyui_path, new_base_dir)
    try:
        server = factory(extra_args=("--multi-user",))
        users = {name: server.post("/users", json={"username": name}).json() for name in PROMPTS}
        for user in users.values():  # each user's own editor settings, through ComfyUI's settings route
            assert server.post("/settings", json=EDITOR_SETTINGS, headers={"comfy-user": user}).ok
        yield server, users
    finally:
        factory.stop_all()


def _queue(server: ComfyServer, user: str, prompt: str) -> None:
    """The demo graph with one CarnatorReuse on the default store, queued as `user` (the comfy-user header)."""
    graph = graphs.with_reuse(graphs.base_graph(DEMO_WEIGHTS, prompt, seed=42, steps=6, cfg=4.0), "", prompt,
                              sparse_attention="off")
    with ComfyClient(server.url, user=user) as client:
        client.run(server.complete(graph))


def _signed_in(browser, server: ComfyServer, user: str, name: str):
    """A page of the editor as `name`, signed in as the user selection screen signs in (the frontend's local
    storage), with the store panel open."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.add_init_script(f"localStorage['Comfy.userId'] = {json.dumps(user)};"
                            f"localStorage['Comfy.userName'] = {json.dumps(name)};")
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.errors = []
    page.on("pageerror", lambda error: page.errors.append(error))
    page.goto(server.url)
    page.wait_for_function("() => window.comfyAPI?.app?.app?.graph && document.querySelector('.carnator-sidebar-icon')")
    page.locator(".carnator-sidebar-icon").click()
    return page


def _listed(page) -> list[str]:
    page.locator(".carnator-entry").first.wait_for()
    return page.locator(".carnator-entry").all_inner_texts()


def test_each_user_s_store_panel_lists_shows_and_clears_only_their_own_entries(multi_user):
    server, users = multi_user
    for name, user in users.items():
        _queue(server, user, PROMPTS[name])
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            pages = {name: _signed_in(browser, server, user, name) for name, user in users.items()}
            for name, page in pages.items():
                other = PROMPTS["bob" if name == "alice" else "alice"]
                listed = _listed(page)
                assert len(listed) == 1 and PROMPTS[name] in listed[0], (name, listed)
                assert other not in page.content(), name  # nowhere on the page, tooltips and titles included
                assert "1 entry" in page.locator(".carnator-totals").inner_text()
                page.wait_for_function("() => [...document.querySelectorAll('.carnator-entry img')]"
                                       ".every((img) => img.complete && img.naturalWidth > 0)")  # own thumbnail
                page.screenshot(path=str(ARTIFACTS / f"{name}.png"))

            bob = pages["bob"]
            bob.locator("button", has_text="Clear all").click()
            dialog = bob.locator("[role='dialog']", has_text="Clear the Carnator store")
            dialog.locator("button", has_text="Delete").click()
            bob.locator(".carnator-empty", has_text="No entries yet").wait_for()
            bob.screenshot(path=str(ARTIFACTS / "bob-cleared.png"))

            alice = pages["alice"]
            alice.locator(".carnator-panel button[aria-label='Refresh']").click()
            assert PROMPTS["alice"] in _listed(alice)[0]  # bob's clear all cleared bob's entries alone
            for page in pages.values():
                assert not [e for e in page.errors if "carnator" in f"{e}\n{e.stack}".lower()], page.errors
        finally:
            browser.close()
    counts = {name: server.get("/carnator/store/stats", headers={"comfy-user": user}).json()["entries"]
              for name, user in users.items()}
    assert counts == {"alice": 1, "bob": 0}

"""The Carnator frontend in a real browser: headless Chromium (the system's, driven by Playwright) on a real
ComfyUI server with its real frontend (comfyui-frontend-package) and the pack.

One scenario, in order, on one page: the Carnator nodes are in the node search; the CPU demo workflow file
loads; queueing it shows a MISS badge on the sampler; the same seed with an edited prompt shows a HIT badge
with a tooltip; the store panel (sidebar tab) lists both entries live, searches, pins, deletes one and clears
all after a confirmation; with the store unreachable it shows an empty state and does not retry by itself;
a workflow naming a node this Carnator lacks gets ComfyUI's missing-node report and no JavaScript error; the
calibration workflow, queued, shows its progress on its Calibrate node and in the store panel, whose Stop button
stops it; ComfyUI's official Wan 2.1 text-to-video template, opened as the template browser opens it, with a Carnator
Reuse node inserted, walks the editor flow: its KSampler randomizes the seed, so the node shows a notice, and an edited
prompt misses for its seed alone (its badge says so); the notice's one click keeps the last run's seed, and the next
edit is a hit.

The demo workflow is queued on the tiny Wan model, edited in the page like a user would (model file, 8
steps, probe thresholds a random-weight model passes with near-duplicate prompts; see tests/support/tiny_workflows.py),
so its outcome does not depend on the demo model's training. The template runs on the tiny Wan model and the tiny Wan
2.1 VAE, 64 x 64 x 5 frames and 8 steps, its text encoder replaced by the harness's (no text encoder exists at
test size; tests/support/tiny_workflows.py does the same to the shipped workflows). Screenshots go to
artifacts/browser/<frontend>/.

Where frontends differ (1.27 on ComfyUI 0.3.64, 1.45 on 0.28, 1.49 on 0.33, 1.58), a step finds the element either one
renders. The scenario runs on the frontend the host pins, then on each version in CARNATOR_BROWSER_FRONTENDS (a
space-separated list; .ci/run names the newest on PyPI for the newest host): that comfyui-frontend-package is installed
once into the user's cache, beside the host's pin, and the server serves it with --front-end-root.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import expect, sync_playwright
from support.browser import EDITOR_SETTINGS, TIMEOUT_MS, launch_chromium
from support.comfy_host import REPO_ROOT, ComfyServer, ServerFactory
from support.tiny_models import WAN21_VAE, write_tiny_model
from support.tiny_workflows import WORKFLOWS

from carnator_core.judging.calibration_profile import Profile, Score

pytestmark = [pytest.mark.server, pytest.mark.slow]

ARTIFACTS = REPO_ROOT / "artifacts" / "browser"
PINNED_FRONTEND = "pinned"
EXTRA_FRONTENDS = os.environ.get("CARNATOR_BROWSER_FRONTENDS", "").split()
FIRST_PROMPT = "a red circle moving left on a black background"
EDITED_PROMPT = "a red ball moving left on a black background"
TINY_MODEL_THRESHOLDS = {"structure_threshold": 0.5, "guidance_threshold": 0.5, "depth_slope": 0.0}
# the node search's input and results: the autocomplete (frontend 1.27) or the search dialog (1.45)
NODE_SEARCH_INPUT = "input[id^='comfy-vue-node-search-box-input'], input[aria-controls='results-list']"
NODE_SEARCH_RESULTS = ".p-autocomplete-option, #results-list [role='option']"
# the Run button: inside 1.27's split button; the button itself in 1.45, whose run-mode menu is also labelled Run
RUN_BUTTON = "[data-testid='queue-button'] button[aria-label='Run'], button[data-testid='queue-button']"

BADGES_JS = """(type) => {
  const node = window.comfyAPI.app.app.graph.nodes.find((n) => n.type === type);
  return (node?.badges ?? []).map((b) => (typeof b === "function" ? b() : b).text ?? "");
}"""


@pytest.fixture(scope="module", params=[PINNED_FRONTEND, *EXTRA_FRONTENDS])
def frontend(request) -> str:
    """The frontend under test: the host's pin, or a comfyui-frontend-package version from PyPI."""
    return request.param


def _frontend_root(version: str) -> Path | None:
    """The files of `version` of the frontend for --front-end-root, installed into the user's cache on first use;
    None for the host's pin."""
    if version == PINNED_FRONTEND:
        return None
    target = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "carnator" / "frontends" / version
    static = target / "comfyui_frontend_package" / "static"
    if not (static / "index.html").is_file():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target",
                        str(target), f"comfyui-frontend-package=={version}"], check=True)
    return static


@pytest.fixture(scope="module")
def server(comfyui_path: Path, new_base_dir, frontend: str) -> Iterator[ComfyServer]:
    base = new_base_dir()
    settings = base / "user" / "default" / "comfy.settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps(EDITOR_SETTINGS))
    write_tiny_model("wan21_vae", base / "models" / "vae", filename=WAN21_VAE)
    factory = ServerFactory(comfyui_path, new_base_dir)
    root = _frontend_root(frontend)
    try:
        server = factory(base, extra_args=() if root is None else ("--front-end-root", str(root)))
        if root is not None:  # the page is that version's, not the host's pin
            with urllib.request.urlopen(server.url) as response:
                assert response.read() == (root / "index.html").read_bytes()
        yield server
    finally:
        factory.stop_all()


@pytest.fixture(scope="module")
def page(server: ComfyServer, frontend: str):
    artifacts = ARTIFACTS / frontend
    shutil.rmtree(artifacts, ignore_errors=True)
    artifacts.mkdir(parents=True)
    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.set_default_timeout(TIMEOUT_MS)
            page.errors = []
            page.artifacts = artifacts
            page.on("pageerror", lambda error: page.errors.append(error))
            page.goto(server.url)
            page.wait_for_function("() => window.comfyAPI?.app?.app?.graph && window.LiteGraph && "
                                   "document.querySelector('.carnator-sidebar-icon')")
            yield page
        finally:
            browser.close()


def _shot(page, name: str) -> None:
    page.screenshot(path=str(page.artifacts / f"{name}.png"))


def _missing_node_report(page):
    """ComfyUI's list of the workflow's missing node types: the "Some Nodes Are Missing" dialog (frontend 1.27),
    or the missing-node card of the errors panel that the error overlay's button opens (1.45)."""
    dialog = page.locator(".p-dialog", has_text="Some Nodes Are Missing")
    overlay = page.locator("[data-testid='error-overlay']")
    dialog.or_(overlay).first.wait_for()
    if dialog.count():
        return dialog
    overlay.locator("[data-testid='error-overlay-see-errors']").click()
    card = page.locator("[data-testid='missing-node-card']")
    card.wait_for()
    expand = card.locator("button[aria-label='Expand']")  # the node types of an unknown pack start folded
    if expand.count():
        expand.click()
    return card


def _carnator_errors(page) -> list[str]:
    """Errors thrown by Carnator's scripts or about its events (e.g. an unregistered `carnator.status`)."""
    return [f"{e}\n{e.stack}" for e in page.errors if "carnator" in f"{e}\n{e.stack}".lower()]


def _wait_for_badge(page, node_type: str, prefix: str) -> str:
    page.wait_for_function(f"(t) => ({BADGES_JS})(t).some((text) => text.startsWith('{prefix}'))", arg=node_type)
    return next(text for text in page.evaluate(BADGES_JS, node_type) if text.startswith(prefix))


def _run(page) -> None:
    page.locator(RUN_BUTTON).click()


def _set_widgets(page, node_type: str, values: dict) -> None:
    page.evaluate("""([type, values]) => {
      const node = window.comfyAPI.app.app.graph.nodes.find((n) => n.type === type);
      for (const [name, value] of Object.entries(values)) node.widgets.find((w) => w.name === name).value = value;
    }""", [node_type, values])


def _focus(page, node_type: str) -> None:
    """Zoom to 100% with the node in the middle of the canvas, for a readable screenshot of its badge."""
    page.evaluate("""(type) => {
      const app = window.comfyAPI.app.app;
      const node = app.graph.nodes.find((n) => n.type === type);
      const { width, height } = app.canvas.canvas.getBoundingClientRect();
      app.canvas.ds.scale = 1;
      app.canvas.ds.offset = [width / 2 - node.pos[0] - node.size[0] / 2, height / 2 - node.pos[1] - node.size[1] / 2];
      app.canvas.setDirty(true, true);
    }""", node_type)


def _hover_badge(page, node_type: str) -> None:
    """Move the pointer onto the badge row above the node's title bar."""
    point = page.evaluate("""(type) => {
      const app = window.comfyAPI.app.app;
      const node = app.graph.nodes.find((n) => n.type === type);
      const [x, y] = app.canvas.ds.convertOffsetToCanvas(
        [node.pos[0] + node.size[0] - 12, node.pos[1] - window.LiteGraph.NODE_TITLE_HEIGHT - 12]);
      const rect = app.canvas.canvas.getBoundingClientRect();
      return [rect.left + x, rect.top + y];
    }""", node_type)
    page.mouse.move(point[0] - 5, point[1])
    page.mouse.move(*point)


def test_carnator_nodes_are_in_the_node_search(page):
    search = page.locator(NODE_SEARCH_INPUT)
    for _ in range(5):  # a double click on empty canvas opens the node search (once the canvas takes input)
        page.mouse.dblclick(700, 130)
        try:
            search.wait_for(timeout=3000)
            break
        except PlaywrightTimeout:
            continue
    search.fill("Carnator")
    options = page.locator(NODE_SEARCH_RESULTS)
    options.filter(has_text="Carnator Reuse Sampler").wait_for()
    found = options.all_inner_texts()
    for title in ("Carnator Reuse", "Carnator KSampler", "Carnator Compatibility Lookup", "Carnator Sparse Attention",
                  "Carnator Report", "Carnator Store", "Carnator Demo Text Encode"):
        assert any(text.startswith(title) for text in found), (title, found)
    _shot(page, "01_node_search")
    page.keyboard.press("Escape")


def test_demo_workflow_badges_and_store_panel(page, server, tiny_models):
    page.set_input_files("#comfy-file-input", str(WORKFLOWS / "carnator_demo_cpu.json"))
    page.wait_for_function("() => window.comfyAPI.app.app.graph.nodes.some((n) => n.type === 'CarnatorReuse')")
    # text= ignores case: this is 1.27's missing-node dialog and 1.45's "Some nodes are missing…" error overlay
    assert page.locator("text=Some Nodes Are Missing").count() == 0
    _shot(page, "02_demo_workflow_loaded")
    _set_widgets(page, "UNETLoader", {"unet_name": tiny_models["wan"].name})
    _set_widgets(page, "KSampler", {"steps": 8})
    _set_widgets(page, "CarnatorReuse", TINY_MODEL_THRESHOLDS)

    page.locator(".carnator-sidebar-icon").click()  # the store panel, open while prompts run
    page.locator(".carnator-empty", has_text="No entries yet").wait_for()
    _shot(page, "03_store_panel_empty")

    _run(page)
    miss = _wait_for_badge(page, "KSampler", "MISS")
    assert "no candidate" in miss
    page.locator(".carnator-entry").first.wait_for()  # the panel refreshed itself after the run
    _focus(page, "KSampler")
    _shot(page, "04_miss_badge")

    prompt_box = page.evaluate_handle("() => window.comfyAPI.app.app.graph.nodes"
                                      ".find((n) => n.type === 'PrimitiveStringMultiline').widgets[0].element")
    assert prompt_box.as_element().input_value() == FIRST_PROMPT
    prompt_box.as_element().fill(EDITED_PROMPT)
    _run(page)
    hit = _wait_for_badge(page, "KSampler", "HIT")
    assert hit.startswith("HIT resumed 4/8 steps") and "“a red circle moving" in hit, hit
    page.wait_for_function("() => document.querySelectorAll('.carnator-entry').length === 2")
    _focus(page, "KSampler")
    _hover_badge(page, "KSampler")
    tooltip = page.locator(".carnator-tooltip")
    tooltip.wait_for(state="visible")
    assert "Carnator HIT: resumed" in tooltip.inner_text() and FIRST_PROMPT in tooltip.inner_text()
    _shot(page, "05_hit_badge_tooltip_and_store_panel")

    entries = page.locator(".carnator-entry")
    assert EDITED_PROMPT in entries.nth(0).inner_text() and FIRST_PROMPT in entries.nth(1).inner_text()
    assert "2 entries" in page.locator(".carnator-totals").inner_text()
    assert page.locator(".carnator-entry img.carnator-thumb").count() == 2
    page.wait_for_function("() => [...document.querySelectorAll('.carnator-entry img')]"
                           ".every((img) => img.complete && img.naturalWidth > 0)")

    page.locator(".carnator-search").fill("ball")
    page.wait_for_function("() => document.querySelectorAll('.carnator-entry').length === 1")
    page.locator(".carnator-search").fill("")
    page.wait_for_function("() => document.querySelectorAll('.carnator-entry').length === 2")

    entries.nth(1).locator("button[aria-label='Pin']").click()
    page.locator(".carnator-entry button[aria-pressed='true']").wait_for()
    entries.nth(0).locator(".carnator-delete").click()
    page.wait_for_function("() => document.querySelectorAll('.carnator-entry').length === 1")
    listing = server.get("/carnator/store/entries").json()["entries"]
    assert [e["prompt"] for e in listing] == [FIRST_PROMPT] and listing[0]["pinned"] is True
    _shot(page, "06_after_pin_and_delete")

    page.locator("button", has_text="Clear all").click()
    dialog = page.locator("[role='dialog']", has_text="Clear the Carnator store")  # PrimeVue's or Reka's
    dialog.wait_for()
    _shot(page, "07_clear_all_confirmation")
    dialog.locator("button", has_text="Delete").click()
    page.locator(".carnator-empty", has_text="No entries yet").wait_for()
    assert server.get("/carnator/store/stats").json()["entries"] == 0
    assert not _carnator_errors(page)


def test_a_calibration_profile_is_imported_listed_exported_and_deleted_in_the_store_panel(page, server, tmp_path):
    profile = Profile(model="c0ffee", schedule="beef", name="browser", fit_pairs=8, held_back_pairs=4,
                      held_back=Score(accepted=5, good=5, precision=1.0, recall=0.8), in_force=True,
                      reason="in force: held-back precision 1.00 (5 of 5 accepted resumes good) meets the target 0.95",
                      thresholds={"structure": 0.82, "structure_slope": 0.03, "guidance": 0.8, "guidance_slope": 0.03})
    path = tmp_path / "profile.json"
    path.write_text(profile.to_json())
    page.locator(".carnator-panel input[type='file']").set_input_files(str(path))
    page.locator(".carnator-profile").first.wait_for(state="attached")
    page.locator(".carnator-profiles summary").click()
    row = page.locator(".carnator-profile")
    assert "profile 'browser'" in row.inner_text() and "100% precision, 80% recall held back" in row.inner_text()
    assert profile.reason in row.inner_text()  # in force or not, and why, in one line
    assert [p["name"] for p in server.get("/carnator/store/profiles").json()["profiles"]] == ["browser"]
    _shot(page, "09_calibration_profile")
    with page.expect_download() as download:
        row.locator("button[aria-label='Export']").click()
    assert Profile.from_json(Path(download.value.path()).read_text()) == profile
    row.locator(".carnator-delete").click()
    page.wait_for_function("() => document.querySelectorAll('.carnator-profile').length === 0")
    assert server.get("/carnator/store/profiles").json()["profiles"] == []


def test_unreachable_store_shows_an_empty_state_without_retrying(page):
    requests: list[str] = []

    def record(request) -> None:
        if "/carnator/store/" in request.url:
            requests.append(request.url)

    page.on("request", record)
    page.route("**/carnator/store/**", lambda route: route.abort())
    try:
        page.locator(".carnator-panel button[aria-label='Refresh']").click()
        page.locator(".carnator-empty", has_text="Store unavailable").wait_for()
        seen = len(requests)
        page.wait_for_timeout(3000)
        assert len(requests) == seen, requests  # no retry loop
        _shot(page, "08_store_unreachable")
    finally:
        page.unroute("**/carnator/store/**")
        page.remove_listener("request", record)
    page.locator(".carnator-empty button", has_text="Retry").click()
    page.locator(".carnator-empty", has_text="No entries yet").wait_for()


def test_workflow_with_a_missing_node_gets_comfyuis_report(page, tmp_path):
    workflow = json.loads((WORKFLOWS / "carnator_demo_cpu.json").read_text())
    for node in workflow["nodes"]:
        if node["type"] == "CarnatorReuse":
            node["type"] = "CarnatorReuseV0"  # e.g. a node of an older Carnator
    path = tmp_path / "older_carnator.json"
    path.write_text(json.dumps(workflow))
    errors_before = len(page.errors)
    page.set_input_files("#comfy-file-input", str(path))
    expect(_missing_node_report(page)).to_contain_text("CarnatorReuseV0")
    _shot(page, "09_missing_node_report")
    page.keyboard.press("Escape")
    assert page.errors[errors_before:] == []
    assert not _carnator_errors(page)


def test_the_calibrate_workflow_shows_its_progress_on_the_node_and_in_the_panel_which_stops_it(page, server,
                                                                                                tiny_models):
    page.set_input_files("#comfy-file-input", str(WORKFLOWS / "carnator_calibrate_demo.json"))
    page.wait_for_function("() => window.comfyAPI.app.app.graph.nodes.some((n) => n.type === 'CarnatorCalibrate')")
    _set_widgets(page, "UNETLoader", {"unet_name": tiny_models["wan"].name})
    _set_widgets(page, "KSampler", {"steps": 20})  # 3 pairs x 7 runs: long enough to stop it halfway
    pairs = [f"{FIRST_PROMPT} => {EDITED_PROMPT}", f"{EDITED_PROMPT} => a red ball moving up on a black background",
             "a blue square moving down on a gray background => on a grey background a blue box is falling"]
    _set_widgets(page, "CarnatorCalibrate", {"pairs": "\n".join(pairs), "name": "browser"})
    if not page.locator(".carnator-panel").is_visible():
        page.locator(".carnator-sidebar-icon").click()
    _run(page)
    panel_line = page.locator(".carnator-calibration")
    panel_line.locator("button", has_text="Stop").wait_for()
    status = page.evaluate_handle("() => window.comfyAPI.app.app.graph.nodes"
                                  ".find((n) => n.type === 'CarnatorCalibrate').widgets"
                                  ".find((w) => w.name === 'calibration status').element")
    page.wait_for_function("(box) => box.value.includes('“browser”')", arg=status)
    _focus(page, "CarnatorCalibrate")
    _shot(page, "10_calibration_running")
    panel_line.locator("button", has_text="Stop").click()
    panel_line.filter(has_text="Stopped “browser”").wait_for()
    page.wait_for_function("(box) => box.value.startsWith('Stopped “browser”')", arg=status)
    assert server.get("/carnator/calibration").json()["phase"] == "stopped"
    _shot(page, "11_calibration_stopped")
    assert not _carnator_errors(page)


# ComfyUI's official Wan 2.1 text-to-video template (comfyui-workflow-templates-json): one KSampler whose seed control
# is `randomize`
WAN21_TEMPLATE = "text_to_video_wan"
SEED_FLOW_NODES = ("KSampler", "CarnatorReuse")  # what the editor flow's screenshots frame
TEMPLATE_PROMPTS = ("a fox moving quickly in a winter scenery", "a fox moving slowly in a winter scenery",
                    "a fox moving slowly in a snowy winter scenery")


def _template(name: str) -> dict:
    return json.loads((importlib.resources.files("comfyui_workflow_templates_json") / "templates" / f"{name}.json")
                      .read_text(encoding="utf-8"))


def _on_tiny_loaders(workflow: dict, unet: str) -> dict:
    """`workflow` with its model loaders set to the tiny Wan model and VAE, and its text encoder loader taken out
    (_on_tiny_models swaps its text encoding in the page)."""
    loaders = {"UNETLoader": unet, "VAELoader": WAN21_VAE}
    encoder = next(node["id"] for node in workflow["nodes"] if node["type"] == "CLIPLoader")
    cut = {link[0] for link in workflow["links"] if link[1] == encoder}
    for node in workflow["nodes"]:
        if node["type"] in loaders:
            node["widgets_values"][0] = loaders[node["type"]]
        for entry in node.get("inputs", []):
            if entry.get("link") in cut:
                entry["link"] = None
    workflow["nodes"] = [node for node in workflow["nodes"] if node["id"] != encoder]
    workflow["links"] = [link for link in workflow["links"] if link[1] != encoder]
    return workflow


def _open_template(page, workflow: dict, name: str) -> None:
    """Load a template as the template browser does (into a new tab of the editor, named after it)."""
    page.evaluate("([workflow, name]) => window.comfyAPI.app.app.loadGraphData(workflow, true, true, name)",
                  [workflow, name])
    page.wait_for_function("() => window.comfyAPI.app.app.graph.nodes.some((n) => n.type === 'KSampler')")


def _on_tiny_models(page, prompt: str) -> None:
    """Each CLIPTextEncode swapped for a HarnessTextConditioning in its place and links, the positive one with
    `prompt`; a 64 x 64 clip of 5 frames (the VAE decodes it in seconds on a CPU) and 8 steps."""
    page.evaluate("""(prompt) => {
      const { app } = window.comfyAPI.app;
      const graph = app.graph;
      const set = (node, name, value) => { node.widgets.find((w) => w.name === name).value = value; };
      const sampler = graph.nodes.find((n) => n.type === "KSampler");
      for (const encode of graph.nodes.filter((n) => n.type === "CLIPTextEncode")) {
        const harness = window.LiteGraph.createNode("HarnessTextConditioning");
        graph.add(harness);
        harness.pos = [...encode.pos];
        set(harness, "text", sampler.getInputNode(1) === encode ? prompt : encode.widgets[0].value);
        set(harness, "family", "wan");
        for (const control of harness.widgets.find((w) => w.name === "seed").linkedWidgets ?? []) control.value = "fixed";
        for (const target of encode.getOutputNodes(0)) {
          target.inputs.forEach((_, slot) => {
            if (target.getInputNode(slot) === encode) harness.connect(0, target, slot);
          });
        }
        graph.remove(encode);
      }
      const latent = graph.nodes.find((n) => n.type === "EmptyHunyuanLatentVideo");
      set(latent, "width", 64); set(latent, "height", 64); set(latent, "length", 5);
      set(sampler, "steps", 8);
    }""", prompt)


def _insert_carnator_reuse(page) -> None:
    """A Carnator Reuse node between the model chain's last node (ModelSamplingSD3) and the KSampler, as the README
    says, with probe thresholds the tiny model passes."""
    page.evaluate("""(thresholds) => {
      const { app } = window.comfyAPI.app;
      const graph = app.graph;
      const sampler = graph.nodes.find((n) => n.type === "KSampler");
      const chain = sampler.getInputNode(0);
      const reuse = window.LiteGraph.createNode("CarnatorReuse");
      graph.add(reuse);
      reuse.pos = [sampler.pos[0] + sampler.size[0] - reuse.size[0] - 60, sampler.pos[1] + sampler.size[1] + 60];
      for (const [name, value] of Object.entries(thresholds)) reuse.widgets.find((w) => w.name === name).value = value;
      chain.connect(0, reuse, 0);
      reuse.connect(0, sampler, 0);
    }""", TINY_MODEL_THRESHOLDS)


def _seed_control(page) -> list:
    """The KSampler's seed and its control, as the widgets hold them."""
    return page.evaluate("""() => {
      const sampler = window.comfyAPI.app.app.graph.nodes.find((n) => n.type === "KSampler");
      const seed = sampler.widgets.find((w) => w.name === "seed");
      return [seed.value, seed.linkedWidgets[0].value];
    }""")


def _last_queued_seed(server: ComfyServer, prompts: int) -> int:
    """The KSampler seed of the prompt queued last, as the server holds it once it holds `prompts` finished ones."""
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while len(history := server.get("/history").json()) < prompts:
        assert time.monotonic() < deadline, f"{len(history)} prompts finished, not {prompts}"
        time.sleep(0.5)
    prompt = max(history.values(), key=lambda item: item["prompt"][0])["prompt"][2]
    return next(node["inputs"]["seed"] for node in prompt.values() if node["class_type"] == "KSampler")


def _frame(page, node_types: tuple[str, ...]) -> None:
    """Zoom (at most 100%) and pan so the nodes of `node_types`, with the badge rows above them, fill the canvas."""
    page.evaluate("""(types) => {
      const app = window.comfyAPI.app.app;
      const nodes = app.graph.nodes.filter((n) => types.includes(n.type));
      const title = window.LiteGraph.NODE_TITLE_HEIGHT;
      const left = Math.min(...nodes.map((n) => n.pos[0])) - 20;
      const top = Math.min(...nodes.map((n) => n.pos[1])) - title - 150;  // the badge row, below the toolbars
      const right = Math.max(...nodes.map((n) => n.pos[0] + n.size[0])) + 20;
      const bottom = Math.max(...nodes.map((n) => n.pos[1] + n.size[1])) + 20;
      const { width, height } = app.canvas.canvas.getBoundingClientRect();
      const scale = Math.min(1, width / (right - left), height / (bottom - top));
      app.canvas.ds.scale = scale;
      app.canvas.ds.offset = [(width / scale - (right - left)) / 2 - left, (height / scale - (bottom - top)) / 2 - top];
      app.canvas.setDirty(true, true);
    }""", list(node_types))


def _prompt_box(page):
    return page.evaluate_handle("""() => window.comfyAPI.app.app.graph.nodes
      .filter((n) => n.type === "HarnessTextConditioning")
      .find((n) => window.comfyAPI.app.app.graph.nodes.find((s) => s.type === "KSampler").getInputNode(1) === n)
      .widgets.find((w) => w.name === "text").element""").as_element()


def _wait_for_badge_text(page, node_type: str, part: str) -> str:
    page.wait_for_function(f"(t) => ({BADGES_JS})(t).some((text) => text.includes({json.dumps(part)}))",
                           arg=node_type)
    return next(text for text in page.evaluate(BADGES_JS, node_type) if part in text)


def test_the_official_wan_template_with_a_randomized_seed_gets_a_notice_a_seed_miss_and_a_one_click_fix(
        page, server, tiny_models):
    if page.locator(".carnator-panel").is_visible():  # the store panel would cover the canvas's right side
        page.locator(".carnator-sidebar-icon").click()
    template = _template(WAN21_TEMPLATE)
    assert next(node for node in template["nodes"] if node["type"] == "KSampler")["widgets_values"][1] == "randomize"
    _open_template(page, _on_tiny_loaders(template, tiny_models["wan"].name), WAN21_TEMPLATE)
    _on_tiny_models(page, TEMPLATE_PROMPTS[0])
    _insert_carnator_reuse(page)
    notice = page.locator(".carnator-seed-notice")
    expect(notice).to_contain_text("the seed is randomized on every run")
    _frame(page, SEED_FLOW_NODES)
    _shot(page, "12_template_with_carnator_notice")

    _run(page)
    first = _wait_for_badge(page, "KSampler", "MISS")
    assert "seed" not in first, first  # nothing earlier to reuse
    finished = len(server.get("/history").json())
    first_seed = _last_queued_seed(server, finished + 1)
    assert _seed_control(page) != [first_seed, "randomize"]  # the widget holds the next random seed already
    _prompt_box(page).fill(TEMPLATE_PROMPTS[1])
    _run(page)
    miss = _wait_for_badge_text(page, "KSampler", "other seed than the donor")
    assert miss == "MISS · other seed than the donor · click to keep the last seed", miss
    last_seed = _last_queued_seed(server, finished + 2)
    assert last_seed != first_seed
    expect(notice.locator("button")).to_have_text(f"Keep seed {last_seed} and fix it")
    _frame(page, SEED_FLOW_NODES)
    _hover_badge(page, "KSampler")
    tooltip = page.locator(".carnator-tooltip")
    tooltip.wait_for(state="visible")
    assert "only the seed kept this run from reusing" in tooltip.inner_text()
    assert f"Click the badge: keep seed {last_seed} and fix it" in tooltip.inner_text()
    _shot(page, "13_seed_miss_badge_and_notice")

    notice.locator("button").click()
    expect(notice).to_have_count(0)
    assert _seed_control(page) == [last_seed, "fixed"]
    page.wait_for_function(f"(t) => ({BADGES_JS})(t).includes('MISS · other seed than the donor')", arg="KSampler")
    _frame(page, SEED_FLOW_NODES)
    _shot(page, "14_seed_kept_and_fixed")

    _prompt_box(page).fill(TEMPLATE_PROMPTS[2])
    _run(page)
    hit = _wait_for_badge(page, "KSampler", "HIT")
    assert hit.startswith("HIT resumed"), hit
    assert _last_queued_seed(server, finished + 3) == last_seed and _seed_control(page) == [last_seed, "fixed"]
    _frame(page, SEED_FLOW_NODES)
    _shot(page, "15_hit_after_the_fix")
    assert not _carnator_errors(page)

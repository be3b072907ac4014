"""Headless Chromium for the browser tests: the system's (Debian's chromium), driven by Playwright, started with the
flags this machine's closed network needs."""

from __future__ import annotations

from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 60_000
# A user's editor settings for a test: no first-run template dialog, node text and widgets drawn at any zoom (the
# whole workflow is on screen), and no missing-models dialog over an official template, which names the official
# model files
EDITOR_SETTINGS = {"Comfy.TutorialCompleted": True, "LiteGraph.Canvas.MinFontSizeForLOD": 1,
                   "Comfy.Minimap.Visible": False, "Comfy.Workflow.ShowMissingModelsWarning": False}


def launch_chromium(playwright):
    """The system's Chromium under `playwright` (a failed test, saying how to install it, where it is missing)."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} not found: install Debian's chromium (apt-get install -y chromium; .ci/run does)",
                    pytrace=False)
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)

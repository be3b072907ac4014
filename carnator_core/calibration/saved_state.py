"""A calibration's state on disk (`state.json` in its output directory): the workflow it measured and what it learnt
of the model, so that the same command resumes it and a calibration of another workflow is refused, not mixed in."""

from __future__ import annotations

import json
from pathlib import Path

from carnator_core.queue import WorkflowError

STATE_FILE = "state.json"


def read_state(out: Path, workflow_digest: str, holds_runs: bool) -> dict:
    """The state kept in `out` ({} where there is none, or it cannot be read); WorkflowError where `out` holds runs
    of another workflow (another graph, model, setting or seed)."""
    try:
        state = json.loads((out / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    state = state if isinstance(state, dict) else {}
    if holds_runs and state.get("workflow") not in (None, workflow_digest):
        raise WorkflowError(f"{out} holds a calibration of another workflow (another graph, model, setting or seed): "
                            "choose another output directory, or empty this one")
    return state


def write_state(out: Path, state: dict) -> None:
    (out / STATE_FILE).write_text(json.dumps(state, indent=2))

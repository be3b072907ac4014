"""One calibration run at a time through the server's queue: the graph of a run sampled, its clip read back, its
progress said, and the run's store looked up. The pair calibration and the stream calibration both sample this way.
"""

from __future__ import annotations

import io
import json
import re
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load as load_safetensors

from carnator_core.calibration.clip import Clip
from carnator_core.calibration.workflow import (
    AUDIO_NODE,
    FRAMES_NODE,
    LATENT_NODE,
    STORE_INFO_NODE,
    CalibrationWorkflow,
)
from carnator_core.client import ComfyClient, ExecutionFailed, PromptRun

STORE_ROOT = "carnator/calibration"  # the calibrations' stores, relative to the server's base directory
STORE_WAIT_S = 120.0  # how long a recording run's background store write may take


class CalibrationInterrupted(RuntimeError):
    """The server went away mid-calibration, or the user stopped it; what finished is kept and the same command
    resumes."""


@dataclass(frozen=True)
class Progress:
    """Where a calibration stands after a run: runs done of those it has left to do, and the time left."""

    runs_done: int
    runs_total: int
    seconds_left: float
    line: str


@dataclass
class ServerRuns:
    """Samples calibration runs on the server at `client`, counting them against `total` for the progress line."""

    client: ComfyClient
    workflow: CalibrationWorkflow
    key: str  # names the calibration's outputs on the server
    echo: Callable[[str], None] = print
    on_progress: Callable[[Progress], None] | None = None  # called after every run
    should_stop: Callable[[], bool] = lambda: False  # asked before every run: True stops the calibration there
    total: int = 0
    done: int = 0
    _durations: list[float] = field(default_factory=list)

    def sample(self, where: str, label: str, prompt: str, store: str, *, verification: str = "model",
               record: bool = False, steps: int | None = None, mode: str | None = None) -> tuple[Clip, PromptRun]:
        """`prompt` sampled with the store at `store` (see `CalibrationWorkflow.graph_for`); `where` and `label` say
        which run it is in the progress line and name its outputs."""
        if self.should_stop():
            raise CalibrationInterrupted("stopped")
        prefix = f"carnator_calibration/{self.key}/{re.sub('[^a-z0-9]+', '-', f'{where} {label}'.lower()).strip('-')}"
        graph = self.workflow.graph_for(prompt, store, verification=verification, record=record, prefix=prefix,
                                        steps=steps, mode=mode)
        started = time.perf_counter()
        run = self.client.run(graph)
        self._durations.append(time.perf_counter() - started)
        self.done += 1
        left = max(0, self.total - self.done)
        eta = float(np.median(self._durations) * left)
        line = (f"[{where}] {label:<11} {self._durations[-1]:5.1f} s   "
                f"{self.done}/{self.total} runs, about {_minutes(eta)} left")
        self.echo(line)
        if self.on_progress is not None:
            self.on_progress(Progress(self.done, self.total, eta, line))
        return self._clip(run.history), run

    def served(self, store: str) -> str | None:
        """The location of the store at `store` where the server has opened it, else None."""
        stores = self.client.api("/carnator/store/stores").get("stores", [])
        suffix = "/" + store
        return next((s["name"] for s in stores if str(s.get("name", "")).endswith(suffix)), None)

    def entries(self, location: str) -> int:
        query = urllib.parse.urlencode({"store": location})
        return int(self.client.api(f"/carnator/store/stats?{query}").get("entries") or 0)

    def wait_recorded(self, run: PromptRun, count: int) -> str:
        """Waits until the store `run` recorded into holds `count` entries (its writer works in the background);
        the store's location."""
        location = store_location(run.history)
        deadline = time.monotonic() + STORE_WAIT_S
        while self.entries(location) < count:
            if time.monotonic() > deadline:
                raise ExecutionFailed(run.prompt_id, "the run was not recorded in its store", {})
            time.sleep(0.2)
        return location

    def fingerprints(self, location: str) -> dict[str, str | float]:
        """The model and schedule fingerprints and the guidance scale of the runs recorded at `location` (empty
        where it holds none yet)."""
        query = urllib.parse.urlencode({"store": location, "limit": 1})
        entries = self.client.api(f"/carnator/store/entries?{query}").get("entries", [])
        if not entries:
            return {}
        return {"model": entries[0]["model"], "schedule": entries[0]["schedule"],
                "cfg": float(entries[0].get("cfg") or 1.0)}

    def oracle(self, prompt: str, clip: Clip):
        """The registered oracle's verdict on the clip (the demo model's), None where the graph has none."""
        oracle = self.workflow.oracle
        return oracle.score(prompt, oracle.frames(clip.latent[0])) if oracle is not None else None

    def adherence(self, prompt: str, clip: Clip) -> float | None:
        """The oracle's adherence score of the clip (the yardstick's), None where the graph has no oracle."""
        verdict = self.oracle(prompt, clip)
        return None if verdict is None else verdict.adherence

    def _clip(self, history: dict) -> Clip:
        """The run's clip. Where the graph has an oracle (the demo model's), its frames are those the oracle decodes
        (what it scores and `bench workload` measures), not the 8-bit previews, so that both tools measure one
        picture."""
        outputs = history.get("outputs") or {}
        latent = self._saved_latent(outputs[LATENT_NODE])
        audio = self._saved_latent(outputs[AUDIO_NODE]) if AUDIO_NODE in outputs else None
        frames = None
        images = (outputs.get(FRAMES_NODE) or {}).get("images") or []
        if self.workflow.oracle is not None:
            frames = self.workflow.oracle.frames(latent[0])
        elif images:
            frames = torch.stack([_png(self.client.view(image["filename"], image.get("subfolder", ""),
                                                        image.get("type", "temp"))) for image in images])
        return Clip(latent=latent, frames=frames, audio=audio)

    def _saved_latent(self, output: dict) -> torch.Tensor:
        saved = output["latents"][0]
        return load_safetensors(self.client.view(saved["filename"], saved.get("subfolder", ""),
                                                 saved.get("type", "output")))["latent_tensor"].float()


def model_calls(run: PromptRun) -> int:
    """The run's model calls as its reuse nodes report them, every stage's together."""
    return sum(int(report.get("model_calls") or 0) for report in run.statuses if report.get("probes") is not None)


def store_location(history: dict) -> str:
    info = (history.get("outputs") or {}).get(STORE_INFO_NODE) or {}
    return json.loads(info["carnator_store"][0])["store"]


def _png(data: bytes) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as image:
        array = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"

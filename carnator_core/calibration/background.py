"""A calibration beside ComfyUI's queue, in the server's own process: how the graph editor calibrates.

A node runs inside one prompt and cannot wait for the many prompts a calibration queues (they run after it), so the
`CarnatorCalibrate` node starts a `BackgroundCalibration`: a thread that queues the calibration's runs to its own
server through the HTTP API, exactly as the command does, and publishes where it stands. The store panel shows that
(and can stop it); queueing the node again after a stop or a restart resumes from what its output directory keeps.
One calibration runs at a time per server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from carnator_core.calibration.job import CalibrationPlan, NothingToCalibrate, calibrate
from carnator_core.calibration.server_runs import CalibrationInterrupted, Progress
from carnator_core.client import ComfyClient, ComfyError
from carnator_core.queue import WorkflowError

log = logging.getLogger("carnator")


class CalibrationBusy(RuntimeError):
    """A calibration is already running on this server."""


class BackgroundCalibration:
    """The server's one background calibration and its state: `phase` idle, running, stopping, done, stopped,
    interrupted or failed; runs done of the total, the time left, the latest line, and when done the summary."""

    def __init__(self, notify: Callable[[dict[str, Any]], None] | None = None) -> None:
        self._notify = notify
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state: dict[str, Any] = {"phase": "idle"}

    def state(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._state)

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, server_url: str, plan: CalibrationPlan) -> dict[str, Any]:
        """Start calibrating `plan` against the server at `server_url`; CalibrationBusy while another one runs."""
        with self._lock:
            if self.running():
                raise CalibrationBusy(f"calibration {self._state.get('name')!r} is running "
                                      f"({self._state.get('runs_done', 0)}/{self._state.get('runs_total') or '?'} "
                                      "runs); stop it in the Carnator panel, or wait for it to finish")
            self._stop.clear()
            self._state = {"phase": "running", "name": plan.name, "out": str(plan.out), "runs_done": 0,
                           "runs_total": None, "seconds_left": None, "line": "starting", "started_at": time.time()}
            self._thread = threading.Thread(target=self._run, args=(server_url, plan), name="carnator-calibration",
                                            daemon=True)
            self._thread.start()
            state = dict(self._state)
        self._publish(state)
        return state

    def stop(self) -> dict[str, Any]:
        """Ask the running calibration to stop after its current run."""
        if self.running():
            self._stop.set()
            self._update(phase="stopping", line="stopping after the current run")
        return self.state()

    def close(self) -> None:
        """Stop the running calibration after its current run, as the panel's Stop does (`process_state.reset`)."""
        self.stop()

    def _update(self, **changes: Any) -> None:
        with self._lock:
            self._state.update(changes)
            state = dict(self._state)
        self._publish(state)

    def _publish(self, state: dict[str, Any]) -> None:
        if self._notify is not None:
            try:
                self._notify(state)
            except Exception:  # the panel missing an update must not end the calibration
                log.exception("Carnator: could not publish the calibration's progress")

    def _progress(self, progress: Progress) -> None:
        self._update(runs_done=progress.runs_done, runs_total=progress.runs_total,
                     seconds_left=round(progress.seconds_left, 1), line=progress.line.strip())

    def _run(self, server_url: str, plan: CalibrationPlan) -> None:
        try:
            with ComfyClient(server_url) as client:
                calibrated = calibrate(client, plan, echo=lambda line: log.info("Carnator calibration: %s", line),
                                       on_progress=self._progress, should_stop=self._stop.is_set)
            lines = calibrated.lines()
            self._update(phase="done", line=calibrated.profile.reason, summary=lines,
                         profile=calibrated.profile.describe(), in_force=calibrated.profile.in_force, seconds_left=0)
        except CalibrationInterrupted as error:
            if self._stop.is_set():
                self._update(phase="stopped", line="stopped in the Carnator panel; queue the Calibrate node again "
                                                   "to resume")
            else:
                self._update(phase="interrupted", line=f"interrupted ({error}); queue the Calibrate node again to "
                                                       "resume")
        except (NothingToCalibrate, WorkflowError, ComfyError) as error:
            self._update(phase="failed", line=str(error))
        except Exception as error:  # a calibration's failure must never take the server down
            log.exception("Carnator: the calibration failed")
            self._update(phase="failed", line=f"failed: {error} (see the ComfyUI log)")

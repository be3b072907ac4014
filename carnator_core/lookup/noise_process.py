"""The noise process a run samples: which donors' states mean the same to it, whatever their schedules.

A state at noise level σ means the same thing to every run of one model whose mapping from σ to the model's timestep
is the same: the scheduler, the shift and the step count only space the sigmas a run visits. So a donor's state at σ
can continue any request of the same process whose schedule passes through σ, whatever its step count or scheduler:
the request resumes at σ and goes on with its own sigmas below it (`carnator_core.reuse.resume_point`). The mapping
is checked on the donor's own sigmas (the request's model maps them, and must give the timesteps the donor's model
gave), never assumed from a name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from carnator_core.store.entry import EntryMeta

NOISE_PROCESS = "noise_process"  # the entry's `extra` key of its process (`NoiseProcess.record`)
OTHER_PROCESS = "other noise process (σ to timestep)"
OTHER_SCHEDULE = "other sigma schedule"
_RELATIVE_TOLERANCE = 1e-4  # timesteps pass through float32 on either side


@dataclass(frozen=True)
class NoiseProcess:
    """A model's noise process: the kind of sampling it does (its model-sampling classes: flow, eps, v-prediction)
    and its σ-to-timestep mapping, as the host's model gives it."""

    kind: str
    timestep_of: Callable[[Sequence[float]], list[float]]

    def record(self, sigmas: Sequence[float]) -> dict[str, Any]:
        """What an entry keeps of the process it sampled: the kind and the timesteps of its own positive sigmas."""
        positive = [s for s in sigmas if s > 0.0]
        return {"kind": self.kind, "sigmas": [float(s) for s in positive],
                "timesteps": [float(t) for t in self.timestep_of(positive)]}

    def mismatch(self, recorded: Any) -> str | None:
        """Why a donor that recorded `recorded` (`record`'s form) sampled another process, or None when it is this
        one. A missing or malformed record is another process: only an identical schedule then shares states."""
        if not isinstance(recorded, dict) or recorded.get("kind") != self.kind:
            return OTHER_PROCESS
        sigmas, timesteps = recorded.get("sigmas"), recorded.get("timesteps")
        if not (isinstance(sigmas, list) and isinstance(timesteps, list) and len(sigmas) == len(timesteps) > 0
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                        for v in sigmas + timesteps)):
            return OTHER_PROCESS
        mine = self.timestep_of([float(s) for s in sigmas])
        scale = max(1.0, max(abs(float(t)) for t in timesteps))
        if any(abs(a - float(b)) > _RELATIVE_TOLERANCE * scale for a, b in zip(mine, timesteps, strict=True)):
            return OTHER_PROCESS
        return None


def schedule_mismatch(meta: EntryMeta, schedule: str, total_steps: int, process: NoiseProcess | None) -> str | None:
    """Why a donor's states cannot continue a request's schedule, or None when they can. With the request's `process`
    (a run from pure noise, whose schedule may differ from the donor's) a donor that recorded its process must have
    sampled the same one; otherwise (a donor recorded without it, or a run that may not cross schedules: from an input,
    a later stage) only the identical schedule shares states."""
    recorded = meta.extra.get(NOISE_PROCESS)
    if process is not None and recorded is not None:
        return process.mismatch(recorded)
    if meta.hard_key.schedule != schedule or meta.total_steps != total_steps:
        return OTHER_SCHEDULE
    return None

"""The stages of a recorded trajectory, as the store keeps them in one entry.

A request sampled in stages (Wan 2.2 14B's two experts, LTX-2's refinement) is one entry. Its first stage is the
entry itself: hard key, checkpoints under the blob `checkpoints` (step 0's record under `start`), masks under
`masks`, and its output, when it
hands over, as `extra["stage_end"]`. `extra["stages"]` lists the later stages as `StageRecord`s, each with its own
model fingerprint (expert, LoRA and strength), schedule slice, checkpoints numbered within the stage and blobs
`checkpoints_<i>` / `start_<i>` / `masks_<i>`, and, for a stage a later exact repeat may serve, its exact record
(`exact`) and output (`final_<i>`). `stage_entry` presents any stage as an entry of its own, so lookup, planning and
mask loading treat every stage alike. A malformed record is never trusted: it reads as "no such stage".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from carnator_core.store.entry import CheckpointRecord, CorruptEntryError, EntryMeta


def checkpoint_blob(stage: int) -> str:
    """The blob that holds a stage's checkpoint tensors (and, for a stage that hands over, its output)."""
    return "checkpoints" if stage == 0 else f"checkpoints_{stage}"


def start_blob(stage: int) -> str:
    """The blob that holds a stage's step-0 record (prediction and guidance at its first state): small, and all the
    step-0 screen reads of a donor."""
    return "start" if stage == 0 else f"start_{stage}"


def masks_blob(stage: int) -> str:
    """The blob that holds a stage's attention masks."""
    return "masks" if stage == 0 else f"masks_{stage}"


def final_blob(stage: int) -> str:
    """The blob that holds a stage's output at full precision, for an exact repeat (`reuse.exact_repeat`)."""
    return "final" if stage == 0 else f"final_{stage}"


@dataclass(frozen=True)
class StageRecord:
    """One later stage of a trajectory, as `extra["stages"]` keeps it."""

    model: str
    schedule: str
    steps: int
    checkpoints: list[CheckpointRecord]
    masks: dict[str, Any]
    end_sigma: float | None = None  # where the stage ended, when it hands over to another
    exact: dict[str, Any] | None = None  # its exact key and first prediction's digest, where a repeat may be served

    @classmethod
    def parse(cls, record: Any) -> StageRecord | None:
        """The record as read from the store; None when any field is missing or of the wrong type."""
        if not isinstance(record, dict):
            return None
        model, schedule, steps, listing = (record.get("model"), record.get("schedule"), record.get("steps"),
                                           record.get("checkpoints"))
        if not (isinstance(model, str) and isinstance(schedule, str) and isinstance(steps, int) and steps > 0
                and isinstance(listing, list)):
            return None
        try:
            checkpoints = [CheckpointRecord.parse(c) for c in listing]
        except CorruptEntryError:
            return None
        end = record.get("end")
        end_sigma = end.get("sigma") if isinstance(end, dict) else None
        masks = record.get("masks")
        exact = record.get("exact")
        return cls(model=model, schedule=schedule, steps=steps, checkpoints=checkpoints,
                   masks=dict(masks) if isinstance(masks, dict) else {},
                   end_sigma=float(end_sigma) if isinstance(end_sigma, (int, float)) else None,
                   exact=dict(exact) if isinstance(exact, dict) else None)

    def as_dict(self) -> dict[str, Any]:
        record: dict[str, Any] = {"model": self.model, "schedule": self.schedule, "steps": self.steps,
                                  "checkpoints": [c.as_dict() for c in self.checkpoints], "masks": self.masks}
        if self.end_sigma is not None:
            record["end"] = {"sigma": self.end_sigma}
        if self.exact is not None:
            record["exact"] = self.exact
        return record


def _raw_records(meta: EntryMeta) -> list[Any]:
    stages = meta.extra.get("stages")
    return stages if isinstance(stages, list) else []


def trajectory_steps(meta: EntryMeta) -> int:
    """Steps of the whole recorded trajectory: the first stage's and every later stage's."""
    later = 0
    for record in _raw_records(meta):
        steps = record.get("steps") if isinstance(record, dict) else None
        if not isinstance(steps, int) or steps <= 0:
            return meta.total_steps  # a malformed record: the later stages do not count
        later += steps
    return meta.total_steps + later


def stage_entry(meta: EntryMeta, stage: int) -> EntryMeta | None:
    """Stage `stage` of a recorded trajectory as an entry of its own (stage 0 is the entry); None when the entry has
    no such stage or its record is malformed."""
    if stage == 0:
        return meta
    records = _raw_records(meta)
    record = StageRecord.parse(records[stage - 1]) if 0 < stage <= len(records) else None
    if record is None:
        return None
    extra: dict[str, Any] = {"stage": stage, "trajectory_steps": trajectory_steps(meta)}
    if record.end_sigma is not None:
        extra["stage_end"] = {"sigma": record.end_sigma}
    if record.exact is not None:
        extra["exact"] = record.exact
    return replace(meta, hard_key=replace(meta.hard_key, model=record.model, schedule=record.schedule),
                   total_steps=record.steps, checkpoints=list(record.checkpoints), masks=dict(record.masks),
                   lineage={}, extra=extra)


def stage_index(meta: EntryMeta) -> int:
    """Which stage of its trajectory an entry (or a `stage_entry`) stands for."""
    stage = meta.extra.get("stage", 0)
    return stage if isinstance(stage, int) else 0

"""What the store keeps about one finished request, as JSON-safe metadata.

The metadata is the entry's commit record: it is written last, in the same transaction
as the entry's blobs, so a reader that sees it can rely on every blob it names.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA_VERSION = 1
OTHER_SCOPE = "other scope"  # never counted or named where a user reads it: another user's entries stay unseen


class CorruptEntryError(ValueError):
    """An entry's metadata is unreadable or inconsistent; the entry is skipped."""


@dataclass(frozen=True)
class CheckpointRecord:
    """What an entry's metadata says of one recorded checkpoint; its tensors are in the entry's blobs, under the names
    `carnator_core.store.tensor_names` gives."""

    step: int
    sigma: float
    guidance: bool = False  # whether its guidance (cond - uncond) was kept
    evaluated: bool = True  # False: its prediction is a step cache's extrapolation (EasyCache skipped the step)
    start: str | None = None  # step 0: the fingerprint of the state the run started from

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (`start` only where it is set, as step 0's record has it)."""
        record: dict[str, Any] = {"step": self.step, "sigma": self.sigma, "guidance": self.guidance,
                                  "evaluated": self.evaluated}
        if self.start is not None:
            record["start"] = self.start
        return record

    @classmethod
    def parse(cls, record: Any) -> CheckpointRecord:
        """The record behind its JSON form; CorruptEntryError where a field is missing or of the wrong type."""
        if not isinstance(record, dict):
            raise CorruptEntryError("a checkpoint record is not an object")
        step, sigma, start = record.get("step"), record.get("sigma"), record.get("start")
        if (not isinstance(step, int) or isinstance(step, bool) or step < 0 or isinstance(sigma, bool)
                or not isinstance(sigma, (int, float)) or not (start is None or isinstance(start, str))):
            raise CorruptEntryError("a checkpoint record lacks its step or sigma, or has a malformed start")
        return cls(step=step, sigma=float(sigma), guidance=bool(record.get("guidance", False)),
                   evaluated=bool(record.get("evaluated", True)), start=start)


@dataclass(frozen=True)
class HardKey:
    """What a donor must share exactly with a request to be a candidate at all: its model, token grid and frame rate.
    The schedule is kept (calibration profiles are per schedule) but does not decide: a donor of another schedule of
    the same noise process can serve (`carnator_core.lookup.noise_process`)."""

    model: str
    grid: tuple[int, ...]
    schedule: str
    # Frames per second the conditioning gives the model (LTX-Video, LTX-2), 0 where it gives none: the model spaces
    # the token grid's positions in time by it, so another frame rate is another grid.
    frame_rate: float = 0.0
    # Whose work it is (`carnator_core.store.scopes`): "" for a single-user ComfyUI (and every entry written before
    # scopes), else the user that queued it, under the fleet's namespace. A donor of another scope is never seen.
    scope: str = ""

    def mismatch(self, other: HardKey) -> str | None:
        """Why `other` is not compatible with this key, or None when it is.

        An empty field on this key matches anything there: a plan whose candidates the lookup already matched on
        model and grid (with its frame rate); but the scope always decides (`OTHER_SCOPE`, which no report names).
        """
        if other.scope != self.scope:
            return OTHER_SCOPE
        if self.model and other.model != self.model:
            return "other model"
        if self.grid and other.grid != self.grid:
            return "other token grid"
        if self.grid and other.frame_rate != self.frame_rate:
            return "other frame rate"
        return None


@dataclass
class EntryMeta:
    """Metadata of one recorded request. Blob names refer to keys under the entry's id."""

    entry_id: str
    hard_key: HardKey
    prompt: str = ""
    created_at: float = field(default_factory=time.time)
    latent_shape: tuple[int, ...] = ()
    noise_fingerprint: str = ""
    cfg: float = 1.0
    seed: int | None = None
    total_steps: int = 0
    sample_seconds: float = 0.0
    checkpoints: list[CheckpointRecord] = field(default_factory=list)
    masks: dict[str, Any] = field(default_factory=dict)
    lineage: dict[str, Any] = field(default_factory=dict)
    blob_bytes: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex

    @property
    def total_bytes(self) -> int:
        return sum(self.blob_bytes.values())

    def to_json(self) -> str:
        record = asdict(self)
        record["checkpoints"] = [checkpoint.as_dict() for checkpoint in self.checkpoints]
        record["schema_version"] = SCHEMA_VERSION
        return json.dumps(record, sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> EntryMeta:
        try:
            record = json.loads(text)
            if not isinstance(record, dict):
                raise TypeError("metadata is not a JSON object")
            if record.pop("schema_version", None) != SCHEMA_VERSION:
                raise ValueError("metadata written by another schema version")
            key = record.pop("hard_key")
            hard_key = HardKey(model=str(key["model"]), grid=tuple(int(v) for v in key["grid"]),
                               schedule=str(key["schedule"]), frame_rate=float(key.get("frame_rate", 0.0)),
                               scope=str(key.get("scope", "")))
            record["latent_shape"] = tuple(int(v) for v in record.get("latent_shape", ()))
            record["checkpoints"] = [CheckpointRecord.parse(c) for c in record.get("checkpoints", [])]
            meta = cls(hard_key=hard_key, **record)
        except (TypeError, ValueError, KeyError, json.JSONDecodeError) as error:
            raise CorruptEntryError(f"unreadable entry metadata: {error}") from error
        if not meta.entry_id or not all(isinstance(v, int) and v >= 0 for v in meta.blob_bytes.values()):
            raise CorruptEntryError("entry metadata lacks an id or has invalid blob sizes")
        return meta

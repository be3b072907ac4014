"""One request sampled in stages (Wan 2.2 14B's two experts, each in its own KSamplerAdvanced) as one trajectory.

A stage that ends with leftover noise hands its output to the next sampler. That output is identified by its
content (`content_fingerprint`), never by timing: the next run continues the trajectory only when its input latent
is that very tensor (an edit in between, another size or seed is another tensor), it adds no fresh noise and it
starts at the sigma the stage ended at. Hand-overs live in this process (`handover_registry`), so a latent that comes
from another process or server is not a known stage output: that run samples plain and says why.

The request is recorded as one entry. Its first stage is the entry itself (hard key, checkpoints, masks), so it is
found and planned like any other entry; its output is kept as the tensor `end` of the checkpoint blob
(`extra["stage_end"]`); the later stages are records in the same entry (`carnator_core.store.stages`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from carnator_core import process_state
from carnator_core.lookup.fingerprint import content_fingerprint
from carnator_core.reuse.cached_evaluation import same_sigma
from carnator_core.reuse.recording import PendingEntry, entry_writer
from carnator_core.reuse.start_difference import StartDifference
from carnator_core.reuse.targets import StageEnd
from carnator_core.store.entry import EntryMeta, HardKey
from carnator_core.store.stages import (
    StageRecord,
    checkpoint_blob,
    final_blob,
    masks_blob,
    stage_index,
    start_blob,
    trajectory_steps,
)
from carnator_core.store.tensor_names import END_TENSOR
from carnator_core.store.thumbnail import PreviewFrame

log = logging.getLogger("carnator.trajectory")


def stage_end_of(meta: EntryMeta, tensors: dict[str, torch.Tensor] | None,
                 latent_shape: tuple[int, ...]) -> StageEnd | None:
    """The output of an entry's first stage, when recorded, finite, of the live latent's shape and followed by a
    recorded later stage (a skip's depth is measured against the whole trajectory). Later stages are continued,
    never skipped whole."""
    record = meta.extra.get("stage_end")
    latent = tensors.get(END_TENSOR) if tensors is not None else None
    if stage_index(meta) or not isinstance(record, dict) or not isinstance(record.get("sigma"), (int, float)):
        return None
    if latent is None or tuple(latent.shape) != tuple(latent_shape) or not bool(torch.isfinite(latent).all()):
        return None
    total = trajectory_steps(meta)
    if total <= meta.total_steps:
        return None
    return StageEnd(sigma=float(record["sigma"]), latent=latent, stage_steps=meta.total_steps, trajectory_steps=total)


@dataclass
class Handover:
    """What a stage that ended with leftover noise leaves for the sampler that continues it."""

    sigma: float  # where the stage ended: the next stage must start there
    next_stage: int  # the index the continuing stage gets in the trajectory
    next_step: int  # the trajectory step it starts at
    pending: PendingEntry | None  # the request's entry so far (None when not recording)
    donor: EntryMeta | None = None  # the donor whose stage output this stage returned (it was skipped to it)
    mask_donor: str | None = None  # the entry whose next stage lends its attention masks
    # what the request's step 0 differs by from `donor`'s: the donor's later states are continued corrected by it
    difference: StartDifference | None = None
    repeated: EntryMeta | None = None  # the entry whose stages so far this request repeated exactly
    created_at: float = field(default_factory=time.monotonic)


# Why a run whose input is a stage output is not its continuation: another sampler took it first (a second sampler on
# the same output, or another request fed it, e.g. through ComfyUI's cache of an unchanged first stage)
CONTINUED_BEFORE = ("its input is a stage output another sampler already continued (a second sampler on it, or "
                    "another request's): a run from an input, not a continuation")


class HandoverRegistry:
    """Stage outputs waiting for the sampler that continues them, by content fingerprint (one process).

    An output nobody continues (the next expert has no Carnator node, the graph ends there) is recorded as it is
    once displaced or stale, so the request's first stage is never lost.
    """

    def __init__(self, capacity: int = 8, max_age_s: float = 600.0) -> None:
        self.capacity = capacity
        self.max_age_s = max_age_s
        self._waiting: OrderedDict[str, Handover] = OrderedDict()
        self._continued: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def park(self, fingerprint: str, handover: Handover) -> None:
        with self._lock:
            self._release_stale()
            self._waiting[fingerprint] = handover
            self._waiting.move_to_end(fingerprint)
            while len(self._waiting) > self.capacity:
                _, oldest = self._waiting.popitem(last=False)
                self._record_alone(oldest)

    def claim(self, fingerprint: str) -> tuple[Handover | None, str]:
        """The hand-over of this stage output, taken by the run that continues it; else None and why ("" when the
        latent is no stage output this process knows)."""
        with self._lock:
            self._release_stale()
            handover = self._waiting.pop(fingerprint, None)
            if handover is not None:
                self._continued[fingerprint] = None
                while len(self._continued) > 4 * self.capacity:
                    self._continued.popitem(last=False)
                return handover, ""
            if fingerprint in self._continued:
                return None, CONTINUED_BEFORE
            return None, ""

    def give_back(self, fingerprint: str, handover: Handover) -> None:
        """Return an unclaimed hand-over (the continuing run could not take it) so it is recorded as it is."""
        with self._lock:
            self._continued.pop(fingerprint, None)
        self.park(fingerprint, handover)

    def flush(self) -> None:
        """Record every waiting first stage as it is (tests, benchmarks, shutdown)."""
        with self._lock:
            waiting, self._waiting = list(self._waiting.values()), OrderedDict()
        for handover in waiting:
            self._record_alone(handover)

    def _release_stale(self) -> None:
        now = time.monotonic()
        for fingerprint in [fp for fp, h in self._waiting.items() if now - h.created_at > self.max_age_s]:
            self._record_alone(self._waiting.pop(fingerprint))

    @staticmethod
    def _record_alone(handover: Handover) -> None:
        if handover.pending is not None:
            log.info("Carnator: no sampler continued stage %d; recording the request up to there",
                     handover.next_stage - 1)
            entry_writer().submit(handover.pending)


def handover_registry() -> HandoverRegistry:
    """The process's stage outputs waiting to be continued (`process_state`)."""
    return process_state.one("stage hand-overs", HandoverRegistry)


def append_stage(pending: PendingEntry, stage: int, hard_key: HardKey, steps: int, listing: list[dict],
                 blobs: dict[str, bytes], masks: dict[str, Any], end_sigma: float | None,
                 thumbnail: PreviewFrame | None, exact: dict[str, Any] | None = None) -> None:
    """Add a later stage's record (with its exact record, where a repeat may be served), blobs and preview (the last
    stage's previews the request) to the request's entry so far."""
    record = StageRecord(model=hard_key.model, schedule=hard_key.schedule, steps=steps, checkpoints=listing,
                         masks=masks, end_sigma=end_sigma, exact=exact)
    pending.meta.extra.setdefault("stages", []).append(record.as_dict())
    names = {"checkpoints": checkpoint_blob(stage), "start": start_blob(stage), "masks": masks_blob(stage),
             "final": final_blob(stage)}
    for name, blob in blobs.items():
        pending.blobs[names.get(name, name)] = blob
    if thumbnail is not None:
        pending.thumbnail = thumbnail


def continued_stage(latent_image: torch.Tensor, noise: torch.Tensor,
                    first_sigma: float) -> tuple[Handover | None, str, str]:
    """The hand-over a run continues when its input latent is a stage output this process handed over, it adds no
    noise and starts where that stage ended (else None: the run starts from an input like any other); with why latent
    reuse does not apply to the continuation ("" when it may), and a note for the report when the input was a stage
    output that another sampler continued first."""
    if torch.count_nonzero(latent_image) == 0:
        return None, "", ""
    fingerprint = content_fingerprint(latent_image)
    handovers = handover_registry()
    handover, note = handovers.claim(fingerprint)
    if handover is None:
        return None, "", note
    if torch.count_nonzero(noise) or not same_sigma(handover.sigma, first_sigma):
        handovers.give_back(fingerprint, handover)
        return None, "", ""
    if handover.donor is None:
        return handover, "continues a stage that sampled in full: latent reuse off for this stage", ""
    return handover, "", ""

"""Trajectories across samplers: stage views of a recorded entry, stage outputs, and the hand-over registry.

Stage records come from the store, so a malformed one must read as "no such stage", never raise; a hand-over is
taken once, and a first stage nobody continues is still recorded.
"""

from __future__ import annotations

import pytest
import torch

from carnator_core.judging.probe_signals import ProbeSignals
from carnator_core.lookup.shortlist import Candidate
from carnator_core.reuse.decision import Decider
from carnator_core.reuse.plan import RequestFacts, plan_probes
from carnator_core.reuse.recording import PendingEntry, entry_writer
from carnator_core.reuse.settings import ReuseSettings
from carnator_core.reuse.start_difference import StartDifference
from carnator_core.reuse.targets import ProbeTarget, StageEnd
from carnator_core.reuse.trajectory import (
    CONTINUED_BEFORE,
    Handover,
    HandoverRegistry,
    stage_end_of,
)
from carnator_core.store.entry import CheckpointRecord, EntryMeta, HardKey
from carnator_core.store.reuse_store import IndexVectors, ReuseStore
from carnator_core.store.stages import stage_entry, trajectory_steps
from carnator_core.store.tensor_codec import encode_tensors
from carnator_core.store.tensor_names import END_TENSOR

SHAPE = (1, 16, 2, 8, 8)
KEY = HardKey("high-noise", (2, 4, 4), "first-half")
SECOND = {"model": "low-noise", "schedule": "second-half", "steps": 2,
          "checkpoints": [{"step": 0, "sigma": 0.5, "start": "boundary"}, {"step": 1, "sigma": 0.25}], "masks": {}}


def _meta(*stages, stage_end: bool = True) -> EntryMeta:
    extra = {"stages": list(stages)}
    if stage_end:
        extra["stage_end"] = {"sigma": 0.5}
    return EntryMeta(entry_id=EntryMeta.new_id(), hard_key=KEY, latent_shape=SHAPE, total_steps=2,
                     checkpoints=[CheckpointRecord(step=0, sigma=1.0, start="noise"), CheckpointRecord(step=1, sigma=0.75)],
                     extra=extra)


def test_a_later_stage_reads_as_an_entry_of_its_own_model_schedule_and_steps():
    meta = _meta(SECOND)
    view = stage_entry(meta, 1)
    assert view.hard_key == HardKey("low-noise", KEY.grid, "second-half") and view.total_steps == 2
    assert view.entry_id == meta.entry_id and [c.step for c in view.checkpoints] == [0, 1]
    assert view.lineage == {} and view.extra["stage"] == 1 and view.extra["trajectory_steps"] == 4
    assert stage_entry(meta, 0) is meta and trajectory_steps(meta) == 4


@pytest.mark.parametrize("record", [
    "not a dict", {**SECOND, "model": 7}, {**SECOND, "steps": 0}, {**SECOND, "steps": "2"},
    {**SECOND, "checkpoints": [{"step": "one", "sigma": 0.2}]}, {**SECOND, "checkpoints": None},
])
def test_a_malformed_stage_record_is_no_stage(record):
    meta = _meta(record)
    assert stage_entry(meta, 1) is None
    assert stage_entry(meta, 2) is None and stage_entry(_meta(), 1) is None
    if not isinstance(record, dict) or not isinstance(record.get("steps"), int) or record["steps"] <= 0:
        assert trajectory_steps(meta) == 2  # a record without usable steps does not count


def test_a_stage_output_serves_a_skip_only_when_usable_and_followed_by_a_later_stage():
    latent = torch.randn(SHAPE)
    end = stage_end_of(_meta(SECOND), {END_TENSOR: latent}, SHAPE)
    assert end.sigma == 0.5 and torch.equal(end.latent, latent) and end.share == 0.5
    assert stage_end_of(_meta(), {END_TENSOR: latent}, SHAPE) is None  # nothing recorded after it
    assert stage_end_of(_meta(SECOND, stage_end=False), {END_TENSOR: latent}, SHAPE) is None
    assert stage_end_of(_meta(SECOND), {END_TENSOR: latent[:, :8]}, SHAPE) is None
    assert stage_end_of(_meta(SECOND), {END_TENSOR: latent * float("nan")}, SHAPE) is None
    assert stage_end_of(_meta(SECOND), {}, SHAPE) is None
    assert stage_end_of(stage_entry(_meta({**SECOND, "end": {"sigma": 0.1}}), 1), {END_TENSOR: latent}, SHAPE) is None


def _pending(store: ReuseStore) -> PendingEntry:
    meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=KEY, latent_shape=SHAPE, total_steps=2)
    return PendingEntry(store=store, meta=meta, blobs={}, cond_vector=torch.ones(8))


def test_a_handover_is_taken_once(tmp_path):
    registry = HandoverRegistry()
    handover = Handover(sigma=0.5, next_stage=1, next_step=2, pending=None)
    registry.park("output", handover)
    assert registry.claim("output") == (handover, "")
    again, why = registry.claim("output")
    assert again is None and why == CONTINUED_BEFORE
    assert registry.claim("unknown") == (None, "")


def test_a_first_stage_nobody_continues_is_recorded_when_displaced_stale_or_flushed(tmp_path):
    store = ReuseStore(str(tmp_path / "store"))
    registry = HandoverRegistry(capacity=1)
    first, second, third = (_pending(store) for _ in range(3))
    registry.park("a", Handover(sigma=0.5, next_stage=1, next_step=2, pending=first))
    registry.park("b", Handover(sigma=0.5, next_stage=1, next_step=2, pending=second))  # displaces "a"
    entry_writer().flush()
    assert store.get_meta(first.meta.entry_id) is not None and store.get_meta(second.meta.entry_id) is None
    registry.flush()
    entry_writer().flush()
    assert store.get_meta(second.meta.entry_id) is not None
    stale = HandoverRegistry(max_age_s=0.0)
    stale.park("c", Handover(sigma=0.5, next_stage=1, next_step=2, pending=third, created_at=0.0))
    assert stale.claim("c") == (None, "")  # too old to continue: recorded as it is
    entry_writer().flush()
    assert store.get_meta(third.meta.entry_id) is not None


def test_a_later_stage_plans_only_against_the_same_stage_of_the_same_model(tmp_path):
    store = ReuseStore(str(tmp_path / "store"))
    facts = RequestFacts(schedule="second-half", latent_shape=SHAPE, noise_fingerprint="", total_steps=2, stage=1,
                         model="low-noise", first_step=2, trajectory_steps=4)
    candidates = []
    for record in (SECOND, {**SECOND, "model": "other expert"}, {**SECOND, "steps": -1}):
        meta = _meta(record)
        tensors = {"x_1": torch.randn(SHAPE), "x0_1": torch.randn(SHAPE), "x0_0": torch.randn(SHAPE)}
        store.put(meta, {"checkpoints": encode_tensors({"x_1": torch.randn(SHAPE), "x0_1": torch.randn(SHAPE)}),
                         "checkpoints_1": encode_tensors(tensors)}, IndexVectors(text=None, cond=torch.ones(8)))
        candidates.append(Candidate(entry_id=meta.entry_id, prompt="", score=1.0, cond_similarity=1.0,
                                    text_similarity=None))
    targets, skipped = plan_probes(store, candidates, facts, max_fraction=0.8, same_noise_only=False, max_probes=4)
    assert [(t.meta.entry_id, t.step) for t in targets] == [(candidates[0].entry_id, 1)]
    assert skipped == {"other model": 1, "donor has no such stage": 1}
    none, _ = plan_probes(store, candidates[:1], facts, max_fraction=0.5, same_noise_only=False, max_probes=4)
    assert none == []  # balanced ends at step 2 of 4: the boundary itself


def test_a_stage_is_skipped_to_the_donor_the_request_agrees_with_most(tmp_path):
    decider = Decider(settings=ReuseSettings(mode="balanced"), facts=RequestFacts(
        schedule="schedule", latent_shape=SHAPE, noise_fingerprint="noise", total_steps=2), sigmas=[1.0, 0.75, 0.5])
    targets = []
    difference = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3)) * 0.1
    for name, structure in (("edit", 0.90), ("rewording", 0.99), ("weak", 0.86)):
        meta = _meta(SECOND)
        end = StageEnd(sigma=0.5, latent=torch.randn(SHAPE), stage_steps=2, trajectory_steps=4)
        candidate = Candidate(entry_id=meta.entry_id, prompt=name, score=1.0, cond_similarity=1.0,
                              text_similarity=None)
        targets.append(ProbeTarget(candidate=candidate, meta=meta, step=1, sigma=0.75, x=torch.randn(SHAPE),
                                   x0=torch.randn(SHAPE), guidance=None, end=end))
        signals = ProbeSignals(depth=0.0, raw_agreement=structure, structure_agreement=structure,
                               guidance_cosine=None)
        decider._screened[meta.entry_id] = (signals, StartDifference(sigma=1.0, x0=difference, guidance=None))
    resume = decider._skip_stage(targets)
    assert resume.target.candidate.prompt == "rewording" and resume.step == 2
    # the donor's output, corrected as far as the stage moved (sigma 1.0 to 0.5) by what step 0 differed by
    assert torch.allclose(resume.end.latent, targets[1].end.latent + 0.5 * difference)
    assert resume.difference is decider._screened[targets[1].meta.entry_id][1]
    # "weak" passes the depth-0 screen (0.85) but not the thresholds at the depth the skip reaches (0.5 of 4 steps)
    decider._screened = {targets[2].meta.entry_id: decider._screened[targets[2].meta.entry_id]}
    assert decider._skip_stage(targets) is None


def test_with_cfg_guidance_only_a_difference_of_first_states_is_corrected_for():
    x0 = torch.randn(SHAPE, generator=torch.Generator().manual_seed(4))
    assert StartDifference(sigma=1.0, x0=x0, guidance=None).without_prediction() is None
    state = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))
    kept = StartDifference(sigma=1.0, x0=x0, guidance=torch.ones(SHAPE), state=state).without_prediction()
    assert kept.guidance is None and not kept.x0.any() and kept.state is state
    donor_state = torch.zeros(SHAPE)
    assert torch.allclose(kept.state_at(donor_state, 0.25), 0.25 * state)  # a quarter of the start difference left

"""The plan of one request: which donor checkpoints are worth a probe, deepest first across donors.

A probe costs one model evaluation, so the planner filters by everything that is certain
without the model (schedule, latent shape, initial noise under the seed policy, mode
depth) and hands the sampler a short, ordered list.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from carnator_core.lookup.noise_process import NoiseProcess, schedule_mismatch
from carnator_core.lookup.shortlist import Candidate
from carnator_core.reuse.input_start import GUIDE_IMAGE, INPUT_START, input_mismatch
from carnator_core.reuse.packed_latent import PackedShapes
from carnator_core.reuse.resume_point import resume_point
from carnator_core.reuse.targets import ProbeTarget, StartPrediction
from carnator_core.reuse.trajectory import stage_end_of
from carnator_core.store.entry import OTHER_SCOPE, CheckpointRecord, EntryMeta, HardKey
from carnator_core.store.reuse_store import ReuseStore
from carnator_core.store.stages import checkpoint_blob, stage_entry, stage_index, start_blob
from carnator_core.store.tensor_names import (
    GUIDE_TENSOR,
    INPUT_TENSOR,
    guidance_tensor,
    prediction_tensor,
    state_tensor,
)

log = logging.getLogger("carnator.planner")

OTHER_SEED = "other initial noise (seed)"  # why a donor is left out under seed policy same-noise


@dataclass
class RequestFacts:
    """What the planner needs to know of the live request."""

    schedule: str
    latent_shape: tuple[int, ...]
    noise_fingerprint: str
    total_steps: int
    # A stage of a trajectory (`carnator_core.reuse.trajectory`) plans against the donors' same stage, made by the
    # same model, and its depth counts in the whole trajectory's steps.
    stage: int = 0
    model: str = ""
    first_step: int = 0
    trajectory_steps: int | None = None
    packed: PackedShapes | None = None  # the latents packed into this run's one (LTX-2's video and audio)
    # the input a run that starts from one was given (`carnator_core.reuse.input_start`); None: from pure noise
    input_latent: torch.Tensor | None = None
    # the image the conditioning carries (`concat_latent_image`); None for a run guided by text alone
    guide_image: torch.Tensor | None = None
    sigmas: tuple[float, ...] = ()  # the run's schedule: where each donor state enters it (`resume_point`)
    scope: str = ""  # whose donors it may take (`HardKey.scope`)
    noise_process: NoiseProcess | None = None  # the model's; None: donors of the identical schedule only

    @property
    def from_input(self) -> bool:
        return self.input_latent is not None

    @property
    def crossing_process(self) -> NoiseProcess | None:
        """The process a donor of another schedule must share: a first stage from pure noise only (a run from an
        input, or a later stage, continues what started at its own first sigma, so only its schedule fits)."""
        return self.noise_process if self.stage == 0 and not self.from_input and self.sigmas else None

    def max_step(self, fraction: float) -> int:
        """The deepest step of this run a resume limited to `fraction` of the (trajectory's) schedule may start at."""
        return last_step_within(fraction, self.trajectory_steps or self.total_steps) - self.first_step


class Offer(NamedTuple):
    """One donor checkpoint a resume could start from, as the plan orders them (deepest, then best-ranked first):
    `step` is where it enters the request's schedule, `donor_step` where the donor recorded it."""

    step: int
    rank: int  # the donor's place in the lookup's ranking
    sigma: float
    candidate: Candidate
    meta: EntryMeta
    donor_step: int


MAX_LINEAGE = 4  # donors of donors searched for a shallow checkpoint to confirm a deep probe (ProbeTarget.anchor)


def last_step_within(fraction: float, total_steps: int) -> int:
    """The deepest step a resume limited to `fraction` of the schedule may start at (rounding-safe)."""
    return int(fraction * total_steps + 1e-9)


def _usable(tensor: torch.Tensor | None, shape: tuple[int, ...] | None) -> bool:
    return tensor is not None and (shape is None or tuple(tensor.shape) == shape) and bool(torch.isfinite(tensor).all())


@dataclass
class _Reads:
    """What one plan has read from the store (each donor's checkpoint blob, once) and why it skipped donors."""

    store: ReuseStore
    facts: RequestFacts
    skipped: dict[str, int] = field(default_factory=dict)
    blobs: dict[str, dict[str, torch.Tensor] | None] = field(default_factory=dict)

    def skip(self, reason: str, meta: EntryMeta | None = None) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if meta is not None:
            log.info("Carnator: donor %s skipped: %s", meta.entry_id[:8], reason)


def plan_probes(store: ReuseStore, candidates: list[Candidate], facts: RequestFacts, max_fraction: float,
                same_noise_only: bool, max_probes: int,
                contained_fraction: float | None = None) -> tuple[list[ProbeTarget | ScreenOnly], dict[str, int]]:
    """Up to `max_probes` targets, deepest checkpoint first and, at equal depth, the better-ranked donor first,
    plus skip reasons.

    Depth before donor: probing one donor at every depth first would spend the whole budget on it when it is
    the wrong one, while a better donor ranked second would have passed at the first depth. Checkpoints
    recorded at a step EasyCache or LazyCache skipped are never offered: their x0 is the cache's extrapolation,
    which no probe of the live model can confirm. Checkpoint blobs are read only for the donors the plan keeps;
    same-noise donors beyond them follow as `ScreenOnly` entries, for the step-0 screen.

    With `contained_fraction` (the depth of the shallower mode this one contains: balanced's, for fast) the budget's
    targets are chosen within that depth first, exactly as that mode chooses them, and every deeper state of the
    donors chosen follows them: what this mode may ask once one of them passed (`Decider._deepen`), or first where
    the step-0 screen makes a pass nearly certain.
    """
    reads = _Reads(store, facts)
    offers = donor_offers(reads, candidates, facts.max_step(max_fraction), same_noise_only)
    contained_step = facts.max_step(contained_fraction) if contained_fraction is not None else None

    def deeper(offer: Offer) -> bool:
        return contained_step is not None and offer.step > contained_step

    # stable: within the contained depth first, each part still deepest first
    targets = _collect(reads, iter(sorted(offers, key=deeper)), max_probes)
    chosen = {target.meta.entry_id for target in targets}
    taken = {(target.meta.entry_id, target.step) for target in targets}
    targets += _collect(reads, (offer for offer in offers if deeper(offer) and offer.meta.entry_id in chosen
                                and (offer.meta.entry_id, offer.step) not in taken), len(offers))
    targets.sort(key=lambda target: -target.step)  # stable: at equal depth the better-ranked donor first
    return targets + _screen_only(reads, offers, targets, deeper), reads.skipped


@dataclass
class ScreenOnly:
    """A same-noise donor beyond the probe budget, offered to the step-0 screen only. Only its step-0 record is read
    while planning; its states (`load`) are read once the screen passes it, so screening many donors reads a
    step-0 record each, not their checkpoints."""

    candidate: Candidate
    meta: EntryMeta
    start: StartPrediction
    # its deepest checkpoint within the (contained) mode's depth, where it would be probed, then any deeper ones the
    # mode may go on to
    steps: list[Offer]
    _reads: _Reads = field(repr=False)

    def load(self) -> list[ProbeTarget]:
        """The donor's states to probe and resume from (each with its anchor); none that is unusable."""
        loaded = (_load_target(self._reads, offer) for offer in self.steps)
        return sorted((target for target in loaded if target is not None), key=lambda target: -target.step)


def _screen_only(reads: _Reads, offers: list[Offer], targets: list[ProbeTarget],
                 deeper: Callable[[Offer], bool]) -> list[ScreenOnly]:
    """Each same-noise donor that `targets` leave out and that recorded its step 0: the step-0 screen judges all of
    them in the one call the request makes anyway. None of them costs a probe call unless the screen passes it."""
    have = {target.meta.entry_id for target in targets}
    extra = []
    for deepest in _deepest_of_each_donor(sorted(offers, key=deeper)):
        meta = deepest.meta
        if meta.entry_id in have or not deepest.candidate.same_noise or \
                meta.noise_fingerprint != reads.facts.noise_fingerprint:
            continue
        start = _start_for(reads, meta)
        if start is None:
            reads.skip("no step-0 record to screen", meta)
            continue
        steps = [deepest] + [offer for offer in offers if deeper(offer) and offer.meta.entry_id == meta.entry_id
                             and offer.step != deepest.step]
        extra.append(ScreenOnly(candidate=deepest.candidate, meta=meta, start=start, steps=steps, _reads=reads))
    return extra


def lacking_states(planned: list[ProbeTarget | ScreenOnly], recorded_steps: Callable[[int], list[int]],
                   max_step: int, total_steps: int) -> list[str]:
    """A note per planned donor of the request's step count that lacks states a run of its schedule records within
    the depth the plan may resume at (`recorded_steps(total_steps)`, the steps a full run records; a donor that itself
    resumed holds none before its resume step): such a donor is probed only at the states it holds, and the report
    says which it lacked."""
    notes, seen = [], set()
    for target in planned:
        meta = target.meta
        if meta.entry_id in seen or meta.total_steps != total_steps:
            continue
        seen.add(meta.entry_id)
        held = {c.step for c in meta.checkpoints}
        resumed_at = int(meta.lineage.get("depth", 0) or 0)
        lacked = [step for step in recorded_steps(meta.total_steps) if resumed_at < step <= max_step and step not in held]
        if lacked:
            notes.append(f"donor {meta.entry_id[:8]} lacks its states at step{'s' if len(lacked) > 1 else ''} "
                         f"{', '.join(map(str, lacked))}: probed only at those it holds")
    return notes


def donor_offers(reads: _Reads, candidates: list[Candidate], max_step: int, same_noise_only: bool) -> list[Offer]:
    """Every donor checkpoint a resume could start from, by what is certain without the model, deepest first and,
    at equal depth, the better-ranked donor first; each donor left out counts one skip reason."""
    offers: list[Offer] = []
    for rank, candidate in enumerate(candidates):
        meta = reads.store.get_meta(candidate.entry_id)
        if meta is None:
            reads.skip("entry vanished or corrupt")
            continue
        meta = stage_entry(meta, reads.facts.stage)
        if meta is None:
            reads.skip("donor has no such stage")
            continue
        reason = _incompatibility(meta, reads.facts, same_noise_only)
        if reason == OTHER_SCOPE:
            continue  # not this user's: skipped unseen, as the lookup never offers it
        if reason is None and (reads.facts.from_input or reads.facts.guide_image is not None):
            start = _start_for(reads, meta)
            if reads.facts.from_input:
                reason = input_mismatch(reads.facts.input_latent, start.input if start is not None else None)
            if reason is None and reads.facts.guide_image is not None:
                reason = input_mismatch(reads.facts.guide_image, start.guide if start is not None else None,
                                        "conditioning image")
        if reason is None:
            entering, reason = _resumable_checkpoints(meta, reads.facts, max_step)
        if reason is not None:
            reads.skip(reason, meta)
            continue
        offers += [Offer(step, rank, sigma, candidate, meta, c.step) for c, step, sigma in entering]
    offers.sort(key=lambda offer: (-offer.step, offer.rank))
    return offers


def _incompatibility(meta: EntryMeta, facts: RequestFacts, same_noise_only: bool) -> str | None:
    """Why no state of this donor can continue the live request (another model where the stage names one, sigma
    schedule, latent shape or, when only the same noise counts, initial noise), or None when its states can."""
    reason = HardKey(model=facts.model, grid=(), schedule="", scope=facts.scope).mismatch(meta.hard_key) or \
        schedule_mismatch(meta, facts.schedule, facts.total_steps, facts.crossing_process)
    if reason is not None:
        return reason
    if tuple(meta.latent_shape) != tuple(facts.latent_shape):
        return "other latent shape (batch or size)"
    if same_noise_only and meta.noise_fingerprint != facts.noise_fingerprint:
        return OTHER_SEED
    if bool(meta.extra.get(INPUT_START)) != facts.from_input:
        return "started from an input latent" if facts.input_latent is None else "started from pure noise"
    if bool(meta.extra.get(GUIDE_IMAGE)) != (facts.guide_image is not None):
        return "guided by an image" if facts.guide_image is None else "not guided by an image"
    return None


def _resumable_checkpoints(meta: EntryMeta, facts: RequestFacts,
                           max_step: int) -> tuple[list[tuple[CheckpointRecord, int, float]], str | None]:
    """The donor's checkpoints a resume may start from, each with the request step it enters at and the sigma it
    resumes at: past the donor's step 0, where the request's schedule reaches it (`resume_point`; the donor's own
    step where the schedules are one), within the mode's depth of the request's schedule and evaluated by the model
    (not a step cache's extrapolation); with the reason when there is none."""
    recorded = [c for c in meta.checkpoints if c.step > 0]
    entering = [(c, *point) for c in recorded if (point := _entry_point(facts, c)) is not None]
    if recorded and not entering:
        return [], "the schedule does not reach the donor's states"
    within = [(c, step, sigma) for c, step, sigma in entering if 0 < step <= max_step]
    evaluated = [item for item in within if item[0].evaluated]
    if evaluated:
        return evaluated, None
    if not within:
        return [], "no checkpoint within the mode's depth"
    return [], "its checkpoints hold a step cache's extrapolation, not the model's"


def _entry_point(facts: RequestFacts, checkpoint: CheckpointRecord) -> tuple[int, float] | None:
    """The request step a donor checkpoint enters at and the sigma it resumes at: the donor's own where the request
    may not cross schedules (only the identical schedule got this far), else where `resume_point` places it."""
    if facts.crossing_process is None:
        return checkpoint.step, checkpoint.sigma
    point = resume_point(facts.sigmas, checkpoint.sigma)
    return None if point is None else (point.step, point.sigma)


def _deepest_of_each_donor(offers: Iterable[Offer]) -> list[Offer]:
    """The first offer of each donor in `offers` (ordered deepest first: its deepest checkpoint among them)."""
    firsts: dict[str, Offer] = {}
    for offer in offers:
        firsts.setdefault(offer.meta.entry_id, offer)
    return list(firsts.values())


def _collect(reads: _Reads, pool: Iterator[Offer], limit: int) -> list[ProbeTarget]:
    """Targets loaded from `pool` until `limit` are usable, consuming no offer beyond the last one taken."""
    collected: list[ProbeTarget] = []
    if limit <= 0:
        return collected
    for offer in pool:
        target = _load_target(reads, offer)
        if target is not None:
            collected.append(target)
        if len(collected) >= limit:
            break
    return collected


def _load_target(reads: _Reads, offer: Offer) -> ProbeTarget | None:
    """The probe target of one offer, with its start prediction and its anchor; None (a skip) when its
    checkpoint blob or the tensors at that step are unusable."""
    meta, candidate = offer.meta, offer.candidate
    tensors = _checkpoints_of(reads, meta)
    if tensors is None:
        return None
    target = _checkpoint_target(tensors, offer.donor_step, offer.sigma, candidate, meta, reads.facts.latent_shape)
    if target is None:
        reads.skip("checkpoint missing, of another shape, or NaN", meta)
        return None
    target = replace(target, step=offer.step)
    target.anchor = _anchor_for(reads, meta, offer.donor_step, candidate)
    target.start = _start_for(reads, meta)
    target.end = stage_end_of(meta, tensors, reads.facts.latent_shape)
    return target


def _checkpoints_of(reads: _Reads, meta: EntryMeta) -> dict[str, torch.Tensor] | None:
    """The checkpoint tensors of the entry's stage, read once per plan; a missing or corrupt blob counts one skip."""
    name = checkpoint_blob(stage_index(meta))
    key = f"{meta.entry_id}/{name}"
    if key not in reads.blobs:
        reads.blobs[key] = reads.store.get_tensors(meta.entry_id, name)
        if reads.blobs[key] is None:
            reads.skip("checkpoint blob missing or corrupt", meta)
    return reads.blobs[key]


def _start_record_of(reads: _Reads, meta: EntryMeta) -> dict[str, torch.Tensor] | None:
    """The step-0 tensors of the entry's stage: their own small blob, or, for an entry recorded without one, its
    checkpoint blob."""
    name = start_blob(stage_index(meta))
    if name not in meta.blob_bytes:
        return _checkpoints_of(reads, meta)
    key = f"{meta.entry_id}/{name}"
    if key not in reads.blobs:
        reads.blobs[key] = reads.store.get_tensors(meta.entry_id, name)
    return reads.blobs[key]


def _checkpoint_target(tensors: dict[str, torch.Tensor], step: int, sigma: float, candidate: Candidate,
                       meta: EntryMeta, latent_shape: tuple[int, ...]) -> ProbeTarget | None:
    """The target at `step`: None unless its state and prediction are finite and of the live latent's shape; an
    unusable guidance field is dropped alone (the probe then compares structure only)."""
    x, x0, guidance = (tensors.get(name(step)) for name in (state_tensor, prediction_tensor, guidance_tensor))
    if not (_usable(x, latent_shape) and _usable(x0, latent_shape)):
        return None
    if guidance is not None and not _usable(guidance, None):
        guidance = None
    return ProbeTarget(candidate=candidate, meta=meta, step=step, sigma=sigma, x=x, x0=x0, guidance=guidance,
                       donor_step=step)


def _lineage(store: ReuseStore, meta: EntryMeta, step: int) -> Iterator[tuple[EntryMeta, int]]:
    """(entry, step) pairs whose trajectory before that step is the donor's before `step`: the donor, and for a
    donor that itself resumed (it recorded nothing before its resume step) its own donor, up the lineage."""
    for _ in range(MAX_LINEAGE):
        yield meta, step
        parent = store.get_meta(meta.lineage["donor_id"]) if meta.lineage.get("donor_id") else None
        if parent is None or parent.hard_key != meta.hard_key or parent.total_steps != meta.total_steps:
            return
        meta, step = parent, min(step, int(meta.lineage.get("depth", step)))


def _anchor_for(reads: _Reads, meta: EntryMeta, step: int, candidate: Candidate) -> ProbeTarget | None:
    """The donor's shallowest evaluated checkpoint before `step` (not step 0, which holds no state) that enters the
    request's schedule, up its lineage: where a deep pass is confirmed while the prompt still decides layout and
    motion (a resume may start there too, so it is placed in the request's schedule as the donor's states are)."""
    for owner, before in _lineage(reads.store, meta, step):
        early = [(c, point) for c in owner.checkpoints if 0 < c.step < before and c.evaluated
                 and (point := _entry_point(reads.facts, c)) is not None]
        if early:
            first, (entry_step, sigma) = min(early, key=lambda item: item[0].step)
            tensors = _checkpoints_of(reads, owner)
            anchor = None if tensors is None else _checkpoint_target(
                tensors, first.step, sigma, candidate, owner, reads.facts.latent_shape)
            return None if anchor is None else replace(anchor, step=entry_step)
    return None


def _start_for(reads: _Reads, meta: EntryMeta) -> StartPrediction | None:
    """The donor's step-0 prediction and the fingerprint of the state it was made at (up the lineage): what the
    live request's own first evaluation screens the donor against; None when it is missing or unusable."""
    for owner, _ in _lineage(reads.store, meta, meta.total_steps):
        record = next((c for c in owner.checkpoints if c.step == 0 and c.start), None)
        if record is None:
            continue
        tensors = _start_record_of(reads, owner)
        x0 = None if tensors is None else tensors.get(prediction_tensor(0))
        if not _usable(x0, reads.facts.latent_shape):
            return None
        guidance, state, latent, guide = (tensors.get(name) for name in (
            guidance_tensor(0), state_tensor(0), INPUT_TENSOR, GUIDE_TENSOR))
        return StartPrediction(meta=owner, sigma=record.sigma, state=str(record.start), x0=x0,
                               guidance=guidance if _usable(guidance, None) else None,
                               x=state if _usable(state, reads.facts.latent_shape) else None,
                               input=latent if _usable(latent, None) else None,
                               guide=guide if _usable(guide, None) else None)
    return None


def boundary_prediction(store: ReuseStore, view: EntryMeta, latent_shape: tuple[int, ...]) -> StartPrediction | None:
    """What a donor's stage predicted at its first state (the boundary it was handed), for the run that continues
    a stage skipped to that donor's output to compare its own first evaluation with."""
    return _start_for(_Reads(store, RequestFacts(schedule="", latent_shape=latent_shape, noise_fingerprint="",
                                                 total_steps=view.total_steps)), view)

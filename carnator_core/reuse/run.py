"""One sampling run under Carnator: lookup, probes, resume decision, recording, report.

The host layer drives it (it owns the model and the sampler) through a handful of calls:
`start_state` set and `plan()` called before sampling, `probe()` with a model-evaluation callback,
`observe_step()` from the sampler's step callback, and `finish()` or nothing (an aborted run
records nothing).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from carnator_core.attention.donor_masks import load_donor_masks
from carnator_core.attention.sparse_attention import MASKS_TOO_FULL, SparseAttentionRun, masks_to_blob
from carnator_core.lookup.compatible import LookupRequest, Match, embed_prompt, find_compatible
from carnator_core.lookup.fingerprint import noise_fingerprint
from carnator_core.lookup.shortlist import Candidate
from carnator_core.reuse.planner import (
    ProbeTarget,
    RequestFacts,
    StartPrediction,
    boundary_prediction,
    plan_probes,
)
from carnator_core.reuse.probe import ProbeSignals, probe_signals
from carnator_core.reuse.recorder import PendingEntry, RunRecorder, writer
from carnator_core.reuse.report import RunReport
from carnator_core.reuse.settings import ReuseSettings
from carnator_core.reuse.trajectory import Handover, StageEnd, append_stage, handovers, stage_view, trajectory_steps
from carnator_core.store.entry import EntryMeta, HardKey
from carnator_core.store.reuse_store import ReuseStore
from carnator_core.store.tensor_codec import encode_tensors

log = logging.getLogger("carnator.run")

STORE_UNAVAILABLE = "store unavailable: generated without reuse"

# The live request's model at several states sharing one sigma, in one call: per state its
# (x0 prediction, guidance direction or None).
Evaluate = Callable[[list[torch.Tensor], float], list[tuple[torch.Tensor, torch.Tensor | None]]]


def text_similarity_depth(similarity: float) -> float:
    """NIRVANA's table as a line: similarity 0.65 skips 10% of the steps, 0.95 skips 50%; below 0.65 none."""
    if similarity < 0.65:
        return 0.0
    return min(0.5, 0.1 + (similarity - 0.65) / 0.30 * 0.4)


@dataclass
class Resume:
    """The accepted latent reuse: start sampling at `step` from the donor state."""

    target: ProbeTarget
    signals: ProbeSignals | None  # None for the unverified text-similarity baseline
    x0: torch.Tensor | None  # the live model's prediction at the resume state: reused as step `step`'s evaluation
    guidance: torch.Tensor | None = None  # and its guidance direction, recorded with it
    end: StageEnd | None = None  # the stage is skipped whole: the run returns the donor stage's output

    @property
    def step(self) -> int:
        """The step sampling resumes at (the stage's length when it is skipped whole)."""
        return self.target.meta.total_steps if self.end is not None else self.target.step


@dataclass
class ReuseRun:
    settings: ReuseSettings
    store: ReuseStore
    hard_key: HardKey
    latent_shape: tuple[int, ...]
    noise_fingerprint: str
    cond_vector: torch.Tensor
    sigmas: list[float]
    cfg: float
    seed: int | None
    latent_reuse_refusal: str = ""  # why latent reuse does not apply to this request ("" when it does)
    started_at: float = field(default_factory=time.perf_counter)
    match: Match | None = None
    probes: list[dict[str, Any]] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    resume: Resume | None = None
    recorder: RunRecorder | None = None
    model_calls: int = 0
    candidate_checkpoints: int = 0
    attention: dict[str, Any] = field(default_factory=dict)
    store_problem: str | None = None  # why the store could not be used during this run
    # The prompt's text vector as the lookup computed it, recorded with the entry (None: the writer embeds the prompt)
    text_vector: torch.Tensor | None = None
    # The live request's own step-0 evaluation (x0, guidance) when probing made it (`_screen`): without a resume the
    # sampler's first call is served from it, so the screen costs a miss nothing.
    start_evaluation: tuple[torch.Tensor, torch.Tensor | None] | None = None
    # The state the sampler starts from (the host computes it as the sampler does, for every run): its fingerprint
    # identifies step 0 in the store, so a donor and a request compare the same computation whatever the sampler.
    start_state: torch.Tensor | None = None
    # The hand-over of the stage this run continues (a later stage of a trajectory), or None for a first stage.
    continues: Handover | None = None
    # Set by the host once the run has sampled: the content fingerprint of what it returned, under which a stage that
    # ends with leftover noise hands over to the sampler that continues it.
    output_fingerprint: str | None = None
    # A continuation of a stage skipped to a donor's output: that donor's first prediction in this stage, which the
    # run's own first evaluation is compared with (the boundary check, reported; it costs no call).
    boundary: StartPrediction | None = None
    _screened: dict[str, ProbeSignals] = field(default_factory=dict, init=False, repr=False)  # donors passed at step 0
    _start_fingerprint: str | None = field(default=None, init=False, repr=False)

    @property
    def total_steps(self) -> int:
        return len(self.sigmas) - 1

    @property
    def hands_over(self) -> bool:
        """Whether the run ends with leftover noise: a stage that another sampler continues."""
        return self.sigmas[-1] > 0.0

    @property
    def stage(self) -> int:
        return self.continues.next_stage if self.continues is not None else 0

    @property
    def facts(self) -> RequestFacts:
        """What the planner knows of this run; a later stage also its model and its place in the trajectory."""
        handover = self.continues
        donor = handover.donor if handover is not None else None
        return RequestFacts(schedule=self.hard_key.schedule, latent_shape=self.latent_shape,
                            noise_fingerprint=self.noise_fingerprint, total_steps=self.total_steps, stage=self.stage,
                            model=self.hard_key.model if handover is not None else "",
                            first_step=handover.next_step if handover is not None else 0,
                            trajectory_steps=trajectory_steps(donor) if donor is not None else None)

    # ------------------------------------------------------------------ before sampling
    def plan(self, match: Match | None = None, batch_limit: int = 1) -> list[ProbeTarget]:
        """Shortlist donors (or take a lookup node's `match`) and list the checkpoints worth probing:
        enough for `max_probes` calls of `batch_limit` states each. The prompt's text vector the lookup used (a
        match's, when made for this prompt) is kept for the entry this run records.

        Empty when latent reuse is off for this run.
        """
        if self.continues is not None:
            return self._plan_continuation(batch_limit)
        if match is not None:
            self.match = match
            if match.request is not None and match.request.prompt == self.settings.prompt:
                self.text_vector = match.request.text_vector
        else:
            self.text_vector, note = embed_prompt(self.settings.prompt)
            request = LookupRequest(hard_key=self.hard_key, cond_vector=self.cond_vector,
                                    prompt=self.settings.prompt, text_vector=self.text_vector,
                                    noise=self.noise_fingerprint)
            self.match = find_compatible(self.store, request, self.settings.top_k, self.settings.min_similarity,
                                         same_noise_limit=self.settings.screen_limit)
            if note:
                self.match.notes.append(note)
        self.store_problem = self.store.unavailable
        self.recorder = RunRecorder(set(self.settings.checkpoint_steps(self.total_steps)))
        if self.latent_reuse_refusal or self.settings.max_resume_fraction <= 0:
            return []
        targets, self.skipped = plan_probes(self.store, self.match.candidates, self.facts,
                                            self.settings.max_resume_fraction,
                                            same_noise_only=self.settings.seed_policy == "same-noise",
                                            max_probes=self.settings.max_probes * max(1, batch_limit),
                                            fallback_fraction=self.settings.fallback_resume_fraction,
                                            fallback_targets=max(1, batch_limit))
        return targets

    def _plan_continuation(self, batch_limit: int) -> list[ProbeTarget]:
        """A later stage plans against the donor its first stage was skipped to, and no other: that donor's same stage,
        made by the same model (expert, LoRA, strength) over the same schedule slice, at most as deep as the mode allows
        in the whole trajectory. The donor was confirmed at step 0, so a deep pass needs no confirmation."""
        handover = self.continues
        self.recorder = RunRecorder(set(self.settings.checkpoint_steps(self.total_steps)))
        self.store_problem = self.store.unavailable
        donor = handover.donor
        candidates = []
        if donor is not None:
            candidates = [Candidate(entry_id=donor.entry_id, prompt=donor.prompt, score=1.0, cond_similarity=1.0,
                                    text_similarity=None)]
        self.match = Match(store_directory=self.settings.store_directory, request=None, candidates=candidates)
        view = stage_view(donor, self.stage) if donor is not None else None
        if view is not None and view.hard_key.model == self.hard_key.model:
            self.boundary = boundary_prediction(self.store, view, self.latent_shape)
        if self.latent_reuse_refusal or self.settings.max_resume_fraction <= 0 or donor is None:
            return []
        targets, self.skipped = plan_probes(self.store, candidates, self.facts, self.settings.max_resume_fraction,
                                            same_noise_only=False, max_probes=self.settings.max_probes * max(1, batch_limit),
                                            fallback_fraction=self.settings.fallback_resume_fraction,
                                            fallback_targets=max(1, batch_limit))
        return [replace(target, anchor=None) for target in targets]

    def probe(self, targets: list[ProbeTarget], evaluate: Evaluate, batch_limit: int = 1) -> Resume | None:
        """Evaluate targets in planner order; resume from the deepest checkpoint whose signals pass.

        At most `max_probes` model calls. Each call takes the next unprobed target together with up to
        `batch_limit - 1` later ones at the same step (other donors' checkpoints), so one evaluation probes
        several candidates. A call with a pass ends probing and resumes from its first passing target: all
        targets of a call share one depth, and later calls are only shallower or lower-ranked. A donor that
        misses the structure threshold by more than `give_up_margin` gets no further probe. In fast mode the last
        call goes to targets no deeper than balanced's limit when no earlier call was that shallow. A pass deeper than
        the donor's shallowest checkpoint is confirmed there with one more call (`ProbeTarget.anchor`), unless the
        donor was already confirmed at step 0 by `_screen` (given the live request's first state, `start_state`).
        """
        self.candidate_checkpoints = len(targets)
        if self.settings.verification == "text-only":
            return self._resume_by_text_similarity(targets)
        pending = [target for target in targets if not target.screen_only]
        if self.start_state is not None and self.settings.max_probes > 0:
            pending = self._screen(list(targets), evaluate)
            if self._skip_stage(pending) is not None:
                return self.resume
        thresholds = self.settings.thresholds
        fallback = self.settings.fallback_resume_fraction
        fallback_step = None if fallback is None else self.facts.max_step(fallback)
        for call_index in range(self.settings.max_probes):
            if fallback_step is not None and call_index == self.settings.max_probes - 1 and not any(
                    p["step"] <= fallback_step and not p["confirms_deeper"] for p in self.probes):
                pending = [t for t in pending if t.step <= fallback_step] or pending
            if not pending:
                break
            call = [t for t in pending if t.step == pending[0].step][:max(1, batch_limit)]
            pending = [t for t in pending if not any(t is c for c in call)]
            results = evaluate([t.x for t in call], call[0].sigma)
            self.model_calls += 1
            hopeless: set[str] = set()
            for target, (x0_new, guidance_new) in zip(call, results, strict=True):
                signals = probe_signals(target.depth, target.x, x0_new, target.x0, guidance_new, target.guidance)
                passed = thresholds.passes(signals)
                given_up = not passed and thresholds.donor_hopeless(signals)
                self._record_probe(target.meta, target.step, signals, passed, given_up, batched_with=len(call) - 1)
                if passed and self.resume is None and target.anchor is not None:
                    passed = self._confirm(target.anchor, evaluate)  # a failed confirmation rules out the donor
                    given_up = not passed
                if given_up:
                    hopeless.add(target.meta.entry_id)
                if passed and self.resume is None:
                    self.resume = Resume(target=target, signals=signals, x0=x0_new, guidance=guidance_new)
            pending = [t for t in pending if t.meta.entry_id not in hopeless]
            if self.resume is not None:
                return self.resume
        return None

    def _skip_stage(self, screened: list[ProbeTarget]) -> Resume | None:
        """Skip this stage whole when a donor confirmed at step 0 recorded its output and a later stage, the stage's
        share of the trajectory lies within the mode's depth and the screen passes at that depth's thresholds: the
        run returns the output of the donor it agrees with most, and the next stage starts from it (its own model's
        first evaluation there is the boundary check)."""
        if not self.hands_over or self.stage != 0:
            return None
        limit = self.settings.max_resume_fraction + 1e-9
        skips = []
        for target in screened:
            signals = self._screened.get(target.meta.entry_id)
            if target.end is None or signals is None or target.end.share > limit \
                    or abs(target.end.sigma - self.sigmas[-1]) >= 1e-6:
                continue
            # the screen must pass at the depth the skip reaches, as a probe there would
            if self.settings.thresholds.passes(replace(signals, depth=target.end.share)):
                skips.append((signals.structure_agreement, -len(skips), target, signals))
        if not skips:
            return None
        # the donor the request agrees with most: a one-attribute edit of the scene can pass the screen too
        _, _, target, signals = max(skips, key=lambda skip: skip[:2])
        self.resume = Resume(target=target, signals=signals, x0=None, end=target.end)
        return self.resume

    def _screen(self, targets: list[ProbeTarget], evaluate: Evaluate) -> list[ProbeTarget]:
        """Confirm donors at step 0 with the live request's own first evaluation, before any deep probe.

        A donor sampled from the same initial noise started from this very state, and step 0 is where the prompt
        decides the most (docs/measurements.md, "Probe calibration"), so one call judges every such donor at once.
        It is not extra work: without a resume the sampler's first call is served from it (`start_evaluation`);
        with one it replaces the confirmation of the deep pass. Donors that fail get no probe; those that pass need no confirmation later.
        Others are left as they were.
        """
        start_state = self.start_state
        starts = {t.meta.entry_id: t.start for t in targets
                  if t.start is not None and t.start.state == self.start_fingerprint}
        if not starts:
            return [target for target in targets if not target.screen_only]
        sigma = self.sigmas[0]
        [(x0_new, guidance_new)] = evaluate([start_state], sigma)
        self.model_calls += 1
        self.start_evaluation = (x0_new, guidance_new)
        self.observe_step(0, sigma, start_state, x0_new, guidance_new)
        ruled_out: set[str] = set()
        for entry_id, start in starts.items():
            signals = probe_signals(0.0, start_state, x0_new, start.x0, guidance_new, start.guidance)
            passed = self.settings.thresholds.passes(signals)
            self._record_probe(start.meta, 0, signals, passed, not passed, batched_with=0, confirms=True)
            if not passed:
                ruled_out.add(entry_id)
            else:
                self._screened[entry_id] = signals
        kept = [replace(target, anchor=None) if target.meta.entry_id in starts else target
                for target in targets if target.meta.entry_id not in ruled_out
                and (not target.screen_only or target.meta.entry_id in starts)]
        return sorted(kept, key=lambda target: -target.step)  # stable: at equal depth the better-ranked donor first

    def _confirm(self, anchor: ProbeTarget, evaluate: Evaluate) -> bool:
        """One more model call at the donor's shallowest checkpoint, where the prompt still decides layout and
        motion: a deep pass counts only if the donor's trajectory is one the new prompt would have taken there."""
        [(x0_new, guidance_new)] = evaluate([anchor.x], anchor.sigma)
        self.model_calls += 1
        signals = probe_signals(anchor.depth, anchor.x, x0_new, anchor.x0, guidance_new, anchor.guidance)
        confirmed = self.settings.thresholds.passes(signals)
        self._record_probe(anchor.meta, anchor.step, signals, confirmed, not confirmed, batched_with=0,
                           confirms=True)
        return confirmed

    def _record_probe(self, donor: EntryMeta, step: int, signals: ProbeSignals, passed: bool, given_up: bool,
                      batched_with: int, confirms: bool = False) -> None:
        self.probes.append({"donor_id": donor.entry_id, "donor_prompt": donor.prompt, "step": step, "passed": passed,
                            "donor_given_up": given_up, "batched_with": batched_with, "confirms_deeper": confirms,
                            **signals.as_dict()})

    def _resume_by_text_similarity(self, targets: list[ProbeTarget]) -> Resume | None:
        """Baseline (NIRVANA/Chorus style): skip depth from prompt similarity alone, no model check."""
        for target in targets:
            similarity = target.candidate.text_similarity
            similarity = target.candidate.score if similarity is None else similarity
            if target.depth <= text_similarity_depth(similarity):
                self.resume = Resume(target=target, signals=None, x0=None)
                return self.resume
        return None

    # ------------------------------------------------------------------ during sampling
    def observe_step(self, step: int, sigma: float, x: torch.Tensor, x0: torch.Tensor,
                     guidance: torch.Tensor | None, evaluated: bool = True) -> None:
        if step == 0 and self.boundary is not None and evaluated:
            self._check_boundary(x, x0, guidance)
        if self.recorder is None or not self.recorder.wants(step):
            return
        if step > 0:
            self.recorder.capture(step, sigma, x, x0, guidance, evaluated)
        elif self.start_fingerprint is not None:  # step 0 keeps the prediction, and the state as its fingerprint
            self.recorder.capture_start(sigma, self.start_fingerprint, x0, guidance)

    def _check_boundary(self, x: torch.Tensor, x0: torch.Tensor, guidance: torch.Tensor | None) -> None:
        """Compare this stage's first evaluation, at the donor output the previous stage was skipped to, with the
        donor's own there. It changes nothing (the skip is done); the report shows it beside the step-0 screen."""
        boundary, self.boundary = self.boundary, None
        donor_guidance = boundary.guidance.to(x0.device) if boundary.guidance is not None else None
        signals = probe_signals(0.0, x, x0, boundary.x0.to(x0.device), guidance, donor_guidance)
        passed = self.settings.thresholds.passes(signals)
        self._record_probe(boundary.meta, 0, signals, passed, False, batched_with=0, confirms=True)
        self.probes[-1]["boundary"] = True
        if not passed:
            log.warning("Carnator: the state stage %d was skipped to disagrees at the boundary with donor %s (%s)",
                        self.stage - 1, boundary.meta.entry_id[:8], signals.as_dict())

    def observe_end(self, sigma: float, output: torch.Tensor) -> None:
        """Keep a stage's output (sigma > 0: leftover noise) for later requests that skip the stage."""
        if self.recorder is not None and self.hands_over:
            self.recorder.capture_end(sigma, output)

    @property
    def start_fingerprint(self) -> str | None:
        if self._start_fingerprint is None and self.start_state is not None:
            self._start_fingerprint = noise_fingerprint(self.start_state)
        return self._start_fingerprint

    def wants_step(self, step: int) -> bool:
        return self.recorder is not None and self.recorder.wants(step)

    @property
    def checkpoint_sigmas(self) -> set[float]:
        """The sigmas of the steps this run records (empty before `plan`)."""
        return {self.sigmas[step] for step in self.recorder.checkpoint_steps} if self.recorder is not None else set()

    @property
    def mask_donor(self) -> str | None:
        """The entry that lends this run its attention masks: the donor it resumed from, else its best candidate."""
        if self.resume is not None:
            return self.resume.target.meta.entry_id
        if self.continues is not None:
            return self.continues.mask_donor
        best = self.match.best if self.match is not None else None
        return best.entry_id if best is not None else None

    def lend_masks(self, attention: SparseAttentionRun | None) -> None:
        """Sparsity reuse: hand `attention` the masks of `mask_donor`, when it takes a donor's and has none yet."""
        if attention is None or not attention.wants_donor_masks:
            return
        donor = self.mask_donor
        if donor is not None:
            attention.borrowed = load_donor_masks(self.store, donor, self.stage, self.hard_key.model)

    # ------------------------------------------------------------------ after sampling
    def finish(self, model_calls: int, attention: SparseAttentionRun | None = None,
               thumbnail: bytes | None = None) -> RunReport:
        """Submit the entry for background writing (or hand it to the stage that continues this one) and return the
        report."""
        self.model_calls += model_calls
        if attention is not None:
            self.attention = attention.summary()
        elapsed = time.perf_counter() - self.started_at
        self.store_problem = self.store_problem or self.store.unavailable
        if self.resume is not None:
            saved_steps = self.resume.step
            donor_seconds_per_step = self.resume.target.meta.sample_seconds / max(1, self.resume.target.meta.total_steps)
            self.store.record_hit(self.resume.target.meta.entry_id, saved_steps * donor_seconds_per_step)
        recorded = self.settings.record and self.recorder is not None
        self._hand_on(self._entry(elapsed, attention, thumbnail) if recorded else None)
        return self.report(elapsed)

    def _entry(self, elapsed: float, attention: SparseAttentionRun | None, thumbnail: bytes | None) -> PendingEntry:
        listing, blobs = self.recorder.blobs()
        if thumbnail:
            blobs["thumb"] = thumbnail
        masks_meta: dict[str, Any] = {}
        if attention is not None:
            masks = attention.own_masks() or attention.borrowed  # what attention estimated, else what it used
            if masks:
                masks_meta, mask_tensors = masks_to_blob(masks)
                blobs["masks"] = encode_tensors(mask_tensors)
        lineage = {}
        if self.resume is not None:
            lineage = {"donor_id": self.resume.target.meta.entry_id, "depth": self.resume.step}
        skipped_steps = self.resume.step if self.resume is not None else 0
        # work of a full run, so that saved-work estimates stay honest for entries that themselves reused
        full_seconds = elapsed * self.total_steps / max(1, self.total_steps - skipped_steps)
        extra: dict[str, Any] = {"sigmas": [round(s, 6) for s in self.sigmas]}
        if self.recorder.end is not None:
            extra["stage_end"] = {"sigma": self.recorder.end[0]}
        meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=self.hard_key, prompt=self.settings.prompt,
                         latent_shape=tuple(self.latent_shape), noise_fingerprint=self.noise_fingerprint,
                         cfg=float(self.cfg), seed=self.seed, total_steps=self.total_steps,
                         sample_seconds=full_seconds, checkpoints=listing, masks=masks_meta, lineage=lineage,
                         extra=extra)
        return PendingEntry(store=self.store, meta=meta, blobs=blobs, cond_vector=self.cond_vector,
                            text_vector=self.text_vector)

    def _hand_on(self, entry: PendingEntry | None) -> None:
        """Write the request's entry, or keep it for the sampler that continues this stage. A later stage adds its
        record to the entry its first stage left."""
        if self.continues is not None:
            whole = self.continues.pending
            if whole is not None and entry is not None:
                end = entry.meta.extra.get("stage_end")
                append_stage(whole, self.stage, self.hard_key, self.total_steps, entry.meta.checkpoints, entry.blobs,
                             entry.meta.masks, end["sigma"] if end else None)
            entry = whole
        if self.hands_over and self.output_fingerprint is not None:
            first_step = self.continues.next_step if self.continues is not None else 0
            donor = None
            if self.resume is not None:
                donor = self.resume.target.meta if self.continues is None else self.continues.donor
            handovers.park(self.output_fingerprint, Handover(
                sigma=self.sigmas[-1], next_stage=self.stage + 1, next_step=first_step + self.total_steps,
                pending=entry, donor=donor, mask_donor=self.mask_donor))
        elif entry is not None:
            writer.submit(entry)

    def report(self, elapsed: float) -> RunReport:
        best = self.resume.target if self.resume is not None else None
        candidate = best.candidate if best is not None else (self.match.best if self.match else None)
        skipped_steps = self.resume.step if self.resume is not None else 0
        reason = ""
        if best is None:
            reason = self._miss_reason()
        per_step = elapsed / max(1, self.total_steps - skipped_steps)
        signals = self.resume.signals if self.resume is not None else None
        return RunReport(
            hit=best is not None or bool(self.attention.get("borrowed_sparse_calls")),
            mode=self.settings.mode,
            prompt=self.settings.prompt,
            donor_id=best.meta.entry_id if best else None,
            donor_prompt=best.meta.prompt if best else None,
            text_similarity=candidate.text_similarity if candidate else None,
            agreement=signals.raw_agreement if signals else None,
            structure_agreement=signals.structure_agreement if signals else None,
            guidance_cosine=signals.guidance_cosine if signals else None,
            skipped_steps=skipped_steps,
            total_steps=self.total_steps,
            attention=self.attention,
            model_calls=self.model_calls,
            time_s=elapsed,
            time_saved_s=per_step * skipped_steps,
            reason=reason,
            probes=self.probes,
            candidates=[{"entry_id": c.entry_id, "prompt": c.prompt, "score": c.score}
                        for c in (self.match.candidates if self.match else [])],
            filtered=dict(self.match.filtered) if self.match else {},
            skipped_donors=dict(self.skipped),
            notes=self._notes(),
            stage=self._stage_summary(),
        )

    def _stage_summary(self) -> dict[str, Any]:
        if self.continues is None and not self.hands_over:
            return {}
        return {"index": self.stage, "first_step": self.continues.next_step if self.continues is not None else 0,
                "hands_over": self.hands_over, "skipped_whole": self.resume is not None and self.resume.end is not None}

    def _notes(self) -> list[str]:
        notes = list(self.match.notes if self.match else [])
        if self.settings.prompt_note:  # says more than the lookup's "no prompt text given"
            notes = [self.settings.prompt_note] + [note for note in notes if self.settings.prompt
                                                   or not note.startswith("no prompt text given")]
        if self.store_problem and not any("store unavailable" in note for note in notes):
            notes.append(f"store unavailable, generating without reuse: {self.store_problem}")
        if self.attention.get("inactive"):
            notes.append(self.attention["inactive"])
        elif self.attention.get("heads_reuse") and not self.attention.get("borrowed_sparse_calls"):
            notes.append(MASKS_TOO_FULL)
        return notes

    def _miss_reason(self) -> str:
        if self.store_problem:
            return STORE_UNAVAILABLE
        if self.latent_reuse_refusal:
            return self.latent_reuse_refusal
        if self.settings.max_resume_fraction <= 0:
            return "mode 'safe': latent reuse off"
        if self.continues is not None and not any(not probe.get("boundary") for probe in self.probes):
            return ("continues a stage skipped to a donor's output: the mode's depth ends at the boundary"
                    if self.continues.donor is not None else "continues a stage that sampled in full: no donor state")
        if self.match is None or not self.match.candidates:
            return "no candidate" if not (self.match and self.match.filtered) else "no candidate (all filtered)"
        if self.probes:
            return "probe rejected"
        if self.settings.verification == "text-only" and self.candidate_checkpoints:
            return "text similarity too low for the baseline's skip table"
        if self.skipped:
            return "filtered: " + ", ".join(sorted(self.skipped))
        return "no candidate"


"""One request's reuse, from lookup to report: the engine that decides what a sampling run does.

A request goes through three typed steps, each in its own module with its contract:

1. plan (`carnator_core.reuse.plan`): the candidates the lookup shortlisted (or a lookup node's `Match`) and the
   donor states worth asking the model about, by everything certain without it;
2. decision (`carnator_core.reuse.decision`): the live model screened at step 0 and probed, giving a `Decision`
   (resume at a state, skip the stage whole) or none (a miss);
3. recording (`carnator_core.reuse.recording`): the checkpoints this request leaves for later ones, written in the
   background, or handed to the stage that continues it (`carnator_core.reuse.trajectory`).

The host (it owns the model and the sampler) builds a `ReuseRun` (the thresholds that judge it, shipped or a
calibration profile's, are chosen then), asks `decide()` with the run's start state and a model-evaluation callback,
installs the `Outcome` it returns (`carnator_core.reuse.outcome`: skip the stage, resume, or sample fresh, with its
reason), feeds `observe_step()`, `observe_prediction()`, `observe_end()` and `observe_output()` while the sampler
runs, and calls `finish()` or nothing (an aborted run records nothing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from carnator_core.attention.donor_masks import load_donor_masks
from carnator_core.attention.sparse_attention import MASKS_TOO_FULL, SparseAttentionRun, masks_to_blob
from carnator_core.lookup.compatible import LookupRequest, Match, embed_prompt, find_compatible, index_for
from carnator_core.lookup.fingerprint import content_fingerprint, noise_fingerprint
from carnator_core.lookup.noise_process import NOISE_PROCESS, NoiseProcess
from carnator_core.lookup.shortlist import Candidate
from carnator_core.reuse.cached_evaluation import same_sigma
from carnator_core.reuse.decision import Decider, Decision, Evaluate, ProbeRecord
from carnator_core.reuse.exact_repeat import (
    EXACT,
    FINAL_TENSOR,
    ExactRepeat,
    find_exact,
    prediction_digest,
    stage_repeat,
)
from carnator_core.reuse.history_replay import REPLAY_NOTE, HistoryReplay, replay_for
from carnator_core.reuse.input_start import GUIDE_IMAGE, GUIDE_NOTE, INPUT_NOTE, INPUT_START
from carnator_core.reuse.outcome import Outcome, Reason, Resume, SampleFresh, ServedEvaluation, SkipStage
from carnator_core.reuse.packed_latent import PackedShapes
from carnator_core.reuse.plan import RequestFacts, ScreenOnly, boundary_prediction, lacking_states, plan_probes
from carnator_core.reuse.probe import GUIDANCE_FORM
from carnator_core.reuse.recording import PendingEntry, RunRecorder, await_earlier_entries, entry_writer
from carnator_core.reuse.report import RunReport
from carnator_core.reuse.resume_point import ResumePoint, resumed_schedule
from carnator_core.reuse.settings import ReuseSettings
from carnator_core.reuse.targets import ProbeTarget, StartPrediction
from carnator_core.reuse.trajectory import Handover, append_stage, handover_registry
from carnator_core.store.entry import EntryMeta, HardKey
from carnator_core.store.profiles import profile_for
from carnator_core.store.reuse_store import ReuseStore
from carnator_core.store.stages import final_blob, stage_entry, trajectory_steps
from carnator_core.store.tensor_codec import encode_tensors
from carnator_core.store.thumbnail import PreviewFrame

STORE_UNAVAILABLE = "store unavailable: generated without reuse"


@dataclass
class ReuseRun:
    """The state of one request's reuse: what it knows of the request, and what plan, decision and recording found.

    Model calls it makes itself (the screen, probes) are counted by its `Decider`; `finish` adds the sampler's. The
    host reads it and calls its methods; it writes none of its fields.
    """

    settings: ReuseSettings
    store: ReuseStore
    hard_key: HardKey
    latent_shape: tuple[int, ...]
    noise_fingerprint: str
    cond_vector: torch.Tensor
    sigmas: list[float]
    cfg: float
    seed: int | None
    # the guided output's form where it is uncond + cfg x (cond - uncond): the unconditional branch's identity (negative
    # conditioning and CFG scale); None where a CFG function or a guider of its own shapes the output
    guidance_form: str | None = None
    latent_reuse_refusal: str = ""  # why latent reuse does not apply to this request ("" when it does)
    packed: PackedShapes | None = None  # the latents packed into `latent_shape`'s one (LTX-2's video and audio)
    # the input of a run that starts from one (`carnator_core.reuse.input_start`); None for a run from pure noise
    input_latent: torch.Tensor | None = None
    input_note: str = ""  # why a run from an input whose input is a stage output does not continue that stage
    # the image its conditioning carries (`concat_latent_image`), None for a run guided by text alone
    guide_image: torch.Tensor | None = None
    # the model's noise process: donors of another schedule of it are candidates (None: the identical schedule only)
    noise_process: NoiseProcess | None = None
    # the hash of every sampler input (`carnator_core.reuse.exact_repeat`); None where the host cannot tell them all
    exact_key: str | None = None
    exact: ExactRepeat | None = None  # the stored run this request repeated exactly, once its first call confirmed it
    first_digest: str | None = None  # the digest of this run's first prediction, where it sampled step 0
    output: torch.Tensor | None = None  # what the run returned, kept for an entry a later exact repeat can serve
    started_at: float = field(default_factory=time.perf_counter)
    match: Match | None = None
    skipped: dict[str, int] = field(default_factory=dict)
    decision: Decision | None = None
    outcome: Outcome | None = None  # what `decide` returned: the report's reason comes from it
    recorder: RunRecorder | None = None
    model_calls: int = 0  # every model call of the run, once `finish` has added the sampler's
    candidate_checkpoints: int = 0
    attention_summary: dict[str, Any] = field(default_factory=dict)  # the run's sparse attention, once finished
    store_problem: str | None = None  # why the store could not be used during this run
    # The prompt's text vector as the lookup computed it, recorded with the entry (None: the writer embeds the prompt)
    text_vector: torch.Tensor | None = None
    # The hand-over of the stage this run continues (a later stage of a trajectory), or None for a first stage.
    continues: Handover | None = None
    # The content fingerprint of what the run returned (`observe_output`), under which a stage that ends with leftover
    # noise hands over to the sampler that continues it.
    output_fingerprint: str | None = None
    # A continuation of a stage skipped to a donor's output: that donor's first prediction in this stage, which the
    # run's own first evaluation is compared with (the boundary check, reported; it costs no call).
    boundary: StartPrediction | None = None
    # whether the sampler retraced the donor's trajectory to the resume step (`carnator_core.reuse.history_replay`)
    replayed: bool = False
    plan_notes: list[str] = field(default_factory=list)  # what the planned donors lacked (`lacking_states`)
    # The state the sampler starts from (the host computes it as the sampler does, for every run; `decide` takes it):
    # its fingerprint identifies step 0 in the store, so a donor and a request compare the same computation whatever
    # the sampler.
    start_state: torch.Tensor | None = field(default=None, init=False)
    _decider: Decider | None = field(default=None, init=False, repr=False)
    _start_fingerprint: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._judge_by_profile()

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
    def resume_limit(self) -> float:
        """How deep into the schedule this run may resume: the mode's limit, or a forced resume's depth rounded to the
        step its checkpoint is recorded at (`ReuseSettings.checkpoint_steps` rounds alike)."""
        forced = self.settings.forced_resume_fraction
        if forced is None:
            return self.settings.max_resume_fraction
        return round(forced * self.total_steps) / self.total_steps

    @property
    def facts(self) -> RequestFacts:
        """What the planner knows of this run; a later stage also its model and its place in the trajectory."""
        handover = self.continues
        donor = handover.donor if handover is not None else None
        return RequestFacts(schedule=self.hard_key.schedule, latent_shape=self.latent_shape,
                            noise_fingerprint=self.noise_fingerprint, total_steps=self.total_steps, stage=self.stage,
                            model=self.hard_key.model if handover is not None else "",
                            first_step=handover.next_step if handover is not None else 0,
                            trajectory_steps=trajectory_steps(donor) if donor is not None else None,
                            packed=self.packed, input_latent=self.input_latent, guide_image=self.guide_image,
                            sigmas=tuple(self.sigmas), noise_process=self.noise_process, scope=self.hard_key.scope)

    @property
    def decider(self) -> Decider:
        """The run's decision step, made once the start state is known (`decide` takes it)."""
        if self._decider is None:
            self._decider = Decider(settings=self.settings, facts=self.facts, sigmas=self.sigmas,
                                    start_state=self.start_state, start_fingerprint=self.start_fingerprint,
                                    cfg=float(self.cfg), guidance_form=self.guidance_form,
                                    on_start=lambda sigma, x, x0, guidance: self.observe_step(0, sigma, x, x0, guidance))
        return self._decider

    @property
    def probes(self) -> list[ProbeRecord]:
        """Every question the run put to the model, in order."""
        return self._decider.probes if self._decider is not None else []

    @property
    def start_evaluation(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The request's own step-0 evaluation (x0, guidance) when the screen made it: without a decision the
        sampler's first call is served from it, so the screen costs a miss nothing."""
        return self._decider.start_evaluation if self._decider is not None else None

    # ------------------------------------------------------------------ before sampling
    def exact_repeat(self) -> ExactRepeat | None:
        """The stored run of this scope, model and grid, made from this noise, that recorded this request's exact key
        (a first stage or a single run), or the next stage of the entry the stage this run continues repeated; None
        where there is none or this run cannot tell."""
        if not self.settings.exact_repeats or self.exact_key is None or self.store.unavailable:
            return None
        if self.continues is not None:
            repeated = self.continues.repeated
            return None if repeated is None else stage_repeat(self.store, repeated, self.stage, self.exact_key,
                                                              self.latent_shape)
        await_earlier_entries()
        ids = index_for(self.store).same_noise_ids(self.hard_key, self.noise_fingerprint)
        return find_exact(self.store, ids, self.exact_key, self.latent_shape)

    def repeated(self, repeat: ExactRepeat) -> None:
        """The request's first prediction confirmed `repeat`: its output is the stored one, and it records nothing."""
        self.exact = repeat

    def plan(self, match: Match | None = None, batch_limit: int = 1) -> list[ProbeTarget | ScreenOnly]:
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
            await_earlier_entries()
            request = LookupRequest(hard_key=self.hard_key, cond_vector=self.cond_vector,
                                    prompt=self.settings.prompt, text_vector=self.text_vector,
                                    noise=self.noise_fingerprint, noise_process=self.noise_process)
            self.match = find_compatible(self.store, request, self.settings.top_k, self.settings.min_similarity,
                                         same_noise_limit=self.settings.screen_limit)
            if note:
                self.match.notes.append(note)
        self.store_problem = self.store.unavailable
        self.recorder = RunRecorder(set(self.settings.checkpoint_steps(self.total_steps)))
        if self.latent_reuse_refusal or self.settings.max_resume_fraction <= 0:
            return []
        targets, self.skipped = plan_probes(self.store, self.match.candidates, self.facts, self.resume_limit,
                                            same_noise_only=self.settings.seed_policy == "same-noise",
                                            max_probes=self.settings.max_probes * max(1, batch_limit),
                                            contained_fraction=self.settings.contained_resume_fraction)
        self.plan_notes = lacking_states(targets, self.settings.checkpoint_steps, self.facts.max_step(self.resume_limit),
                                         self.total_steps)
        return targets

    def _judge_by_profile(self) -> None:
        """Let the store's calibration profile for this model and schedule judge, where the node left its thresholds
        at their defaults (`ReuseSettings.with_profile`): chosen once, when the run is built, so the host and the
        engine read the same settings."""
        if self.latent_reuse_refusal or self.settings.max_resume_fraction <= 0:
            return
        profile, note = profile_for(self.store, self.hard_key.model, self.hard_key.schedule, self.cfg,
                                    self.hard_key.scope)
        self.settings = self.settings.with_profile(profile, note)

    def _plan_continuation(self, batch_limit: int) -> list[ProbeTarget | ScreenOnly]:
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
        self.match = Match(store_location=self.settings.store_location, request=None, candidates=candidates)
        view = stage_entry(donor, self.stage) if donor is not None else None
        difference = handover.difference
        if view is not None and view.hard_key.model == self.hard_key.model:
            self.boundary = boundary_prediction(self.store, view, self.latent_shape)
            if self.boundary is not None and difference is not None:
                self.boundary = replace(self.boundary, x0=difference.prediction(self.boundary.x0))
        if self.latent_reuse_refusal or self.settings.max_resume_fraction <= 0 or donor is None:
            return []
        targets, self.skipped = plan_probes(self.store, candidates, self.facts, self.resume_limit,
                                            same_noise_only=False, max_probes=self.settings.max_probes * max(1, batch_limit),
                                            contained_fraction=self.settings.contained_resume_fraction)
        continued = []
        for target in targets:
            if isinstance(target, ProbeTarget):
                target = replace(target, anchor=None)
                if difference is not None:  # the first stage was corrected: so are the states that continue it
                    target = difference.corrected(target)
            continued.append(target)
        return continued

    def decide(self, start_state: torch.Tensor | None, evaluate: Evaluate, match: Match | None = None,
               batch_limit: int = 1, keeps_history: bool = False) -> Outcome:
        """Plan (`plan`), ask the live model about the plan's targets (`Decider.decide`) and return what the run does,
        with its reason. `start_state` is the state the sampler starts from; `evaluate` the live model at states
        sharing one sigma; `keeps_history`: the sampler is multistep (a resume replays the donor's predictions, and
        this run records its own for later ones)."""
        self.start_state = start_state
        targets = self.plan(match, batch_limit)
        if keeps_history:
            self._keep_history()
        self.candidate_checkpoints = len(targets)
        self.decision = self.decider.decide(targets, evaluate, batch_limit) if targets else None
        self.outcome = self._outcome(keeps_history)
        return self.outcome

    def _outcome(self, keeps_history: bool) -> Outcome:
        decision = self.decision
        if decision is None:
            if self.start_evaluation is None:
                return SampleFresh(served=None, continues_from=None, reason=self._miss_reason())
            return SampleFresh(served=ServedEvaluation(self.start_state, self.start_state, self.sigmas[0], exact=True),
                               continues_from=self.start_state, reason=self._miss_reason())
        if decision.end is not None:
            return SkipStage(output=decision.end.latent, sigma=decision.end.sigma, decision=decision,
                             reason=Reason(decision.branch))
        target = decision.target
        if not same_sigma(self.sigmas[target.step], target.sigma):  # a donor of another schedule: its sigma there
            self.sigmas = resumed_schedule(self.sigmas, ResumePoint(target.step, target.sigma, exact=False))
        replay = self._history_replay() if keeps_history else None
        served = None
        if decision.x0 is not None:
            served = ServedEvaluation(target.x, None if replay is not None else target.x, target.sigma, exact=False)
        return Resume(step=target.step, sigma=target.sigma, state=target.x, replay=replay, continues_from=target.x,
                      served=served, boost_sigmas=frozenset(self.settings.boost_sigmas(self.sigmas, target.step)),
                      decision=decision, reason=Reason(decision.branch))

    # ------------------------------------------------------------------ during sampling
    def observe_step(self, step: int, sigma: float, x: torch.Tensor, x0: torch.Tensor,
                     guidance: torch.Tensor | None, evaluated: bool = True) -> None:
        if step == 0 and self.boundary is not None and evaluated:
            boundary, self.boundary = self.boundary, None
            self.decider.check_boundary(boundary, x, x0, guidance)
        if self.recorder is None or not self.recorder.wants(step):
            return
        if step > 0:
            self.recorder.capture(step, sigma, x, x0, guidance, evaluated)
        elif self.start_fingerprint is not None:  # step 0 keeps the prediction, and the state as its fingerprint
            # the state as the host computed it (`start_state`), whatever scaled copy the sampler's first call saw
            from_input = (self.start_state, self.input_latent) if self.input_latent is not None else None
            self.recorder.capture_start(sigma, self.start_fingerprint, x0, guidance, from_input, self.guide_image)

    def _keep_history(self) -> None:
        """Record the sampler's predictions up to the deepest checkpoint: a multistep sampler resumed from this run
        replays them (`carnator_core.reuse.history_replay`). A first stage only: later stages are continued, not
        resumed from their start."""
        if self.recorder is not None and self.continues is None and self.recorder.checkpoint_steps:
            self.recorder.history_until = max(self.recorder.checkpoint_steps)

    def observe_prediction(self, sigma: float, x0: torch.Tensor) -> None:
        """The sampler's model call at `sigma` predicted `x0` (evaluated, or answered from a cache or a replay)."""
        if self.recorder is None or not self.recorder.history_until:
            return
        step = next((i for i, s in enumerate(self.sigmas) if same_sigma(s, sigma)), None)
        if step is not None and self.recorder.wants_prediction(step):
            self.recorder.capture_prediction(step, x0)

    def _history_replay(self) -> HistoryReplay | None:
        """How the sampler retraces the donor's trajectory to the resume step (None: it starts there, without
        history)."""
        if self.decision is None or self.decision.end is not None:
            return None
        replay = replay_for(self.store, self.decision.target, self.start_fingerprint, self.sigmas,
                            self.decision.difference)
        self.replayed = replay is not None
        return replay

    def observe_end(self, sigma: float, output: torch.Tensor) -> None:
        """Keep a stage's output (sigma > 0: leftover noise) for later requests that skip the stage, and the run's
        output for a later exact repeat."""
        if self.recorder is not None and self.hands_over:
            self.recorder.capture_end(sigma, output)
        self.output = output

    def observe_first_prediction(self, x0: torch.Tensor) -> None:
        """The sampler's step-0 prediction (the step callback's, bit for bit): its digest goes with the entry (only
        a run with an exact key pays the copy)."""
        if self.exact_key is not None:
            self.first_digest = prediction_digest(x0)

    def observe_output(self, output: torch.Tensor) -> None:
        """What the run returned to the host, as the sampler that continues a stage with leftover noise receives it:
        its fingerprint is where that sampler finds this stage's hand-over."""
        if self.hands_over:
            self.output_fingerprint = content_fingerprint(output)

    @property
    def start_fingerprint(self) -> str | None:
        if self._start_fingerprint is None and self.start_state is not None:
            self._start_fingerprint = noise_fingerprint(self.start_state)
        return self._start_fingerprint

    def stop_recording(self) -> None:
        """Record nothing more (an error in the recording): the run samples on and leaves no entry."""
        self.recorder = None

    def wants_step(self, step: int) -> bool:
        return self.recorder is not None and self.recorder.wants(step)

    @property
    def checkpoint_sigmas(self) -> set[float]:
        """The sigmas of the steps this run records (empty before `plan`)."""
        return {self.sigmas[step] for step in self.recorder.checkpoint_steps} if self.recorder is not None else set()

    @property
    def mask_donor(self) -> str | None:
        """The entry that lends this run its attention masks: the donor it resumed from, else its best candidate."""
        if self.decision is not None:
            return self.decision.target.meta.entry_id
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
            attention.lend(load_donor_masks(self.store, donor, self.stage, self.hard_key.model))

    # ------------------------------------------------------------------ after sampling
    def finish(self, model_calls: int, attention: SparseAttentionRun | None = None,
               thumbnail: PreviewFrame | None = None) -> RunReport:
        """Submit the entry for background writing (or hand it to the stage that continues this one) and return the
        report."""
        self.model_calls = model_calls + (self._decider.model_calls if self._decider is not None else 0)
        if attention is not None:
            self.attention_summary = attention.summary()
        elapsed = time.perf_counter() - self.started_at
        self.store_problem = self.store_problem or self.store.unavailable
        if self.decision is not None or self.exact is not None:
            donor = self.exact.entry if self.exact is not None else self.decision.target.meta
            self.store.record_hit(donor.entry_id, self.skipped_steps * donor.sample_seconds / max(1, self.total_steps))
        recorded = self.settings.record and self.recorder is not None and self.exact is None
        self._hand_on(self._entry(elapsed, attention, thumbnail) if recorded else None)
        return self.report(elapsed)

    def _entry(self, elapsed: float, attention: SparseAttentionRun | None,
               thumbnail: PreviewFrame | None) -> PendingEntry:
        listing, blobs = self.recorder.blobs()
        masks_meta: dict[str, Any] = {}
        if attention is not None:
            masks = attention.own_masks() or attention.borrowed  # what attention estimated, else what it used
            if masks:
                masks_meta, mask_tensors = masks_to_blob(masks)
                blobs["masks"] = encode_tensors(mask_tensors)
        lineage = {}
        if self.decision is not None:
            lineage = {"donor_id": self.decision.target.meta.entry_id, "depth": self.skipped_steps}
        # work of a full run, so that saved-work estimates stay honest for entries that themselves reused
        full_seconds = elapsed * self.total_steps / max(1, self.total_steps - self.skipped_steps)
        extra: dict[str, Any] = {"sigmas": [round(s, 6) for s in self.sigmas]}
        if self.noise_process is not None:
            extra[NOISE_PROCESS] = self.noise_process.record(self.sigmas)
        if self._repeatable(attention):
            extra[EXACT] = {"key": self.exact_key, "first": self.first_digest}
            blobs[final_blob(0)] = encode_tensors({FINAL_TENSOR: self.output})
        if self.recorder.end is not None:
            extra["stage_end"] = {"sigma": self.recorder.end[0]}
        if self.input_latent is not None:
            extra[INPUT_START] = True
        if self.guide_image is not None:
            extra[GUIDE_IMAGE] = True
        if self.guidance_form is not None:
            extra[GUIDANCE_FORM] = self.guidance_form
        meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=self.hard_key, prompt=self.settings.prompt,
                         latent_shape=tuple(self.latent_shape), noise_fingerprint=self.noise_fingerprint,
                         cfg=float(self.cfg), seed=self.seed, total_steps=self.total_steps,
                         sample_seconds=full_seconds, checkpoints=listing, masks=masks_meta, lineage=lineage,
                         extra=extra)
        return PendingEntry(store=self.store, meta=meta, blobs=blobs, cond_vector=self.cond_vector,
                            text_vector=self.text_vector, thumbnail=thumbnail)

    def _repeatable(self, attention: SparseAttentionRun | None) -> bool:
        """Whether a later exact repeat may be served this run's output: a stage sampled plain from its own start (no
        resume, every attention call dense), with its exact key, first prediction and output known."""
        dense = attention is None or not self.attention_summary.get("sparse_calls")
        return (self.exact_key is not None and self.decision is None and dense
                and self.first_digest is not None and self.output is not None)

    def _hand_on(self, entry: PendingEntry | None) -> None:
        """Write the request's entry, or keep it for the sampler that continues this stage. A later stage adds its
        record to the entry its first stage left."""
        if self.continues is not None:
            whole = self.continues.pending
            if whole is not None and entry is not None:
                end = entry.meta.extra.get("stage_end")
                append_stage(whole, self.stage, self.hard_key, self.total_steps, entry.meta.checkpoints, entry.blobs,
                             entry.meta.masks, end["sigma"] if end else None, entry.thumbnail,
                             entry.meta.extra.get(EXACT))
            entry = whole
        if self.hands_over and self.output_fingerprint is not None:
            first_step = self.continues.next_step if self.continues is not None else 0
            donor, difference = None, None
            if self.decision is not None and self.continues is None:
                donor, difference = self.decision.target.meta, self.decision.difference
            elif self.decision is not None:
                donor, difference = self.continues.donor, self.continues.difference
            handover_registry().park(self.output_fingerprint, Handover(
                sigma=self.sigmas[-1], next_stage=self.stage + 1, next_step=first_step + self.total_steps,
                pending=entry, donor=donor, mask_donor=self.mask_donor, difference=difference,
                repeated=self.exact.entry if self.exact is not None else None))
        elif entry is not None:
            entry_writer().submit(entry)

    @property
    def skipped_steps(self) -> int:
        """The request's steps a decision saved: up to its resume step, or the whole stage it skipped (an exact
        repeat: every step after the first)."""
        if self.exact is not None:
            return self.total_steps - 1
        if self.decision is None:
            return 0
        return self.total_steps if self.decision.end is not None else self.decision.step

    def report(self, elapsed: float) -> RunReport:
        best = self.decision.target if self.decision is not None else None
        candidate = best.candidate if best is not None else (self.match.best if self.match else None)
        skipped_steps = self.skipped_steps
        reason = self.outcome.reason if self.outcome is not None else Reason("not sampled", "no decision was made")
        if self.exact is not None:
            return self._exact_report(elapsed)
        per_step = elapsed / max(1, self.total_steps - skipped_steps)
        signals = self.decision.signals if self.decision is not None else None
        return RunReport(
            hit=best is not None or bool(self.attention_summary.get("borrowed_sparse_calls")),
            mode=self.settings.mode,
            prompt=self.settings.prompt,
            judged_by=self.settings.judged_by,
            donor_id=best.meta.entry_id if best else None,
            donor_prompt=best.meta.prompt if best else None,
            text_similarity=candidate.text_similarity if candidate else None,
            agreement=signals.raw_agreement if signals else None,
            structure_agreement=signals.structure_agreement if signals else None,
            guidance_cosine=signals.guidance_cosine if signals else None,
            other_parts_agreement=signals.other_parts_agreement if signals else (),
            skipped_steps=skipped_steps,
            total_steps=self.total_steps,
            resumed_at=self._resumed_at(),
            attention=self.attention_summary,
            model_calls=self.model_calls,
            time_s=elapsed,
            time_saved_s=per_step * skipped_steps,
            reason=reason.text,
            probes=list(self.probes),
            candidates=[{"entry_id": c.entry_id, "prompt": c.prompt, "score": c.score}
                        for c in (self.match.candidates if self.match else [])],
            filtered=dict(self.match.filtered) if self.match else {},
            skipped_donors=dict(self.skipped),
            notes=self._notes(),
            stage=self._stage_summary(),
        )

    def _exact_report(self, elapsed: float) -> RunReport:
        entry = self.exact.entry
        return RunReport(hit=True, exact_repeat=True, mode=self.settings.mode, prompt=self.settings.prompt,
                         judged_by=self.settings.judged_by, donor_id=entry.entry_id, donor_prompt=entry.prompt,
                         skipped_steps=self.skipped_steps, total_steps=self.total_steps,
                         attention=self.attention_summary, model_calls=self.model_calls, time_s=elapsed,
                         time_saved_s=entry.sample_seconds * self.skipped_steps / max(1, self.total_steps),
                         reason=f"exact repeat of {entry.entry_id[:8]}: {self.model_calls} of {self.total_steps} "
                                "model calls", notes=self._notes(), stage=self._stage_summary())

    def _resumed_at(self) -> dict[str, Any]:
        """Where a resume entered this run's schedule, and where the donor recorded that state: its sigma, the
        donor's step and step count (empty without a resume)."""
        if self.decision is None or self.decision.end is not None:
            return {}
        target = self.decision.target
        return {"sigma": round(float(target.sigma), 6), "donor_step": target.recorded_step,
                "donor_steps": target.meta.total_steps}

    def _stage_summary(self) -> dict[str, Any]:
        if self.continues is None and not self.hands_over:
            return {}
        return {"index": self.stage, "first_step": self.continues.next_step if self.continues is not None else 0,
                "hands_over": self.hands_over, "skipped_whole": self.decision is not None and self.decision.skips_stage}

    def _notes(self) -> list[str]:
        notes = list(self.match.notes if self.match else [])
        if self.settings.prompt_note:  # says more than the lookup's "no prompt text given"
            notes = [self.settings.prompt_note] + [note for note in notes if self.settings.prompt
                                                   or not note.startswith("no prompt text given")]
        notes += self.plan_notes
        if self.replayed:
            notes.append(REPLAY_NOTE)
        if self.input_latent is not None:
            notes.append(INPUT_NOTE)
        if self.input_note:
            notes.append(self.input_note)
        if self.guide_image is not None:
            notes.append(GUIDE_NOTE)
        if self.settings.thresholds_note:
            notes.append(self.settings.thresholds_note)
        if self.settings.profile_verdict and self.decision is not None:
            notes.append(self.settings.profile_verdict)
        if self.settings.forced_resume_fraction is not None:
            notes.append(f"verification {self.settings.verification!r}: resumed whatever the signals say (calibration)")
        if self.store_problem and not any("store unavailable" in note for note in notes):
            notes.append(f"store unavailable, generating without reuse: {self.store_problem}")
        attention = self.attention_summary
        if attention.get("inactive"):
            notes.append(attention["inactive"])
        elif attention.get("heads_reuse") and not attention.get("borrowed_sparse_calls"):
            notes.append(MASKS_TOO_FULL)
        return notes

    def _miss_reason(self) -> Reason:
        """Why the run samples fresh: the first branch of the decision that ruled out a resume."""
        self.store_problem = self.store_problem or self.store.unavailable
        if self.store_problem:
            return Reason("store unavailable", STORE_UNAVAILABLE)
        if self.latent_reuse_refusal:
            return Reason("latent reuse refused", self.latent_reuse_refusal)
        if self.settings.max_resume_fraction <= 0:
            return Reason("latent reuse off", "mode 'safe': latent reuse off")
        if self.continues is not None and not self.probes:
            return Reason("continued stage", "continues a stage skipped to a donor's output: the mode's depth ends at "
                          "the boundary" if self.continues.donor is not None
                          else "continues a stage that sampled in full: no donor state")
        if self.match is None or not self.match.candidates:
            filtered = bool(self.match and self.match.filtered)
            return Reason("no candidate", "no candidate (all filtered)" if filtered else "no candidate")
        if self.probes:
            return Reason("probe rejected", "probe rejected")
        if self.settings.verification == "text-only" and self.candidate_checkpoints:
            return Reason("text similarity", "text similarity too low for the baseline's skip table")
        if self.skipped:
            return Reason("donors filtered", "filtered: " + ", ".join(sorted(self.skipped)))
        return Reason("no candidate", "no candidate")

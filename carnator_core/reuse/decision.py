"""The decision of one request: resume at a donor state, skip a stage whole, or miss; and the probes behind it.

`Decider.decide` takes the plan's targets (`carnator_core.reuse.plan`) and the live model (an `Evaluate` callback)
and returns a `Decision`. Its contract:

- the model judges: a resume or a stage skip happens only where `ProbeThresholds.passes` held for the live
  request's own evaluation against the donor's (the `text-only` verification is the one unverified baseline, and a
  forced resume, `forced N%`, what calibration measures: it resumes there whatever the signals, recording them);
- a same-noise donor the step-0 screen passed is probed, and resumed, at its state corrected by the step-0
  difference (`carnator_core.reuse.start_difference`), so an edit keeps the donor's trajectory only where the prompts
  agree; with CFG guidance only a difference of first states is corrected for (runs from an input);
- at most `max_probes` probe calls, and one step-0 screen that is the request's own first evaluation (it serves the
  sampler's first call on a miss); a miss costs at most one probe call, since a call that passes nothing ends
  probing unless an earlier one passed;
- a mode that contains a shallower one (fast contains balanced) asks what that mode asks, resumes at least as deep,
  and makes at most one call more: its deep state asked first, or one call deeper after that mode's pass (`_probe`);
  a miss after a failed deep-first call costs that call too;
- every call asked is one `ProbeRecord`, in the order asked, so the report shows each verdict and its signals.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from carnator_core.judging.probe_signals import ProbeSignals
from carnator_core.reuse.cached_evaluation import same_sigma
from carnator_core.reuse.plan import RequestFacts, ScreenOnly
from carnator_core.reuse.probe import (
    CONDITIONAL_BRANCHES,
    GUIDANCE_FORM,
    conditional_agreement,
    probe_signals,
    screen_basis,
)
from carnator_core.reuse.settings import ReuseSettings
from carnator_core.reuse.start_difference import StartDifference
from carnator_core.reuse.targets import ProbeTarget, StageEnd, StartPrediction
from carnator_core.store.entry import EntryMeta

log = logging.getLogger("carnator.decision")

# The live request's model at several states sharing one sigma, in one call: per state its
# (x0 prediction, guidance direction or None).
Evaluate = Callable[[list[torch.Tensor], float], list[tuple[torch.Tensor, torch.Tensor | None]]]


def text_similarity_depth(similarity: float) -> float:
    """NIRVANA's table as a line: similarity 0.65 skips 10% of the steps, 0.95 skips 50%; below 0.65 none."""
    if similarity < 0.65:
        return 0.0
    return min(0.5, 0.1 + (similarity - 0.65) / 0.30 * 0.4)


@dataclass(frozen=True)
class ProbeRecord:
    """One question put to the model about one donor state, and its answer."""

    donor_id: str
    donor_prompt: str
    step: int
    passed: bool
    donor_given_up: bool  # the donor missed by more than `give_up_margin`: no further probe of it
    batched_with: int  # other donors' states evaluated in the same call
    confirms_deeper: bool  # a step-0 screen or a shallow confirmation, not a resume candidate of its own
    signals: ProbeSignals
    boundary: bool = False  # a later stage's first evaluation at the donor output its first stage was skipped to
    screened_on: str = ""  # a step-0 screen's: what it judged the donor on (`screen_basis`)

    def as_dict(self) -> dict[str, Any]:
        """The report's JSON form: the record's fields with the signals flattened in."""
        data = {name: value for name, value in asdict(self).items()
                if name not in ("signals", "boundary", "screened_on")}
        data.update(self.signals.as_dict())
        if self.boundary:
            data["boundary"] = True
        if self.screened_on:
            data["screened_on"] = self.screened_on
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProbeRecord:
        """The record behind its JSON (clients reading a report back)."""
        signals = ProbeSignals(depth=float(data.get("depth", 0.0)), raw_agreement=float(data.get("raw_agreement", 0.0)),
                               structure_agreement=float(data.get("structure_agreement", 0.0)),
                               guidance_cosine=data.get("guidance_cosine"),
                               other_parts_agreement=tuple(float(v) for v in data.get("other_parts_agreement", ())),
                               corrected=bool(data.get("corrected")),
                               conditional_agreement=data.get("conditional_agreement"))
        return cls(donor_id=str(data.get("donor_id", "")), donor_prompt=str(data.get("donor_prompt", "")),
                   step=int(data.get("step", 0)), passed=bool(data.get("passed")),
                   donor_given_up=bool(data.get("donor_given_up")), batched_with=int(data.get("batched_with", 0)),
                   confirms_deeper=bool(data.get("confirms_deeper")), signals=signals,
                   boundary=bool(data.get("boundary")), screened_on=str(data.get("screened_on", "")))


@dataclass
class Decision:
    """What the request does with a donor: resume sampling at `target` (`step` > 0), or skip the stage whole and
    return the donor stage's output (`end`). A request without a Decision is a miss; the report says why."""

    target: ProbeTarget
    signals: ProbeSignals | None  # None for the unverified text-similarity baseline
    x0: torch.Tensor | None  # the live model's prediction at the resume state: reused as step `step`'s evaluation
    guidance: torch.Tensor | None = None  # and its guidance direction, recorded with it
    end: StageEnd | None = None  # the stage is skipped whole: the run returns the donor stage's output
    # what the request's step 0 differs by from the donor's, when the donor was screened: the resume state and a
    # skipped stage's output are corrected by it, and so are the donor states a later stage continues from
    difference: StartDifference | None = None
    branch: str = "probe passed"  # which branch of the decision chose it (`Reason.branch`)

    @property
    def skips_stage(self) -> bool:
        return self.end is not None

    @property
    def step(self) -> int:
        """The step sampling resumes at (the stage's length when it is skipped whole)."""
        return self.target.meta.total_steps if self.end is not None else self.target.step


def _continues(target: ProbeTarget, donors: set[str]) -> bool:
    """Whether `target` lies on the trajectory of one of `donors`: its donor resumed from them (up the lineage that
    gives the target its anchor), so a pass on their state makes the target a deeper state of the same line."""
    return target.anchor is not None and target.anchor.meta.entry_id in donors


@dataclass
class Decider:
    """Asks the live model about a plan's targets, in the order and within the budget the contract above sets.

    `start_state` (the state the sampler starts from) and its fingerprint enable the step-0 screen; `on_start`
    receives the request's own step-0 evaluation when the screen makes it (the run records it as its step 0).
    """

    settings: ReuseSettings
    facts: RequestFacts
    sigmas: list[float]
    start_state: torch.Tensor | None = None
    start_fingerprint: str | None = None
    on_start: Callable[[float, torch.Tensor, torch.Tensor, torch.Tensor | None], None] | None = None
    cfg: float = 1.0  # the sampler's guidance scale: with CFG the screen may judge the conditional branches
    guidance_form: str | None = None  # `ReuseRun.guidance_form`: where it matches a donor's, the screen does
    probes: list[ProbeRecord] = field(default_factory=list)
    model_calls: int = 0
    # The request's own step-0 evaluation (x0, guidance) when the screen made it: without a resume the sampler's
    # first call is served from it, so the screen costs a miss nothing.
    start_evaluation: tuple[torch.Tensor, torch.Tensor | None] | None = None
    # the donors that passed the step-0 screen: their signals there, and what the request's step 0 differs by
    _screened: dict[str, tuple[ProbeSignals, StartDifference | None]] = field(default_factory=dict, init=False, repr=False)

    def decide(self, targets: list[ProbeTarget | ScreenOnly], evaluate: Evaluate,
               batch_limit: int = 1) -> Decision | None:
        """Evaluate targets in plan order; resume from the deepest checkpoint whose signals pass, or skip the stage.

        Each call takes the next unprobed target together with up to `batch_limit - 1` later ones at the same step
        (other donors' checkpoints), so one evaluation probes several candidates. A call with a pass ends probing
        and resumes from its first passing target: all targets of a call share one depth, and later calls are only
        shallower or lower-ranked. A donor the screen did not confirm at step 0 is asked at its shallowest checkpoint
        first (`ProbeTarget.anchor`) and, where that passes, deeper (`_probe`).
        """
        pending = [target for target in targets if isinstance(target, ProbeTarget)]
        if self.settings.verification == "text-only":
            return self._by_text_similarity(pending)
        forced = self.settings.forced_resume_fraction is not None
        if self.start_state is not None and self.settings.max_probes > 0:
            pending = self._screen(list(targets), evaluate, keep_failed=forced)
            skip = None if forced else self._skip_stage(pending)
            if skip is not None:
                return skip
        if forced:
            return self._forced(pending, evaluate)
        return self._probe(pending, evaluate, batch_limit)

    def _probe(self, pending: list[ProbeTarget], evaluate: Evaluate, batch_limit: int) -> Decision | None:
        """The probe calls of `decide`, within the budget; a miss costs at most one of them.

        A mode that contains a shallower one (fast contains balanced, `ReuseSettings.contained_resume_fraction`) makes
        at most one call beyond that mode's and never resumes shallower than it, in any store: where the step-0 screen
        makes a deeper state likely (`_likely_deep`) it asks that state first and, where it fails, asks the states
        within that mode's depth exactly as that mode does (`_probe_within`), going no deeper. Otherwise, where the
        donor the screen agreed with most resumed deeper than that depth, it asks its line's state first
        (`_lead_line_state`) and, where that fails, asks as that mode does, going no deeper; else it asks as that mode
        does. From a pass at that mode's depth it goes one call deeper (`_deepen`). Where no donor holds a state within
        that depth (that mode misses), the deeper states are climbed as the mode's own.
        """
        contained = self._contained_step()
        if contained is None:
            return self._probe_within(pending, evaluate, batch_limit)[0]
        deeper = [t for t in pending if t.step > contained]
        within = [t for t in pending if t.step <= contained]
        first = self._likely_deep(deeper)
        if first is not None:
            decision = self._ask(first, evaluate)
            if decision is not None or not within:
                return decision
            return self._probe_within(within, evaluate, batch_limit)[0]
        if not within:
            return self._probe_within(deeper, evaluate, batch_limit)[0]
        line_state = self._lead_line_state(within, deeper)
        decision = self._ask(line_state, evaluate) if line_state is not None else None
        if decision is None and line_state is not None:
            if self._first_call(within, batch_limit) == [line_state]:
                return None  # the contained mode asks this state first, alone: it fails there and ends probing
            # the state's verdict is known: the contained mode's other calls, without asking it again
            return self._probe_within([t for t in within if t is not line_state], evaluate, batch_limit)[0]
        if decision is None:
            decision, _ = self._probe_within(within, evaluate, batch_limit)
        if decision is None or not deeper:
            return decision
        donor = decision.target.candidate.entry_id
        if decision.step < max((t.step for t in within if t.candidate.entry_id == donor), default=0):
            return decision  # the shallower mode stopped short of its depth: a state deeper than this one failed
        line = {donor, decision.target.meta.entry_id}
        return self._deepen(decision, [t for t in deeper if t.candidate.entry_id == donor or _continues(t, line)],
                            evaluate)

    def _first_call(self, pending: list[ProbeTarget], batch_limit: int) -> list[ProbeTarget] | None:
        """The targets `_probe_within` evaluates in its first call on `pending`; None where that call is an anchor's."""
        first = pending[0]
        if first.anchor is not None and not self._enters_deep(first):
            return None
        return self._call(pending, batch_limit)

    def _call(self, pending: list[ProbeTarget], batch_limit: int) -> list[ProbeTarget]:
        """The first pending target and, up to `batch_limit`, other donors' states at its step: another donor's state
        joins the call only if it needs no anchor call first."""
        first = pending[0]
        return [t for t in pending if t.step == first.step and (
            t.anchor is None or self._enters_deep(t))][:max(1, batch_limit)]

    def _lead_line_state(self, within: list[ProbeTarget], deeper: list[ProbeTarget]) -> ProbeTarget | None:
        """The state within the contained mode's depth to ask first where the donor the step-0 screen agreed with most
        holds only deeper states (it resumed deeper than that depth): the deepest state within that depth of the donor
        it continues (its line), where that state lies at the deepest step any donor holds within the depth and the
        lead's screen cleared its bar by the give-up margin. Up to its resume step the lead's trajectory is that
        state's line, so the contained mode, in a store where the lead resumed within its depth, asks the same state
        first on the same screen. None where there is no such lead or state."""
        holders = {t.meta.entry_id for t in within}
        lead = max(deeper, key=self._screen_agreement, default=None)
        if lead is None or lead.meta.entry_id in holders or lead.anchor is None or \
                self._screen_agreement(lead) <= max(map(self._screen_agreement, within)):
            return None
        line = lead.anchor.meta.entry_id
        deepest = max(t.step for t in within)
        state = next((t for t in within if t.meta.entry_id == line and t.step == deepest), None)
        return state if state is not None and self._screen_clears(lead, state.depth) else None

    def _likely_deep(self, deeper: list[ProbeTarget]) -> ProbeTarget | None:
        """The deepest state of all, of the donor the step-0 screen agreed with most, where that donor's screen cleared
        the state's bar by the deep-first margin (`ProbeThresholds.deep_first_margin`): the state to ask first. Why
        that margin and not the give-up margin that lets a donor skip its anchor: here a failed first call costs one
        call (what the contained mode asks follows), and a pass saves at least one, so the deep probe need only be more
        likely to pass than not, and on the calibration streams it is from that margin up; the one-attribute edit the
        screen cannot tell from a rewording fails it and costs one call (docs/measurements.md, "Deep first where the
        screen makes it likely"). On a 3- or 4-step stage that call is the whole of fast's saving over the contained
        mode. A shallower deep state the screen clears is not asked first: a pass at the contained mode's depth may
        make the deepest one likely, which saves more. None where no state is that likely."""
        deepest = max((t.step for t in deeper), default=None)
        margin = self.settings.thresholds.deep_first_margin
        likely = [t for t in deeper if t.step == deepest and self._screen_clears(t, t.depth, margin)]
        return max(likely, key=self._screen_agreement, default=None)

    def _probe_within(self, pending: list[ProbeTarget], evaluate: Evaluate,
                      batch_limit: int) -> tuple[Decision | None, int]:
        """Deepest target first; the decision and the calls it took.

        A target is asked at its anchor first, where the prompt still decides layout and motion, unless its donor's
        step-0 screen cleared the target's own depth bar by the give-up margin (`_enters_deep`); a pass at the
        anchor is held (the request may resume at it) and only then is the donor asked deeper, at most to the
        budget, resuming at the deepest pass. A call that passes nothing ends probing: a request that holds nothing
        is a miss at the cost of that one call, and one that holds a pass resumes there.
        """
        thresholds = self.settings.thresholds
        held: Decision | None = None
        calls = 0
        for _ in range(self.settings.max_probes):
            if not pending:
                break
            first = pending[0]
            calls += 1
            if held is None and first.anchor is not None and not self._enters_deep(first):
                held = self._ask_anchor(first, evaluate)
                if held is None:
                    return None, calls
                # only the held donor's deeper states are worth a call now: others would need their own anchor
                pending = [replace(t, anchor=None) for t in pending
                           if t.meta.entry_id == first.meta.entry_id and t.step > held.step]
                continue
            call = self._call(pending, batch_limit)
            pending = [t for t in pending if not any(t is c for c in call)]
            results = evaluate([t.x for t in call], call[0].sigma)
            self.model_calls += 1
            decision = None
            for target, (x0_new, guidance_new) in zip(call, results, strict=True):
                signals = self._signals(target.depth, target.x, x0_new, target.x0, guidance_new, target.guidance,
                                        corrected=target.corrected)
                passed = thresholds.passes(signals)
                self._record(target.meta, target.step, signals, passed, not passed and thresholds.donor_hopeless(signals),
                             batched_with=len(call) - 1)
                if passed and decision is None:
                    decision = Decision(target=target, signals=signals, x0=x0_new, guidance=guidance_new,
                                        difference=self._difference(target))
            if decision is not None or held is None:
                return decision, calls
        return held, calls

    def _deepen(self, decision: Decision, deeper: list[ProbeTarget], evaluate: Evaluate) -> Decision:
        """From a pass, one call at the deepest of the donor's deeper states that the pass makes likely; a failed call
        resumes at the pass. A state one step deeper is never asked: its call would be the pass's next step's, so it
        saves nothing (a 3- or 4-step schedule).

        Likely: the pass's signals clear the deeper state's bar with room to spare as large as the bar's own rise
        between the two depths (they pass at the depth as far beyond the deeper state as that state lies beyond the
        pass). At a corrected state agreement falls with depth, and falls fastest for an edit the remaining steps can
        no longer fix, so a pass that only just clears the deeper bar predicts a failed call."""
        signals = decision.signals
        likely = [t for t in deeper if t.step > decision.step + 1 and signals is not None
                  and self.settings.thresholds.passes(replace(signals, depth=2 * t.depth - signals.depth))]
        if not likely:
            return decision
        return self._ask(likely[0], evaluate) or decision

    def _contained_step(self) -> int | None:
        """The deepest step of the shallower mode this one contains (`ReuseSettings.contained_resume_fraction`)."""
        fraction = self.settings.contained_resume_fraction
        return None if fraction is None else self.facts.max_step(fraction)

    def _ask(self, target: ProbeTarget, evaluate: Evaluate) -> Decision | None:
        """One call at `target` alone: the resume it allows, or None when it fails."""
        [(x0_new, guidance_new)] = evaluate([target.x], target.sigma)
        self.model_calls += 1
        signals = self._signals(target.depth, target.x, x0_new, target.x0, guidance_new, target.guidance,
                                corrected=target.corrected)
        thresholds = self.settings.thresholds
        passed = thresholds.passes(signals)
        self._record(target.meta, target.step, signals, passed, not passed and thresholds.donor_hopeless(signals),
                     batched_with=0)
        if not passed:
            return None
        return Decision(target=target, signals=signals, x0=x0_new, guidance=guidance_new,
                        difference=self._difference(target))

    def _skip_stage(self, screened: list[ProbeTarget]) -> Decision | None:
        """Skip this stage whole when a donor confirmed at step 0 recorded its output and a later stage, the stage's
        share of the trajectory lies within the mode's depth and the screen passes at that depth's thresholds: the
        run returns the output of the donor it agrees with most, corrected by the step-0 difference, and the next
        stage starts from it (its own model's first evaluation there is the boundary check)."""
        if self.sigmas[-1] <= 0.0 or self.facts.stage != 0:
            return None
        limit = self.settings.max_resume_fraction + 1e-9
        skips = []
        for target in screened:
            record = self._screened.get(target.meta.entry_id)
            if target.end is None or record is None or target.end.share > limit \
                    or not same_sigma(target.end.sigma, self.sigmas[-1]):
                continue
            # the screen must pass at the depth the skip reaches, as a probe there would
            signals, difference = record
            if self.settings.thresholds.passes(replace(signals, depth=target.end.share)):
                skips.append((signals.weakest_structure, -len(skips), target, signals, difference))
        if not skips:
            return None
        # the donor the request agrees with most: a one-attribute edit of the scene can pass the screen too
        _, _, target, signals, difference = max(skips, key=lambda skip: skip[:2])
        end = target.end if difference is None else replace(
            target.end, latent=difference.state_at(target.end.latent, target.end.sigma))
        return Decision(target=target, signals=signals, x0=None, end=end, difference=difference,
                        branch="stage skipped: the step-0 screen passed at the stage's depth")

    def _screen(self, targets: list[ProbeTarget | ScreenOnly], evaluate: Evaluate,
                keep_failed: bool = False) -> list[ProbeTarget]:
        """Confirm donors at step 0 with the live request's own first evaluation, before any deep probe.

        A donor sampled from the same initial noise started from this very state, and step 0 is where the prompt
        decides the most (docs/measurements.md, "Probe calibration"), so one call judges every such donor at once.
        It is not extra work: without a resume the sampler's first call is served from it (`start_evaluation`);
        with one it replaces the confirmation of the deep pass. Donors that fail get no probe; those that pass need
        no confirmation later, and are probed and resumed at their states corrected by what the two step-0
        predictions differ by (`carnator_core.reuse.start_difference`). Others are left as they were. With
        `keep_failed` (a forced resume) a donor that fails is kept as if it had passed, its verdict still recorded.
        """
        start_state = self.start_state
        starts = {t.meta.entry_id: t.start for t in targets if t.start is not None and (
            t.start.state == self.start_fingerprint or (self.facts.from_input and t.start.x is not None))}
        if not starts:
            return [target for target in targets if isinstance(target, ProbeTarget)]
        sigma = self.sigmas[0]
        [(x0_new, guidance_new)] = evaluate([start_state], sigma)
        self.model_calls += 1
        self.start_evaluation = (x0_new, guidance_new)
        if self.on_start is not None:
            self.on_start(sigma, start_state, x0_new, guidance_new)
        ruled_out: set[str] = set()
        for entry_id, start in starts.items():
            # a donor from another input started elsewhere: its prediction is judged against its own first state
            state = start.x.to(start_state.device) if start.x is not None else start_state
            signals = self._signals(0.0, state, x0_new, start.x0, guidance_new, start.guidance)
            basis = screen_basis(self.cfg, guidance_new, self.facts.packed is not None, self.guidance_form,
                                 start.meta.extra.get(GUIDANCE_FORM))
            if basis == CONDITIONAL_BRANCHES:
                # judged on the conditional branches: the output's agreement falls with the guidance scale alone
                signals = replace(signals, conditional_agreement=conditional_agreement(
                    state, x0_new, start.x0, guidance_new, self.cfg))
            passed = self.settings.thresholds.passes(signals)
            self._record(start.meta, 0, signals, passed, not passed, batched_with=0, confirms=True,
                         screened_on=basis)
            if not passed and not keep_failed:
                ruled_out.add(entry_id)
            else:
                difference = StartDifference.between(start, x0_new, guidance_new, start_state)
                # the conditional branches admit a donor; what follows (deep first, order, a stage skip) weighs the
                # output's agreement, which every later call is judged on
                self._screened[entry_id] = (replace(signals, conditional_agreement=None),
                                            difference if guidance_new is None else difference.without_prediction())
        kept = []
        for planned in targets:
            if planned.meta.entry_id in ruled_out:
                continue
            if isinstance(planned, ProbeTarget):
                loaded = [planned]
            else:  # a screen-only donor passed: now its states are read
                loaded = planned.load() if planned.meta.entry_id in starts else []
            for target in loaded:
                difference = self._difference(target)
                if difference is not None:  # screened: probed, and resumed, at its states corrected
                    anchor = target.anchor and difference.corrected(target.anchor)
                    target = replace(difference.corrected(target), anchor=anchor)
                kept.append(target)
        return sorted(kept, key=lambda target: (-target.step, -self._screen_agreement(target)))

    def _screen_agreement(self, target: ProbeTarget) -> float:
        """How well the target's donor agreed at step 0 (the screen's structure agreement; below every agreement for
        a donor the screen did not judge). At equal depth a donor the model agrees with more is asked first: the
        lookup's ranking is by text and conditioning, which the screen has since judged."""
        screened = self._screened.get(target.meta.entry_id)
        agreement = screened[0].weakest_structure if screened is not None else float("nan")
        return agreement if agreement == agreement else -math.inf  # stable: otherwise the better-ranked donor first

    def _forced(self, pending: list[ProbeTarget], evaluate: Evaluate) -> Decision | None:
        """Resume at the deepest target within the forced depth, of the best-ranked donor, whatever the signals say:
        the probe there is made and recorded (with the verdict the thresholds give) so calibration can see what the
        engine would have judged."""
        if not pending:
            return None
        target = pending[0]
        [(x0_new, guidance_new)] = evaluate([target.x], target.sigma)
        self.model_calls += 1
        signals = self._signals(target.depth, target.x, x0_new, target.x0, guidance_new, target.guidance,
                                corrected=target.corrected)
        self._record(target.meta, target.step, signals, self.settings.thresholds.passes(signals), False, batched_with=0)
        return Decision(target=target, signals=signals, x0=x0_new, guidance=guidance_new,
                        difference=self._difference(target), branch="forced resume (calibration)")

    def _difference(self, target: ProbeTarget) -> StartDifference | None:
        """What the request's step 0 differs by from the target donor's, when the screen passed it."""
        screened = self._screened.get(target.meta.entry_id)
        return screened[1] if screened is not None else None

    def _enters_deep(self, target: ProbeTarget) -> bool:
        """Whether to ask `target` before its anchor: its donor's step-0 screen passed at the target's depth with the
        give-up margin to spare. Why: a deep pass asked first costs no anchor call (a hit's cost is its steps and
        one call), but a deep miss ends probing, so only a donor the screen says is nearly certain goes first deep;
        the others climb from the anchor, where a one-word edit still passes."""
        return self._screen_clears(target, target.depth)

    def _screen_clears(self, target: ProbeTarget, depth: float, margin: float | None = None) -> bool:
        """Whether the target donor's step-0 screen passed at `depth` with `margin` (default: the give-up margin) to
        spare."""
        screened = self._screened.get(target.meta.entry_id)
        if screened is None:
            return False
        thresholds = self.settings.thresholds
        return thresholds.screen_clears(replace(screened[0], depth=depth),
                                        thresholds.give_up_margin if margin is None else margin)

    def _ask_anchor(self, target: ProbeTarget, evaluate: Evaluate) -> Decision | None:
        """One call at the target donor's shallowest checkpoint, where the prompt still decides layout and motion: a
        deeper pass counts only if the donor's trajectory is one the new prompt would have taken there. Returns the
        resume it allows there, or None when it fails."""
        anchor = target.anchor
        [(x0_new, guidance_new)] = evaluate([anchor.x], anchor.sigma)
        self.model_calls += 1
        signals = self._signals(anchor.depth, anchor.x, x0_new, anchor.x0, guidance_new, anchor.guidance,
                                corrected=anchor.corrected)
        confirmed = self.settings.thresholds.passes(signals)
        self._record(anchor.meta, anchor.step, signals, confirmed, not confirmed, batched_with=0, confirms=True)
        if not confirmed:
            return None
        return Decision(target=anchor, signals=signals, x0=x0_new, guidance=guidance_new,
                        difference=self._difference(target), branch="anchor passed, no deeper state did")

    def check_boundary(self, boundary: StartPrediction, x: torch.Tensor, x0: torch.Tensor,
                       guidance: torch.Tensor | None) -> None:
        """Compare a later stage's first evaluation, at the donor output the previous stage was skipped to, with the
        donor's own there. It changes nothing (the skip is done); the report shows it beside the step-0 screen."""
        donor_guidance = boundary.guidance.to(x0.device) if boundary.guidance is not None else None
        signals = self._signals(0.0, x, x0, boundary.x0.to(x0.device), guidance, donor_guidance)
        passed = self.settings.thresholds.passes(signals)
        self._record(boundary.meta, 0, signals, passed, False, batched_with=0, confirms=True, boundary=True)
        if not passed:
            log.warning("Carnator: the state stage %d was skipped to disagrees at the boundary with donor %s (%s)",
                        self.facts.stage - 1, boundary.meta.entry_id[:8], signals.as_dict())

    def _signals(self, depth: float, state: torch.Tensor, x0_new: torch.Tensor, x0_donor: torch.Tensor,
                 guidance_new: torch.Tensor | None, guidance_donor: torch.Tensor | None,
                 corrected: bool = False) -> ProbeSignals:
        """`probe_signals` on this request's latent (judged part by part when it is packed)."""
        return probe_signals(depth, state, x0_new, x0_donor, guidance_new, guidance_donor, self.facts.packed,
                             corrected)

    def _record(self, donor: EntryMeta, step: int, signals: ProbeSignals, passed: bool, given_up: bool,
                batched_with: int, confirms: bool = False, boundary: bool = False, screened_on: str = "") -> None:
        self.probes.append(ProbeRecord(donor_id=donor.entry_id, donor_prompt=donor.prompt, step=step, passed=passed,
                                       donor_given_up=given_up, batched_with=batched_with, confirms_deeper=confirms,
                                       signals=signals, boundary=boundary, screened_on=screened_on))

    @staticmethod
    def _by_text_similarity(targets: list[ProbeTarget]) -> Decision | None:
        """Baseline (NIRVANA/Chorus style): skip depth from prompt similarity alone, no model check."""
        for target in targets:
            similarity = target.candidate.text_similarity
            similarity = target.candidate.score if similarity is None else similarity
            if target.depth <= text_similarity_depth(similarity):
                return Decision(target=target, signals=None, x0=None, branch="text similarity (unverified baseline)")
        return None

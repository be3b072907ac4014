"""The probe plan and probing: which donor checkpoints get the limited probe budget, in which order."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from carnator_core.judging.probe_thresholds import ProbeThresholds
from carnator_core.lookup.compatible import Match
from carnator_core.lookup.fingerprint import noise_fingerprint
from carnator_core.lookup.shortlist import Candidate
from carnator_core.reuse.decision import Decision
from carnator_core.reuse.plan import RequestFacts, ScreenOnly, plan_probes
from carnator_core.reuse.recording import RunRecorder
from carnator_core.reuse.run import ReuseRun
from carnator_core.reuse.settings import ReuseSettings
from carnator_core.store.entry import CheckpointRecord, EntryMeta, HardKey
from carnator_core.store.reuse_store import IndexVectors, ReuseStore
from carnator_core.store.tensor_codec import encode_tensors

SHAPE = (1, 16, 2, 8, 8)
FACTS = RequestFacts(schedule="schedule", latent_shape=SHAPE, noise_fingerprint="noise", total_steps=10)


KEY = HardKey("model", (2, 4, 4), "schedule")


def _donor(store: ReuseStore, name: str, steps: list[int], tensors: dict | None = None,
           extrapolated: tuple[int, ...] = (), lineage: dict | None = None, start: str | None = None) -> Candidate:
    """A stored donor with checkpoints at `steps`; with `start` also its step-0 prediction (tensors' "x0_0") made at
    the state of that fingerprint."""
    checkpoints = [CheckpointRecord(step=s, sigma=1 - s / 10, evaluated=s not in extrapolated)
                   for s in steps]
    if start is not None:
        checkpoints.insert(0, CheckpointRecord(step=0, sigma=1.0, start=start))
    meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=KEY, prompt=name, lineage=lineage or {},
                     latent_shape=SHAPE, noise_fingerprint="noise", total_steps=10, checkpoints=checkpoints)
    tensors = tensors or {f"{kind}_{s}": torch.full(SHAPE, float(s)) for s in steps for kind in ("x", "x0")}
    store.put(meta, {"checkpoints": encode_tensors(tensors)},
              IndexVectors(text=None, cond=torch.nn.functional.normalize(torch.ones(256), dim=0)))
    return Candidate(entry_id=meta.entry_id, prompt=name, score=1.0, cond_similarity=1.0, text_similarity=None)


States = dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]  # (donor, step) -> (x, x0)


def _random_states(steps: dict[str, tuple[int, ...]], seed: int) -> States:
    generator = torch.Generator().manual_seed(seed)
    return {(name, step): (torch.randn(SHAPE, generator=generator), torch.randn(SHAPE, generator=generator))
            for name, donor_steps in steps.items() for step in donor_steps}


def _blob(states: States, name: str) -> dict[str, torch.Tensor]:
    return {f"{kind}_{step}": pair[i] for (owner, step), pair in states.items() if owner == name
            for i, kind in enumerate(("x", "x0"))}


def _probed(states: States, x: torch.Tensor) -> tuple[tuple[str, int], torch.Tensor]:
    """Which donor checkpoint a probe call evaluates (by its state), and that donor's prediction there."""
    key, (_, x0) = next((key, pair) for key, pair in states.items() if torch.equal(pair[0], x.float()))
    return key, x0


def _run(store: ReuseStore, mode: str = "balanced", max_probes: int = 3) -> ReuseRun:
    """A 10-step run of `mode` with `max_probes` probe calls, against `store`."""
    return ReuseRun(settings=ReuseSettings(mode=mode, max_probes=max_probes), store=store, hard_key=KEY, latent_shape=SHAPE,
                    noise_fingerprint="noise", cond_vector=torch.ones(256), sigmas=[1 - s / 10 for s in range(11)],
                    cfg=1.0, seed=0)


def test_every_donor_is_probed_at_depth_before_any_is_probed_shallower(tmp_path):
    """With three probes and two donors, the second-ranked donor gets its deepest checkpoint probed
    (one donor's every depth would otherwise take the whole budget)."""
    store = ReuseStore(str(tmp_path / "store"))
    first, second = _donor(store, "first", [2, 3, 5, 8]), _donor(store, "resumed", [5])
    targets, skipped = plan_probes(store, [first, second], FACTS, max_fraction=0.5, same_noise_only=True,
                                   max_probes=3)
    assert [(t.candidate.prompt, t.step) for t in targets] == [("first", 5), ("resumed", 5), ("first", 3)]
    assert skipped == {}
    assert all(float(t.x.flatten()[0]) == t.step and t.sigma == 1 - t.step / 10 for t in targets)


def test_checkpoints_holding_a_step_cache_extrapolation_are_never_offered(tmp_path):
    store = ReuseStore(str(tmp_path / "store"))
    partly = _donor(store, "easycache donor", [3, 5], extrapolated=(5,))
    only = _donor(store, "all skipped", [5], extrapolated=(5,))
    targets, skipped = plan_probes(store, [partly, only], FACTS, max_fraction=0.5, same_noise_only=True, max_probes=3)
    assert [(t.candidate.prompt, t.step) for t in targets] == [("easycache donor", 3)]
    assert skipped == {"its checkpoints hold a step cache's extrapolation, not the model's": 1}


def test_a_call_that_passes_nothing_ends_probing(tmp_path):
    """A miss costs at most one probe call: the first donor's call fails, and the lower-ranked donor that would have
    passed is not asked (a failed call is a model call the request pays on top of its own steps)."""
    store = ReuseStore(str(tmp_path / "store"))
    states = _random_states({"wrong": (3, 5), "right": (3,)}, seed=0)
    wrong, right = _donor(store, "wrong", [3, 5], _blob(states, "wrong")), _donor(store, "right", [3], _blob(states, "right"))
    targets, _ = plan_probes(store, [wrong, right], FACTS, max_fraction=0.5, same_noise_only=True, max_probes=3)
    assert [(t.candidate.prompt, t.step) for t in targets] == [("wrong", 5), ("wrong", 3), ("right", 3)]

    def evaluate(xs: list[torch.Tensor], sigma: float) -> list[tuple[torch.Tensor, None]]:
        """The live model agrees with the right donor's prediction and not at all with the wrong one's."""
        (owner, _), x0 = _probed(states, xs[0])
        return [(x0 if owner == "right" else -x0, None)]

    run = _run(store)
    assert run.decider.decide(targets, evaluate) is None and run.decider.model_calls == 1
    assert [(p.donor_prompt, p.step, p.passed) for p in run.probes] == [("wrong", 3, False)]  # asked at its anchor


@pytest.mark.parametrize(("agrees_at", "calls", "resumed_at"), [
    ({2, 5}, 2, 5),  # asked at its anchor, then deeper: resumes at the deeper pass
    ({2}, 2, 2),  # the deeper call fails: resumes at the anchor it holds
    ({5}, 1, None),  # the anchor fails: a miss after one call, the deep pass never asked
])
def test_a_donor_the_screen_did_not_confirm_is_asked_at_its_shallowest_checkpoint_first(tmp_path, agrees_at, calls,
                                                                                          resumed_at):
    """Early in the schedule the prompt still picks the trajectory, later the model follows the state it is given: a
    donor without a step-0 screen is asked at its shallowest checkpoint first, and only after a pass there deeper.
    Every plan target carries its donor's shallowest checkpoint."""
    store = ReuseStore(str(tmp_path / "store"))
    states = _random_states({"donor": (2, 5)}, seed=3)
    donor = _donor(store, "donor", [2, 5], _blob(states, "donor"))
    targets, _ = plan_probes(store, [donor], FACTS, max_fraction=0.5, same_noise_only=True, max_probes=3)
    assert [(t.step, t.anchor and t.anchor.step) for t in targets] == [(5, 2), (2, None)]
    assert torch.equal(targets[0].anchor.x, states[("donor", 2)][0])

    def evaluate(xs: list[torch.Tensor], sigma: float) -> list[tuple[torch.Tensor, None]]:
        (_, step), x0 = _probed(states, xs[0])
        return [(x0 if step in agrees_at else -x0, None)]

    run = _run(store)
    resume = run.decider.decide(targets, evaluate)
    asked = [(2, 2 in agrees_at, True)] + ([(5, 5 in agrees_at, False)] if 2 in agrees_at else [])
    assert [(p.step, p.passed, p.confirms_deeper) for p in run.probes] == asked
    assert run.decider.model_calls == calls
    assert (resume and resume.target.step) == resumed_at


def test_a_donor_that_resumed_is_confirmed_on_its_own_donors_early_checkpoint(tmp_path):
    """A donor that resumed at step 5 recorded nothing earlier; its trajectory up to step 5 is its own donor's,
    so a deep pass on it is confirmed at that donor's shallowest checkpoint, up the lineage."""
    store = ReuseStore(str(tmp_path / "store"))
    root = _donor(store, "root", [2, 5])
    resumed = _donor(store, "resumed", [5], lineage={"donor_id": root.entry_id, "depth": 5})
    targets, _ = plan_probes(store, [resumed], FACTS, max_fraction=0.5, same_noise_only=True, max_probes=1)
    anchor = targets[0].anchor
    assert anchor is not None and anchor.step == 2 and anchor.meta.entry_id == root.entry_id
    orphan = _donor(store, "orphan", [5])
    targets, _ = plan_probes(store, [orphan], FACTS, max_fraction=0.5, same_noise_only=True, max_probes=1)
    assert targets[0].anchor is None  # no lineage: nothing shallower to confirm on


def test_the_requests_own_step_0_screens_every_donor_that_started_from_it(tmp_path):
    """Donors sampled from the same noise started from the live request's first state: one evaluation there (the
    request's own step 0) rules out the donor that disagrees before any deep probe and confirms the one that agrees,
    whose deep pass then needs no confirmation call. A donor that started elsewhere keeps its own anchor."""
    store = ReuseStore(str(tmp_path / "store"))
    steps = {"other scene": (2, 5), "same scene": (2, 5), "other seed": (2, 5)}
    states = _random_states(steps, seed=4)
    start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))
    other_start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(6))
    predictions = {name: torch.randn(SHAPE, generator=torch.Generator().manual_seed(7 + i))
                   for i, name in enumerate(steps)}
    donors = [_donor(store, name, list(s), {**_blob(states, name), "x0_0": predictions[name]},
                     start=noise_fingerprint(other_start if name == "other seed" else start))
              for name, s in steps.items()]
    targets, _ = plan_probes(store, donors, FACTS, max_fraction=0.5, same_noise_only=True, max_probes=3)
    assert [(t.candidate.prompt, t.step, t.anchor and t.anchor.step) for t in targets] == [
        ("other scene", 5, 2), ("same scene", 5, 2), ("other seed", 5, 2)]
    assert all(t.start is not None and torch.equal(t.start.x0, predictions[t.candidate.prompt]) for t in targets)
    calls: list[tuple[str, int]] = []

    def evaluate(xs: list[torch.Tensor], sigma: float) -> list[tuple[torch.Tensor, None]]:
        if xs[0] is start:
            calls.append(("start", 0))
            return [(predictions["same scene"], None)]  # the live prompt predicts what "same scene" did
        key, x0 = _probed(states, xs[0])
        calls.append(key)
        return [(x0, None)]

    run = _run(store)
    run.recorder = RunRecorder(set(run.settings.checkpoint_steps(run.total_steps)))
    run.start_state = start
    resume = run.decider.decide(targets, evaluate)
    assert calls == [("start", 0), ("same scene", 5)]
    assert [(p.donor_prompt, p.step, p.passed, p.confirms_deeper) for p in run.probes] == [
        ("other scene", 0, False, True), ("same scene", 0, True, True), ("same scene", 5, True, False)]
    assert resume is not None and resume.target.candidate.prompt == "same scene" and run.decider.model_calls == 2
    assert run.start_evaluation is not None and torch.equal(run.start_evaluation[0], predictions["same scene"])
    recorded = run.recorder.checkpoints[0]  # the screen is this request's step 0: recorded for later requests
    assert recorded.x is None and recorded.start == noise_fingerprint(start)

    run = _run(store)
    run.start_state = start
    run.decider.decide([t for t in targets if t.candidate.prompt == "other seed"], evaluate)
    assert run.start_evaluation is None and calls[2] == ("other seed", 2)  # nothing to screen: its anchor first


def test_a_batched_call_takes_no_state_whose_donor_still_needs_its_anchor(tmp_path):
    """probe_batch 2: the screened donor's deep state is asked first, and the other seed's state at the same step stays
    out of that call, since a pass there would skip its anchor."""
    store = ReuseStore(str(tmp_path / "store"))
    steps = {"screened": (2, 5), "other seed": (2, 5)}
    states = _random_states(steps, seed=4)
    start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))
    x0_start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(6))
    donors = [_donor(store, name, list(s), {**_blob(states, name), "x0_0": x0_start},
                     start=noise_fingerprint(start if name == "screened" else torch.zeros(SHAPE)))
              for name, s in steps.items()]
    targets, _ = plan_probes(store, donors, FACTS, max_fraction=0.5, same_noise_only=True, max_probes=3)

    def evaluate(xs: list[torch.Tensor], sigma: float) -> list[tuple[torch.Tensor, None]]:
        return [(x0_start if x is start else _probed(states, x)[1], None) for x in xs]

    run = _run(store)
    run.start_state = start
    decision = run.decider.decide(targets, evaluate, 2)
    assert [(p.donor_prompt, p.step, p.batched_with) for p in run.probes] == [("screened", 0, 0), ("screened", 5, 0)]
    assert decision is not None and decision.target.candidate.prompt == "screened" and decision.step == 5


class _CountingStore(ReuseStore):
    """A real store that remembers which blobs were read, by (donor prompt, blob name)."""

    def __init__(self, directory: str) -> None:
        super().__init__(directory)
        self.read: list[tuple[str, str]] = []

    def get_tensors(self, entry_id: str, name: str) -> dict[str, torch.Tensor] | None:
        meta = self.get_meta(entry_id)
        self.read.append((meta.prompt if meta is not None else entry_id, name))
        return super().get_tensors(entry_id, name)


X0_5 = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))  # every recorded donor's prediction at step 5


def _recorded_donor(store: ReuseStore, name: str, start: torch.Tensor, x0_start: torch.Tensor,
                    steps: tuple[int, ...] = (5,)) -> Candidate:
    """A same-noise donor recorded as a run records one (`RunRecorder.blobs`): step 0 from `start`, then `steps`,
    each at the state full of its step number, predicting X0_5."""
    recorder = RunRecorder({0, *steps})
    recorder.capture_start(1.0, noise_fingerprint(start), x0_start, None)
    for step in steps:
        recorder.capture(step, 1 - step / 10, torch.full(SHAPE, float(step)), X0_5, None)
    listing, blobs = recorder.blobs()
    meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=KEY, prompt=name, latent_shape=SHAPE,
                     noise_fingerprint="noise", total_steps=10, checkpoints=listing)
    store.put(meta, blobs, IndexVectors(text=None, cond=torch.nn.functional.normalize(torch.ones(256), dim=0)))
    return Candidate(entry_id=meta.entry_id, prompt=name, score=1.0, cond_similarity=1.0, text_similarity=None,
                     same_noise=True)


def test_the_screen_reads_a_step_0_record_per_donor_and_states_only_of_those_it_passes(tmp_path):
    """Donors beyond the probe budget cost the screen their small step-0 record; the one the model passes is read
    whole and resumed from."""
    store = _CountingStore(str(tmp_path / "store"))
    start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    predictions = {name: torch.randn(SHAPE, generator=torch.Generator().manual_seed(i + 2))
                   for i, name in enumerate(("first", "second", "third"))}
    donors = [_recorded_donor(store, name, start, x0) for name, x0 in predictions.items()]
    assert all("start" in store.get_meta(d.entry_id).blob_bytes for d in donors)
    run = _run(store)
    run.start_state = start
    targets, _ = plan_probes(store, donors, FACTS, max_fraction=0.5, same_noise_only=True, max_probes=1)
    assert [(t.candidate.prompt, isinstance(t, ScreenOnly)) for t in targets] == [
        ("first", False), ("second", True), ("third", True)]
    assert sorted(store.read) == [("first", "checkpoints"), ("first", "start"), ("second", "start"),
                                  ("third", "start")]
    store.read.clear()

    def evaluate(xs: list[torch.Tensor], sigma: float) -> list[tuple[torch.Tensor, None]]:
        return [(predictions["third"] if x is start else X0_5.half().float(), None) for x in xs]

    decision = run.decider.decide(targets, evaluate)
    assert decision is not None and decision.target.candidate.prompt == "third" and decision.step == 5
    assert store.read == [("third", "checkpoints")]  # the screen ruled the others out on what it had read
    assert [(p.donor_prompt, p.step, p.passed) for p in run.probes] == [
        ("first", 0, False), ("second", 0, False), ("third", 0, True), ("third", 5, True)]


def test_a_screened_donor_is_probed_and_resumed_at_its_state_corrected_by_the_step_0_difference(tmp_path):
    """A one-attribute edit: the request's step-0 prediction differs from the donor's in one region. The donor passes
    the screen, is probed at x_5 + (1 - sigma_5 / sigma_0) x difference against its own prediction moved by the
    difference, and the run resumes at that corrected state. A request whose model does not carry the edit on there
    misses."""
    store = ReuseStore(str(tmp_path / "store"))
    start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    x0_start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2)).half().float()
    edit = torch.zeros(SHAPE)
    edit[..., :2, :4] = 0.5  # one region of the frame, as another background or shape would be
    donor = _recorded_donor(store, "donor scene", start, x0_start)
    corrected = torch.full(SHAPE, 5.0) + 0.5 * edit  # sigma 0.5 of 1.0: half-way towards the prediction

    def asked(carries_edit: bool) -> tuple[ReuseRun, list[torch.Tensor], Decision | None]:
        states: list[torch.Tensor] = []

        def evaluate(xs: list[torch.Tensor], sigma: float) -> list[tuple[torch.Tensor, None]]:
            states.extend(xs)
            if xs[0] is start:
                return [(x0_start + edit, None)]
            return [(X0_5 + edit if carries_edit else torch.randn(SHAPE, generator=torch.Generator()), None)]

        run = _run(store)
        run.start_state = start
        targets, _ = plan_probes(store, [donor], FACTS, max_fraction=0.5, same_noise_only=True, max_probes=1)
        return run, states, run.decider.decide(targets, evaluate)

    run, states, decision = asked(carries_edit=True)
    assert [p.passed for p in run.probes] == [True, True] and states[0] is start
    assert torch.allclose(states[1], corrected, atol=1e-3)
    assert decision is not None and torch.allclose(decision.target.x, corrected, atol=1e-3)
    assert torch.allclose(decision.target.x0, X0_5.half().float() + edit, atol=1e-3)
    record = run.probes[1].as_dict()
    assert record["corrected"] is True and record["structure_agreement"] > 0.99 and "corrected" not in \
        run.probes[0].as_dict()

    run, _, decision = asked(carries_edit=False)
    assert decision is None and [p.passed for p in run.probes] == [True, False]


@pytest.mark.parametrize(("screen_gap", "asked_steps"), [
    (0.0, [0, 5]),  # the screen agrees fully: the deep state first, no anchor call
    (0.1, [0, 2, 5]),  # it passes, but not by the margin at depth 0.5: the anchor first, then deeper
])
def test_a_screened_donor_is_asked_deep_first_only_when_its_screen_clears_that_depth_by_the_margin(
        tmp_path, screen_gap, asked_steps):
    """A deep call that fails ends probing, so only a donor whose step-0 agreement clears the deep bar by the give-up
    margin is asked deep first; one that passes the screen by less climbs from its anchor and resumes as deep."""
    store = ReuseStore(str(tmp_path / "store"))
    start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    x0_start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2)).half().float()
    donor = _recorded_donor(store, "donor", start, x0_start, steps=(2, 5))
    noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    gap = screen_gap * (x0_start - start).norm() / noise.norm() * noise  # structure agreement about 1 - screen_gap
    moved = (x0_start + gap).half().float() - x0_start  # what the request's step 0 differs by, as stored

    def evaluate(xs: list[torch.Tensor], sigma: float) -> list[tuple[torch.Tensor, None]]:
        """The request predicts the donor's step 0 off by `gap`, and the donor's later predictions moved alike."""
        return [(x0_start + gap if x is start else X0_5.half().float() + moved, None) for x in xs]

    run = _run(store)
    run.start_state = start
    targets, _ = plan_probes(store, [donor], FACTS, max_fraction=0.5, same_noise_only=True, max_probes=3)
    decision = run.decider.decide(targets, evaluate)
    assert [p.step for p in run.probes] == asked_steps and all(p.passed for p in run.probes)
    assert decision is not None and decision.step == 5 and run.decider.model_calls == len(asked_steps)


def test_with_cfg_guidance_a_screened_donor_resumes_at_its_own_state_without_a_confirmation_call(tmp_path):
    """With guidance the step-0 prediction difference is not corrected for: the probe asks the donor's own state, and
    the screen's pass stands in for the anchor's confirmation as without guidance."""
    store = ReuseStore(str(tmp_path / "store"))
    start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    x0_start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2)).half().float()
    states = _random_states({"donor": (2, 5)}, seed=3)
    guidance = torch.ones(SHAPE)
    donor = _donor(store, "donor", [2, 5], {**_blob(states, "donor"), "x0_0": x0_start}, start=noise_fingerprint(start))
    targets, _ = plan_probes(store, [donor], FACTS, max_fraction=0.5, same_noise_only=True, max_probes=1)
    assert targets[0].anchor is not None
    asked: list[torch.Tensor] = []

    def evaluate(xs: list[torch.Tensor], sigma: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        asked.extend(xs)
        if xs[0] is start:
            return [(x0_start + 0.01, guidance)]
        return [(_probed(states, xs[0])[1], guidance)]

    run = _run(store)
    run.start_state = start
    decision = run.decider.decide(targets, evaluate)
    assert decision is not None and decision.step == 5 and decision.difference is None
    assert len(asked) == 2 and torch.equal(asked[1], states[("donor", 5)][0])  # the donor's own state, no anchor call
    assert "corrected" not in run.probes[1].as_dict()


def _agreeing(x: torch.Tensor, x0: torch.Tensor, agreement: float, seed: int) -> torch.Tensor:
    """A prediction at state `x` whose structure agreement with `x0` is about `agreement`."""
    noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
    return x0 + (1.0 - agreement) * (x0 - x).norm() / noise.norm() * noise


@pytest.mark.parametrize(("agreement", "balanced_asks", "fast_asks"), [
    # a rewording: balanced climbs from its anchor to half-way; fast asks the same, then 80 %
    ({2: 0.99, 3: 0.99, 5: 0.98, 8: 0.97}, [2, 5], [2, 5, 8]),
    # an edit that holds half-way only just: its pass there makes no deeper pass likely, so fast stops where balanced
    # does
    ({2: 0.96, 3: 0.95, 5: 0.92, 8: 0.80}, [2, 5], [2, 5]),
    # an edit that fails half-way: balanced falls back to a shallower state, and so does fast, never deeper
    ({2: 0.93, 3: 0.91, 5: 0.80, 8: 0.70}, [2, 5, 3], [2, 5, 3]),
    ({2: 0.50, 3: 0.50, 5: 0.50, 8: 0.50}, [2], [2]),  # a miss: one call in either mode
])
def test_fast_asks_every_state_balanced_asks_and_goes_deeper_only_from_balanced_s_pass(
        tmp_path, agreement, balanced_asks, fast_asks):
    """Fast contains balanced: its calls begin with balanced's, in balanced's order, it resumes at least as deep, and
    on each of these requests it takes no more model calls than balanced."""
    store = ReuseStore(str(tmp_path / "store"))
    states = _random_states({"donor": (2, 3, 5, 8)}, seed=4)
    donor = _donor(store, "donor", [2, 3, 5, 8], _blob(states, "donor"))

    def evaluate(xs: list[torch.Tensor], sigma: float) -> list[tuple[torch.Tensor, None]]:
        (_, step), x0 = _probed(states, xs[0])
        return [(_agreeing(xs[0], x0, agreement[step], seed=step), None)]

    asked, request_calls = {}, {}
    for mode in ("balanced", "fast"):
        run = _run(store, mode=mode)
        decision = run.decider.decide(run.plan(Match(store_location="", request=None, candidates=[donor])), evaluate)
        asked[mode] = [probe.step for probe in run.probes]
        resumed_at = decision.step if decision is not None else 0
        # the sampler's steps from the resume on, the first served by the probe that chose it
        request_calls[mode] = run.decider.model_calls + 10 - resumed_at - (decision is not None)
    assert asked == {"balanced": balanced_asks, "fast": fast_asks}
    assert request_calls["fast"] <= request_calls["balanced"]


def test_a_donor_lacking_states_is_probed_at_those_it_holds_and_the_report_names_what_it_lacked(tmp_path):
    """A truncated entry (checkpoints at steps 2 and 5 of the 2, 4, 5, 6 and 8 a 10-step run records): fast plans
    the states it holds, climbs as far as they go, and its report says which states it lacked."""
    store = ReuseStore(str(tmp_path / "store"))
    states = _random_states({"donor": (2, 5)}, seed=5)
    donor = _donor(store, "donor", [2, 5], _blob(states, "donor"))
    run = _run(store, mode="fast")
    targets = run.plan(Match(store_location="", request=None, candidates=[donor]))
    assert [target.step for target in targets] == [5, 2]
    decision = run.decider.decide(targets, lambda xs, sigma: [(_probed(states, xs[0])[1], None)])
    assert decision is not None and decision.step == 5 and [probe.step for probe in run.probes] == [2, 5]
    notes = run.finish(model_calls=run.decider.model_calls + 4).notes
    assert f"donor {donor.entry_id[:8]} lacks its states at steps 4, 6, 8: probed only at those it holds" in notes


def test_fast_climbs_a_donor_that_holds_only_states_deeper_than_balanced_s_depth(tmp_path):
    """A donor that itself resumed at 80 % holds nothing balanced could ask: fast asks it as it would on its own, at
    its own donor's early record first (up the lineage), then at its deep state."""
    store = ReuseStore(str(tmp_path / "store"))
    states = _random_states({"root": (2, 5), "resumed": (8,)}, seed=6)
    root = _donor(store, "root", [2, 5], _blob(states, "root"))
    resumed = _donor(store, "resumed", [8], _blob(states, "resumed"), lineage={"donor_id": root.entry_id, "depth": 8})
    run = _run(store, mode="fast")
    targets = run.plan(Match(store_location="", request=None, candidates=[resumed]))
    decision = run.decider.decide(targets, lambda xs, sigma: [(_probed(states, xs[0])[1], None)])
    assert [(probe.donor_prompt, probe.step) for probe in run.probes] == [("root", 2), ("resumed", 8)]
    assert decision is not None and decision.step == 8


def test_at_equal_depth_the_donor_the_screen_agreed_with_most_is_asked_first(tmp_path):
    """Two donors pass the step-0 screen; the lower-ranked one agrees more there, so its state is asked first and the
    request resumes from it."""
    store = ReuseStore(str(tmp_path / "store"))
    start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    x0_start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2)).half().float()
    close = x0_start + 0.03 * (x0_start - start).norm() / x0_start.norm() * torch.randn(
        SHAPE, generator=torch.Generator().manual_seed(3))
    donors = [_recorded_donor(store, "ranked first", start, close.half().float()),
              _recorded_donor(store, "agrees most", start, x0_start)]
    run = _run(store)
    run.start_state = start
    decision = run.decider.decide(run.plan(Match(store_location="", request=None, candidates=donors)),
                          lambda xs, sigma: [(x0_start if x is start else X0_5.half().float(), None) for x in xs])
    assert [probe.passed for probe in run.probes[:2]] == [True, True]  # both pass the screen
    assert decision is not None and decision.target.candidate.prompt == "agrees most"
    assert run.probes[2].donor_prompt == "agrees most"


def test_fast_climbs_alone_the_donor_the_screen_agreed_with_most_when_it_holds_only_deeper_states(tmp_path):
    """In fast's own store a rewording that resumed at 80 % holds no state within balanced's depth; where the
    screen agrees with it more than with any donor that does, fast asks it, not the others."""
    store = ReuseStore(str(tmp_path / "store"))
    start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    x0_start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2)).half().float()
    further = x0_start + 0.03 * (x0_start - start).norm() / x0_start.norm() * torch.randn(
        SHAPE, generator=torch.Generator().manual_seed(3))
    donors = [_recorded_donor(store, "scene", start, further.half().float(), steps=(2, 5)),
              _recorded_donor(store, "resumed rewording", start, x0_start, steps=(8,))]
    run = _run(store, mode="fast")
    run.start_state = start
    decision = run.decider.decide(run.plan(Match(store_location="", request=None, candidates=donors)),
                          lambda xs, sigma: [(x0_start if x is start else X0_5.half().float(), None) for x in xs])
    assert [(probe.donor_prompt, probe.step) for probe in run.probes[2:]] == [("resumed rewording", 8)]
    assert decision is not None and decision.step == 8



def _line_of_a_rewording(store: ReuseStore, screen: dict[str, float], agreement: dict[tuple[str, int], float]):
    """Donors as fast's own store holds them after a scene and a rewording of it: the scene at steps 2, 5 and 8, the
    rewording resumed from it at 80 % (step 8 only), and any others of `screen` at the scene's steps. Each agrees
    with the request's step 0 by `screen` and, asked at a state, by `agreement`. Returns the candidates (the
    rewording first, as the lookup ranks it), the request's start state and its model."""
    start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    x0_start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2)).half().float()
    steps = {name: (8,) if name == "rewording" else (2, 5, 8) for name in screen}
    states = _random_states(steps, seed=7)
    fingerprint = noise_fingerprint(start)
    candidates = {}
    for seed, (name, agrees) in enumerate(screen.items()):
        x0_0 = x0_start if agrees == 1.0 else _agreeing(start, x0_start, agrees, seed=seed + 3).half().float()
        lineage = {"donor_id": candidates["scene"].entry_id, "depth": 8} if name == "rewording" else None
        candidates[name] = _donor(store, name, list(steps[name]), {**_blob(states, name), "x0_0": x0_0},
                                  start=fingerprint, lineage=lineage)

    def evaluate(xs: list[torch.Tensor], sigma: float) -> list[tuple[torch.Tensor, None]]:
        if xs[0] is start:
            return [(x0_start, None)]
        key = min(states, key=lambda k: float((states[k][0] - xs[0]).norm()))  # the (corrected) state asked
        return [(_agreeing(xs[0], states[key][1], agreement[key], seed=key[1]), None)]

    ranked = [candidates["rewording"]] + [c for name, c in candidates.items() if name != "rewording"]
    return [dataclasses.replace(c, same_noise=True) for c in ranked], start, evaluate


def _decided(store: ReuseStore, mode: str, candidates: list[Candidate], start: torch.Tensor, evaluate):
    """The states a run of `mode` asked after the screen, where it resumed, and the model calls of its request."""
    run = _run(store, mode=mode)
    run.start_state = start
    decision = run.decider.decide(run.plan(Match(store_location="", request=None, candidates=candidates)), evaluate)
    asked = [(probe.donor_prompt, probe.step) for probe in run.probes if probe.step > 0]
    resumed = (decision.target.meta.prompt, decision.step) if decision is not None else None
    return asked, resumed, run.decider.model_calls + 10 - (decision.step + 1 if decision is not None else 0)


@pytest.mark.parametrize(("agreement", "fast_asks", "fast_resumes_at"), [
    # the rewording's deep state fails: fast asks what balanced asks, as balanced does, and resumes where it does
    ({("scene", 2): 0.99, ("scene", 5): 0.92, ("scene", 8): 0.80, ("rewording", 8): 0.80},
     [("rewording", 8), ("scene", 5)], ("scene", 5)),
    # the rewording's deep state passes: fast resumes there in one call
    ({("scene", 2): 0.99, ("scene", 5): 0.99, ("scene", 8): 0.97, ("rewording", 8): 0.99},
     [("rewording", 8)], ("rewording", 8)),
])
def test_fast_asks_the_deep_state_the_screen_makes_likely_first_and_falls_back_to_balanced_s(
        tmp_path, agreement, fast_asks, fast_resumes_at):
    """A rewording that resumed at 80 % from the scene holds nothing balanced could ask, and the step-0 screen agrees
    with it fully: fast asks its deep state first and, where that fails, asks what balanced asks in the same store.
    It never resumes shallower than balanced, and takes at most one call more."""
    store = ReuseStore(str(tmp_path / "store"))
    candidates, start, evaluate = _line_of_a_rewording(store, {"scene": 0.96, "rewording": 1.0}, agreement)
    balanced = _decided(store, "balanced", candidates, start, evaluate)
    fast = _decided(store, "fast", candidates, start, evaluate)
    assert balanced[:2] == ([("scene", 5)], ("scene", 5))
    assert fast[:2] == (fast_asks, fast_resumes_at)
    assert fast[2] <= balanced[2] + 1


def test_fast_asks_the_line_of_the_donor_the_screen_agreed_with_most_before_an_edit_it_agreed_with_less(tmp_path):
    """An edit of the scene agrees at step 0 more than the scene and less than the rewording that resumed from the
    scene at 80 %: fast asks the rewording's deep state first, not the edit, which fails deeper than its anchor."""
    store = ReuseStore(str(tmp_path / "store"))
    agreement = {("scene", 2): 0.99, ("scene", 5): 0.99, ("scene", 8): 0.97, ("rewording", 8): 0.99,
                 ("edit", 2): 0.99, ("edit", 5): 0.70, ("edit", 8): 0.60}
    candidates, start, evaluate = _line_of_a_rewording(
        store, {"scene": 0.96, "edit": 0.97, "rewording": 1.0}, agreement)
    asked, resumed, _ = _decided(store, "fast", candidates, start, evaluate)
    assert all(donor != "edit" for donor, _ in asked)
    assert resumed == ("rewording", 8)


def test_fast_asks_first_the_line_of_a_deep_only_donor_the_screen_agreed_with_most(tmp_path):
    """The rewording that resumed at 80 % from the scene agrees most at step 0, not enough to ask its deep state
    first but enough for the scene's half-way state, which it continued: fast asks that state first, as balanced does
    in a store where the rewording resumed half-way, and resumes there; not the edit, which the screen ranks above the
    scene and which fails half-way, where balanced, in this store, asks it and misses."""
    store = ReuseStore(str(tmp_path / "store"))
    agreement = {("scene", 2): 0.99, ("scene", 5): 0.99, ("scene", 8): 0.97, ("rewording", 8): 0.99,
                 ("edit", 2): 0.99, ("edit", 5): 0.70, ("edit", 8): 0.60}
    candidates, start, evaluate = _line_of_a_rewording(
        store, {"scene": 0.94, "edit": 0.948, "rewording": 0.951}, agreement)
    balanced = _decided(store, "balanced", candidates, start, evaluate)
    fast = _decided(store, "fast", candidates, start, evaluate)
    assert balanced[:2] == ([("edit", 5)], None)
    assert fast[:2] == ([("scene", 5)], ("scene", 5))
    assert fast[2] < balanced[2]


def test_fast_does_not_ask_again_the_line_s_state_that_failed(tmp_path):
    """The line's half-way state, asked first for the rewording that resumed at 80 %, fails: balanced asks that very
    state first and misses there, so fast misses after that one call too, at balanced's cost."""
    store = ReuseStore(str(tmp_path / "store"))
    agreement = {("scene", 2): 0.99, ("scene", 5): 0.50, ("scene", 8): 0.50, ("rewording", 8): 0.50}
    candidates, start, evaluate = _line_of_a_rewording(store, {"scene": 0.95, "rewording": 0.951}, agreement)
    balanced = _decided(store, "balanced", candidates, start, evaluate)
    fast = _decided(store, "fast", candidates, start, evaluate)
    assert balanced == fast == ([("scene", 5)], None, balanced[2])


@pytest.mark.parametrize(("rewording_screen", "deep_first"), [(0.962, True), (0.942, False)])
def test_fast_asks_a_deep_state_first_from_the_deep_first_margin_below_the_give_up_margin(
        tmp_path, rewording_screen, deep_first):
    """A failed deep-first call costs fast one call and a pass saves one, so fast asks the deep state first where the
    screen clears its bar by the deep-first margin, though by less than the give-up margin a donor needs to skip its
    anchor; below the deep-first margin it asks what balanced asks first."""
    thresholds = ProbeThresholds()
    clearance = rewording_screen - thresholds.needed_structure(0.8)
    if deep_first:
        assert thresholds.deep_first_margin < clearance < thresholds.give_up_margin
    else:
        assert clearance < thresholds.deep_first_margin
    store = ReuseStore(str(tmp_path / "store"))
    agreement = {("scene", 2): 0.99, ("scene", 5): 0.99, ("scene", 8): 0.97, ("rewording", 8): 0.99}
    candidates, start, evaluate = _line_of_a_rewording(store, {"scene": 0.93, "rewording": rewording_screen},
                                                       agreement)
    asked, resumed, calls = _decided(store, "fast", candidates, start, evaluate)
    balanced = _decided(store, "balanced", candidates, start, evaluate)
    assert (asked[0] == ("rewording", 8)) == deep_first, asked
    assert resumed is not None and balanced[1] is not None and resumed[1] >= balanced[1][1]
    assert calls < balanced[2] if deep_first else calls <= balanced[2] + 1

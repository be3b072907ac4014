"""Is reuse worth it on this model: the fewer-steps runs a calibration plans for a graph, the per-mode verdict it
weighs on the held-back pairs, the profile fields that keep it (a hand-edited one refused naming the field), and the
sentences the command, the node, the store panel and a judged request's report say it in."""

from __future__ import annotations

import json

import pytest

from carnator_core.calibration.equal_quality import PairsWeighing, weigh
from carnator_core.calibration.fit import Resume, fit
from carnator_core.calibration.job import Calibrated, CalibrationPlan, fewer_steps_plan
from carnator_core.calibration.plot import calibration_plots
from carnator_core.calibration.session import KneeRun, Measured, PlainRun
from carnator_core.calibration.workflow import CalibrationWorkflow, step_inputs
from carnator_core.judging.calibration_profile import FewerStepsRun, Profile, ProfileError, Score
from carnator_core.judging.fewer_steps import fewer_steps
from carnator_core.judging.probe_thresholds import ProbeThresholds
from carnator_core.judging.quality_target import QualityTarget
from carnator_core.judging.ratio_interval import ratio_words
from carnator_core.queue import Workflow
from carnator_core.reuse.settings import ReuseSettings

STEPS = 12
TEXT = {"6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red fox in snow", "clip": ["1", 0]}}}


# ------------------------------------------------------------------ which fewer-steps runs a graph gets
def test_plain_runs_at_half_a_third_and_a_quarter_of_the_steps_and_never_below_two():
    assert fewer_steps(30, fewest=2) == (["plain-15", "plain-10", "plain-7"], [])
    names, skipped = fewer_steps(6, fewest=2)
    assert names == ["plain-3", "plain-2"] and skipped == [
        "plain at 1/4 of 6 steps skipped: that is 1 step, fewer than 2"]
    names, skipped = fewer_steps(3, fewest=2)
    assert names == [] and len(skipped) == 3


def _ksampler_graph(steps: object = STEPS) -> dict:
    return {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "m.safetensors"}}, **TEXT,
            "9": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "steps": steps, "cfg": 1.0}}}


def _custom_graph(scheduler: str, inputs: dict) -> dict:
    return {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "m.safetensors"}}, **TEXT,
            "5": {"class_type": scheduler, "inputs": {"model": ["1", 0], **inputs}},
            "9": {"class_type": "SamplerCustomAdvanced", "inputs": {"sigmas": ["5", 0], "noise": ["7", 0]}}}


def _two_experts() -> dict:
    return {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "high.safetensors"}}, **TEXT,
            "2": {"class_type": "UNETLoader", "inputs": {"unet_name": "low.safetensors"}},
            "8": {"class_type": "KSamplerAdvanced", "inputs": {"model": ["1", 0], "steps": 8, "start_at_step": 0,
                                                               "end_at_step": 4}},
            "9": {"class_type": "KSamplerAdvanced", "inputs": {"model": ["2", 0], "latent_image": ["8", 0],
                                                               "steps": 8, "start_at_step": 4,
                                                               "end_at_step": 10000}}}


def test_the_steps_are_lowered_where_the_graph_sets_them_and_stage_boundaries_scale_with_them():
    assert step_inputs(_ksampler_graph(), ["9"]) == (STEPS, ("9",), "")
    assert step_inputs(_custom_graph("BasicScheduler", {"steps": 20, "scheduler": "simple"}), ["9"]) == (
        20, ("5",), "")
    graph = _two_experts()
    steps, nodes, _ = step_inputs(graph, ["8", "9"])
    assert (steps, nodes) == (8, ("8", "9"))
    workflow = CalibrationWorkflow(workflow=Workflow(graph), object_info={}, sampler="8", reuse_node="8",
                                   decoder=None, oracle=None, user_store=None, steps=steps, step_nodes=nodes)
    workflow.lower_steps(graph, 2)
    assert [(graph[n]["inputs"]["steps"], graph[n]["inputs"]["start_at_step"], graph[n]["inputs"]["end_at_step"])
            for n in ("8", "9")] == [(2, 0, 1), (2, 1, 10000)]


@pytest.mark.parametrize(("graph", "why"), [
    (_custom_graph("ManualSigmas", {"sigmas": "1.0, 0.5, 0.0"}),
     "sampler 9 (SamplerCustomAdvanced) takes a fixed sigma list from node 5 (ManualSigmas), which has no steps"),
    (_ksampler_graph(["3", 0]), "sampler 9 (KSampler) takes its steps from another node (['3', 0])"),
    (_custom_graph("BasicScheduler", {"steps": ["3", 0]}), "node 5 (BasicScheduler), the sigmas of sampler 9"),
])
def test_a_graph_whose_steps_cannot_be_lowered_says_why_in_one_line(graph, why):
    steps, nodes, note = step_inputs(graph, ["9"])
    assert steps is None and nodes == () and why in note
    workflow = CalibrationWorkflow(workflow=Workflow(graph), object_info={}, sampler="9", reuse_node="9",
                                   decoder=None, oracle=None, user_store=None, steps_note=note)
    plan = CalibrationPlan(workflow=workflow, pairs=[], out=None, name="x")
    runs, line = fewer_steps_plan(plan)
    assert not runs and line.startswith("plain at fewer steps: not run, since the steps cannot be lowered")
    assert why in line and "\n" not in line


def test_the_fewer_steps_runs_can_be_turned_off_and_say_so():
    workflow = CalibrationWorkflow(workflow=Workflow(_ksampler_graph()), object_info={}, sampler="9",
                                   reuse_node="9", decoder=None, oracle=None, user_store=None, steps=STEPS,
                                   step_nodes=("9",))
    assert fewer_steps_plan(CalibrationPlan(workflow=workflow, pairs=[], out=None, name="x")) == (
        True, "plain also at up to 4 bisected step counts of 12 (the first 6), then balanced and fast at the knee")
    runs, line = fewer_steps_plan(CalibrationPlan(workflow=workflow, pairs=[], out=None, name="x", fewer_steps=False))
    assert not runs and "turned off" in line
    two = CalibrationWorkflow(workflow=Workflow(_ksampler_graph(2)), object_info={}, sampler="9", reuse_node="9",
                              decoder=None, oracle=None, user_store=None, steps=2, step_nodes=("9",))
    assert fewer_steps_plan(CalibrationPlan(workflow=two, pairs=[], out=None, name="x")) == (
        False, "plain at fewer steps: none of 2 steps leaves 2 or more")


# ------------------------------------------------------------------ the verdict, weighed on held-back pairs
def _measured(pair: int, depth: float, psnr: float, structure: float = 0.99) -> Measured:
    skipped = round(depth * STEPS)
    resume = Resume(pair=pair, depth=depth, screen_structure=0.99, screen_guidance=None, structure=structure,
                    guidance=None, psnr_db=psnr, ssim=0.9)
    return Measured(resume=resume, requested_depth=depth, earlier=f"e{pair}", new=f"n{pair}", skipped_steps=skipped,
                    total_steps=STEPS, seconds=1.0, model_calls=STEPS - skipped + 1)


def _plain(pair: int, steps: int, psnr: float) -> PlainRun:
    return PlainRun(pair=pair, earlier=f"e{pair}", new=f"n{pair}", steps=steps, model_calls=steps, psnr_db=psnr,
                    ssim=0.9 if steps < STEPS else 1.0)


def _pairs(balanced_db: float, fast_db: float, structure: float = 0.99) -> tuple[list[Measured], list[PlainRun]]:
    """Six pairs (2 and 5 held back): resumes at 50% (7 calls) and 65% (5 calls), plain at 6, 4 and 3 steps."""
    measured, plain = [], []
    for pair in range(6):
        measured += [_measured(pair, 0.5, balanced_db, structure), _measured(pair, 0.65, fast_db, structure)]
        plain += [_plain(pair, STEPS, 100.0), _plain(pair, 6, 31.0), _plain(pair, 4, 27.0), _plain(pair, 3, 22.0)]
    return measured, plain


def test_each_pair_is_weighed_as_a_two_prompt_stream_its_earlier_prompt_sampled_plain():
    measured, plain = _pairs(balanced_db=35.0, fast_db=29.0)
    fewer, verdicts, recommended = weigh(measured, plain, ProbeThresholds(), STEPS)
    # at fewer steps the earlier prompt loses what the new one does: both requests of a pair at the run's quality
    assert fewer == {"plain-6": FewerStepsRun(6, 31.0, 0.9, 6.0), "plain-4": FewerStepsRun(4, 27.0, 0.9, 4.0),
                     "plain-3": FewerStepsRun(3, 22.0, 0.9, 3.0)}
    fast, balanced = verdicts["fast"], verdicts["balanced"]
    # two held-back pairs, four requests: the earlier prompts at plain's 12 calls, the resumed ones at 5
    assert (fast.pairs, fast.held_back, fast.resumed, fast.model_calls, fast.weighed_on) == (2, True, 2, 8.5, "pairs")
    # 29 dB resumes beside two identical clips are 32 dB together: closer than plain-6, so full plain is the yardstick
    assert (fast.psnr_db, fast.against, fast.calls, fast.steps_short, fast.decided_by) == (
        32.01, "plain", 1.412, 6, "PSNR")
    low, high = fast.interval
    assert low <= fast.calls <= high and fast.words() == ratio_words(fast.calls, fast.interval, 4)
    assert fast.sentence("fast") == (
        f"On this model, fast: {fast.words()}. Weighed against full plain (12 steps), the cheapest plain run as good "
        "(12 calls against fast's 8.5; 6 steps fall short on PSNR), each of 2 held-back pairs weighed as a two-prompt "
        "stream (its earlier prompt sampled plain).")
    assert (balanced.model_calls, balanced.against, balanced.against_calls) == (9.5, "plain", 12.0)
    # these plain runs lose no detail and no oracle scores them: plain at 3 steps is as good as full plain, and
    # cheaper than either mode, so it is what to run
    assert (recommended.mode, recommended.steps, recommended.against) == ("plain", 3, "plain-3")


def test_where_a_plain_run_with_fewer_steps_is_as_good_for_less_the_verdict_weighs_against_it():
    measured, plain = _pairs(balanced_db=35.0, fast_db=20.0)
    verdict = weigh(measured, plain, ProbeThresholds(), STEPS)[1]["fast"]
    assert (verdict.psnr_db, verdict.against, verdict.calls, verdict.decided_by) == (23.01, "plain-4", 0.471, "PSNR")
    assert verdict.short("fast") == f"calibration: fast {verdict.words()} against plain at 4 steps, the cheapest " \
                                    "plain run as good"


def test_a_rule_that_resumes_nothing_costs_a_probe_call_and_claims_no_verdict():
    measured, plain = _pairs(balanced_db=35.0, fast_db=29.0, structure=0.5)
    verdict = weigh(measured, plain, ProbeThresholds(), STEPS)[1]["fast"]
    assert (verdict.resumed, verdict.model_calls, verdict.psnr_db) == (0, STEPS + 0.5, 100.0)
    assert verdict.sentence("fast") == (
        "On this model, fast resumed no request (each of 2 held-back pairs weighed as a two-prompt stream (its earlier "
        "prompt sampled plain)): no verdict, it saves nothing to weigh.")


def test_without_held_back_pairs_every_pair_is_weighed_and_a_pair_missing_a_plain_run_is_left_out():
    measured, plain = _pairs(balanced_db=35.0, fast_db=29.0)
    two = [r for r in plain if r.pair < 2 and not (r.pair == 1 and r.steps == 4)]
    verdict = weigh(measured, two, ProbeThresholds(), STEPS)[1]["fast"]
    assert (verdict.pairs, verdict.held_back) == (1, False)
    assert weigh(measured, [r for r in plain if r.steps == STEPS], ProbeThresholds(), STEPS) == ({}, {}, None)


# ------------------------------------------------------------------ in the profile, checked like every field
def _profile() -> Profile:
    measured, plain = _pairs(balanced_db=35.0, fast_db=26.0)
    fewer, verdicts, recommended = weigh(measured, plain, ProbeThresholds(), STEPS)
    return Profile(model="a1b2c3", schedule="d4e5f6", name="my wan",
                   thresholds={"structure": 0.7, "structure_slope": 0.03, "guidance": 0.5, "guidance_slope": 0.03},
                   held_back=Score(accepted=20, good=20, precision=1.0, recall=1.0), in_force=True,
                   reason="in force: held-back precision 1.00", fewer_steps=fewer, equal_quality=verdicts,
                   recommended=recommended)


def test_the_verdict_survives_the_profile_s_json_and_a_profile_without_it_still_loads():
    profile = _profile()
    assert Profile.from_json(profile.to_json()) == profile
    assert [line.split(",")[0] for line in profile.verdict_lines()] == [
        "On this model", "On this model", "Recommended: run plain at 3 steps (as good as plain at 12): no reuse mode is "
        "as good for fewer model calls here."]
    assert profile.verdict_lines()[1].startswith("On this model, fast: ")
    recommended = profile.as_dict()["equal_quality"]["recommended"]
    assert {"steps", "mode", "calls", "interval", "against"} <= set(recommended)
    data = profile.as_dict()
    del data["fewer_steps"], data["equal_quality"]
    assert Profile.from_dict(data).verdict_lines() == []


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["equal_quality"]["fast"].update(calls=-1), "'equal_quality.fast.calls' must be a number between"),
    (lambda d: d["equal_quality"]["fast"].update(calls=float("inf")), "every number must be finite"),
    (lambda d: d["equal_quality"]["fast"].pop("model_calls"), "'equal_quality.fast.model_calls' must be a number"),
    (lambda d: d["equal_quality"]["fast"].update(against="plain-99"), "'equal_quality.fast.against' must be 'plain'"),
    (lambda d: d["equal_quality"]["fast"].update(held_back="yes"), "'equal_quality.fast.held_back' must be true"),
    (lambda d: d["equal_quality"]["fast"].update(resumed=9), "'equal_quality.fast.resumed' is more than its 2 pairs"),
    (lambda d: d["equal_quality"].update(turbo={}), "'equal_quality' must be an object of modes balanced, fast"),
    (lambda d: d["equal_quality"].update(fast=[1]), "'equal_quality.fast' must be an object"),
    (lambda d: d.update(equal_quality="fast wins"), "'equal_quality' must be an object"),
    (lambda d: d["fewer_steps"]["plain-6"].update(psnr_db="high"), "'fewer_steps.plain-6.psnr_db' must be a number"),
    (lambda d: d["fewer_steps"]["plain-6"].update(steps=5), "'fewer_steps.plain-6.steps' is 5, not the plain-6's"),
    (lambda d: d["fewer_steps"].update(fast={}), "must map names plain-<steps> to objects, got 'fast'"),
    (lambda d: d["equal_quality"]["fast"].update(interval=[2, 1]), "'equal_quality.fast.interval' has its low end"),
    (lambda d: d["equal_quality"]["fast"].update(interval=[1]), "'equal_quality.fast.interval' must be \\[low, high\\]"),
    (lambda d: d["equal_quality"]["fast"].update(decided_by="vibes"), "'equal_quality.fast.decided_by' must be one"),
    (lambda d: d["equal_quality"]["fast"].update(weighed_on="dreams"), "'equal_quality.fast.weighed_on' must be one"),
    (lambda d: d["equal_quality"]["recommended"].update(mode="turbo"), "'equal_quality.recommended.mode' must be one"),
    (lambda d: d["equal_quality"]["recommended"].update(against="plain-99"), "'equal_quality.recommended' needs a"),
    (lambda d: d["equal_quality"]["recommended"].update(steps=0), "'equal_quality.recommended.steps' must be a num"),
    (lambda d: d["equal_quality"].update(recommended="fast"), "'equal_quality.recommended' must be an object"),
])
def test_a_hand_edited_verdict_is_refused_naming_the_field(edit, message):
    data = _profile().as_dict()
    edit(data)
    with pytest.raises(ProfileError, match=message):
        Profile.from_json(json.dumps(data))


# ------------------------------------------------------------------ where the user reads it
def test_the_command_s_last_lines_and_a_judged_request_s_report_say_the_verdict():
    profile = _profile()
    result = fit([m.resume for m in _pairs(35.0, 26.0)[0]], QualityTarget())
    lines = Calibrated(profile=profile, result=result, resumes=12, table=[], location="/store", plots=[],
                       minutes=1.0, pairs_used=6).lines()
    assert lines[-4].startswith("filed as profile 'my wan'") and lines[-3:] == profile.verdict_lines()
    assert lines[-1].startswith("Recommended: run plain at 3 steps")  # last, what to run
    unweighed = Calibrated(profile=Profile(**{**profile.__dict__, "equal_quality": {}, "recommended": None}),
                           result=result, resumes=12,
                           table=[], location=None, plots=[], minutes=1.0, fewer_steps_note="plain at fewer steps: "
                           "not run (turned off), so no mode is weighed against lowering the steps")
    assert unweighed.lines()[-1] == unweighed.fewer_steps_note
    settings = ReuseSettings(mode="fast").with_profile(profile)
    assert settings.profile_verdict == profile.equal_quality["fast"].short("fast")
    assert ReuseSettings(mode="safe").with_profile(profile).profile_verdict == ""


def test_the_pairs_plot_puts_the_modes_beside_the_plain_steps_curve_on_the_yardstick_s_measures(tmp_path):
    measured, plain = _pairs(balanced_db=35.0, fast_db=26.0)
    weighing = PairsWeighing(measured, plain, ProbeThresholds(), STEPS, _knee_runs(4, psnr=30.0))
    written, note = calibration_plots(measured, _profile(), tmp_path, weighing)
    assert note == "" and [p.name for p in written] == ["plot-structure.png", "plot-pairs.png"]
    assert (tmp_path / "plot-pairs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [row["steps"] for row in weighing.curve()] == [3, 4, 6, STEPS]
    assert set(weighing.modes) == {(STEPS, "balanced"), (STEPS, "fast"), (4, "balanced"), (4, "fast")}


# ------------------------------------------------------------------ the knee, bisected and weighed on the pairs
def _knee_runs(steps: int, psnr: float, detail: float = 1.0, pairs: range = range(6)) -> list[KneeRun]:
    return [KneeRun(pair=p, earlier=f"e{p}", new=f"n{p}", mode=mode, steps=steps, model_calls=steps // 2 + 1,
                    skipped_steps=steps // 2, psnr_db=psnr, ssim=0.9, detail=detail, adherence=None)
            for p in pairs for mode in ("balanced", "fast")]


def _detailed(plain: list[PlainRun]) -> list[PlainRun]:
    """Plain at fewer than half the steps loses detail (0.8), at half keeps it."""
    return [PlainRun(**{**r.__dict__, "detail": 0.8 if r.steps < STEPS // 2 else 1.0}) for r in plain]


def test_the_knee_is_the_fewest_plain_steps_as_detailed_and_its_judges_bracket_it():
    measured, plain = _pairs(balanced_db=35.0, fast_db=29.0)
    weighing = PairsWeighing(measured, _detailed(plain), ProbeThresholds(), STEPS)
    assert weighing.knee() == 6  # plain at 4 and 3 steps lose detail
    *modes, knee_judge = weighing.judges()
    assert [knee_judge(n) for n in (6, 4, 3)] == [True, False, False]
    assert len(modes) == 2 and not modes[0](6)  # 31 dB at 6 steps falls short of balanced's 35 dB resumes


def test_a_mode_at_the_knee_as_good_as_full_plain_for_fewer_calls_is_recommended():
    measured, plain = _pairs(balanced_db=35.0, fast_db=29.0)
    plain = _detailed(plain)
    fewer, verdicts, recommended = weigh(measured, plain, ProbeThresholds(), STEPS, _knee_runs(6, psnr=33.0))
    # each pair at the knee: the earlier prompt at plain-6's 6 calls, the new one resumed in 4: 5 calls a request
    assert (recommended.mode, recommended.steps, recommended.model_calls) == ("balanced", 6, 5.0)
    assert recommended.against == "plain" and recommended.calls == pytest.approx(12 / 5.0)
    # knee runs that lose detail are not as good as full plain: plain at the knee is what to run
    _, _, plain_wins = weigh(measured, plain, ProbeThresholds(), STEPS, _knee_runs(6, psnr=33.0, detail=0.8))
    assert (plain_wins.mode, plain_wins.steps) == ("plain", 6)
    # knee runs missing a weighed pair are not weighed
    _, _, partial = weigh(measured, plain, ProbeThresholds(), STEPS, _knee_runs(6, psnr=33.0, pairs=range(3)))
    assert (partial.mode, partial.steps) == ("plain", 6)

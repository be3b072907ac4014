"""Calibration profiles and the fit, by what a user sees: a profile filed in a store judges the runs of its model and
schedule where the node's thresholds are left at auto, explicit thresholds still win, a damaged or hand-edited
profile is refused with the reason, and the fit picks the rule that keeps the target precision on resumes it has
not seen."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from carnator_core.calibration.fit import Resume, accepts, fit, precision_lower_bound, resumes_for_margin
from carnator_core.calibration.job import Calibrated, NoPairs, distinct_pairs
from carnator_core.calibration.plot import calibration_plots
from carnator_core.calibration.session import Measured
from carnator_core.calibration.verdict import pairs_line, verdict
from carnator_core.judging.calibration_profile import MAX_PROFILE_BYTES, THRESHOLD_RANGES, Profile, ProfileError, Score
from carnator_core.judging.probe_thresholds import ProbeThresholds
from carnator_core.judging.quality_target import QualityTarget
from carnator_core.lookup.compatible import Match
from carnator_core.lookup.shortlist import Candidate
from carnator_core.prompt_file import PromptFileError, prompt_lines
from carnator_core.prompt_pairs import Pair, parse_pairs
from carnator_core.reuse.run import ReuseRun
from carnator_core.reuse.settings import ReuseSettings
from carnator_core.store.entry import CheckpointRecord, EntryMeta, HardKey
from carnator_core.store.profiles import DOCUMENT, profile_for, save_profile, stored_profiles
from carnator_core.store.reuse_store import IndexVectors, ReuseStore
from carnator_core.store.tensor_codec import encode_tensors

KEY = HardKey("a1b2c3", (2, 2, 2), "d4e5f6")
SHAPE = (1, 4, 2, 4, 4)
STEPS = 10


def _profile(**changes) -> Profile:
    values = {"model": KEY.model, "schedule": KEY.schedule, "name": "my wan",
              "thresholds": {"structure": 0.7, "structure_slope": 0.03, "guidance": 0.5, "guidance_slope": 0.03},
              "held_back": Score(accepted=20, good=20, precision=1.0, recall=1.0), "in_force": True,
              "reason": "in force: held-back precision 1.00"}
    values.update(changes)
    return Profile(**values)


# ------------------------------------------------------------------ the profile file
def test_a_profile_survives_its_json_and_names_itself():
    profile = _profile(fit_pairs=8, held_back_pairs=4)
    again = Profile.from_json(profile.to_json())
    assert again == profile
    assert again.describe().startswith("profile 'my wan' (") and again.describe().endswith(", 12 pairs)")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["thresholds"].update(structure=float("nan")), "every number must be finite"),
    (lambda d: d["thresholds"].update(structure=1.5), "'structure' must be a number between 0.0 and 1.0"),
    (lambda d: d["thresholds"].pop("guidance"), "thresholds must hold exactly"),
    (lambda d: d["thresholds"].update(extra=0.1), "thresholds must hold exactly"),
    (lambda d: d.pop("model"), "'model' must be a non-empty string"),
    (lambda d: d.update(format="something else"), "not a Carnator calibration profile"),
    (lambda d: d.update(version=99), "profile version 99"),
    (lambda d: d["target"].update(precision="high"), "'precision' must be a number"),
    (lambda d: d.update(name="x" * 500), "'name' must be a non-empty string of at most 200"),
    (lambda d: d["thresholds"].update(structure=-0.2), "'structure' must be a number between 0.0 and 1.0"),
    (lambda d: d["thresholds"].update(guidance_slope=-0.1), "'guidance_slope' must be a number between 0.0"),
    (lambda d: d.pop("in_force"), "'in_force' must be true or false"),
    (lambda d: d.pop("reason"), "'reason' must be a non-empty string"),
    (lambda d: d.pop("held_back"), "'held_back' must be an object"),
    (lambda d: d.update(in_force="yes"), "'in_force' must be true or false"),
    (lambda d: d["held_back"].update(precision=0.5), "'in_force' is true but its held-back precision"),
    (lambda d: d.update(forced=True, in_force=False), "'forced' is true but 'in_force' is false"),
])
def test_a_hand_edited_profile_is_refused_naming_the_field(edit, message):
    data = _profile().as_dict()
    edit(data)
    with pytest.raises(ProfileError, match=message):
        Profile.from_json(json.dumps(data))


def test_a_profile_larger_than_the_bound_or_not_json_is_refused_unread():
    with pytest.raises(ProfileError, match="refused: a profile is at most"):
        Profile.from_json("{" + " " * MAX_PROFILE_BYTES + "}")
    with pytest.raises(ProfileError, match="not JSON"):
        Profile.from_json(b"\x80\x04\x95pickle")
    with pytest.raises(ProfileError, match="not a JSON object"):
        Profile.from_json("[1, 2]")


# ------------------------------------------------------------------ in the store, judging runs
def _donor(store: ReuseStore) -> Candidate:
    checkpoints = [CheckpointRecord(step=s, sigma=1 - s / STEPS) for s in range(1, STEPS)]
    meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=KEY, prompt="donor", latent_shape=SHAPE,
                     noise_fingerprint="noise", total_steps=STEPS, checkpoints=checkpoints)
    tensors = {f"{kind}_{s}": torch.full(SHAPE, float(s)) for s in range(1, STEPS) for kind in ("x", "x0")}
    store.put(meta, {"checkpoints": encode_tensors(tensors)},
              IndexVectors(text=None, cond=torch.nn.functional.normalize(torch.ones(64), dim=0)))
    return Candidate(entry_id=meta.entry_id, prompt="donor", score=1.0, cond_similarity=1.0, text_similarity=None)


def _planned(store: ReuseStore, hard_key: HardKey = KEY, **inputs) -> ReuseRun:
    run = ReuseRun(settings=ReuseSettings.from_inputs(**inputs), store=store, hard_key=hard_key, latent_shape=SHAPE,
                   noise_fingerprint="noise", cond_vector=torch.ones(64),
                   sigmas=[1 - s / STEPS for s in range(STEPS + 1)], cfg=1.0, seed=0)
    run.plan(Match(store_location="", request=None, candidates=[_donor(store)]))
    return run


def test_thresholds_left_at_auto_are_the_profile_s_and_the_report_names_it(store):
    assert _planned(store).report(1.0).judged_by == "shipped thresholds"
    save_profile(store, _profile())
    run = _planned(store)
    assert run.settings.thresholds == ProbeThresholds(structure=0.7, structure_slope=0.03, guidance=0.5,
                                                      guidance_slope=0.03)
    report = run.report(1.0)
    assert report.judged_by.startswith("profile 'my wan'")
    assert "judged by profile 'my wan'" in report.text() and report.as_dict()["judged_by"] == report.judged_by


def test_a_threshold_set_on_the_node_overrides_the_profile(store):
    save_profile(store, _profile())
    run = _planned(store, structure_threshold=0.9)
    assert run.settings.thresholds.structure == 0.9 and run.settings.thresholds.guidance == 0.5
    assert run.report(1.0).judged_by.endswith("with node inputs for structure")
    every = _planned(store, structure_threshold=0.9, guidance_threshold=0.9, depth_slope=0.1)
    assert every.report(1.0).judged_by == "node inputs"
    assert any("not used: every threshold is set on the node" in note for note in every.report(1.0).notes)


def test_a_profile_of_another_schedule_or_model_is_not_used_and_says_why(store):
    save_profile(store, _profile(schedule="0ther5"))
    run = _planned(store)
    assert run.settings.thresholds == ProbeThresholds()
    assert any("profiles are for other schedules" in note for note in run.report(1.0).notes)
    assert _planned(store, hard_key=HardKey("0ther", KEY.grid, KEY.schedule)).report(1.0).notes == []


def test_a_damaged_profile_in_the_store_is_refused_and_the_run_uses_the_shipped_thresholds(store):
    data = _profile().as_dict()
    data["thresholds"]["structure"] = float("nan")
    store.set_document(DOCUMENT, json.dumps({f"{KEY.model}/{KEY.schedule}": data}).encode())
    run = _planned(store)
    assert run.settings.thresholds == ProbeThresholds()
    assert any("calibration profile refused" in note and "got nan" in note for note in run.report(1.0).notes)
    store.set_document(DOCUMENT, b"\x80\x04not json")
    assert "not JSON" in profile_for(store, KEY.model, KEY.schedule, 1.0)[1]


def test_a_profile_measured_at_another_guidance_scale_is_not_used(store):
    save_profile(store, _profile(cfg=6.0))
    profile, note = profile_for(store, KEY.model, KEY.schedule, 1.0)
    assert profile is None and "was measured at cfg 6, this run samples at cfg 1" in note
    assert profile_for(store, KEY.model, KEY.schedule, 6.0)[0] is not None


def test_profiles_outlive_clearing_the_entries(store):
    _donor(store)
    save_profile(store, _profile())
    store.clear()
    assert list(stored_profiles(store)[0]) == [f"{KEY.model}/{KEY.schedule}"]


# ------------------------------------------------------------------ forced resumes
@pytest.mark.parametrize(("verification", "deepest"), [("forced 20%", 2), ("forced 35%", 4), ("forced 65%", 6),
                                                      ("forced 80%", 8)])
def test_a_forced_resume_plans_the_checkpoint_recorded_at_its_depth_whatever_the_mode(store, verification, deepest):
    run = ReuseRun(settings=ReuseSettings.from_inputs(mode="safe", verification=verification), store=store,
                   hard_key=KEY, latent_shape=SHAPE, noise_fingerprint="noise", cond_vector=torch.ones(64),
                   sigmas=[1 - s / STEPS for s in range(STEPS + 1)], cfg=1.0, seed=0)
    targets = run.plan(Match(store_location="", request=None, candidates=[_donor(store)]))
    assert targets[0].step == deepest
    thirty = ReuseRun(settings=run.settings, store=store, hard_key=KEY, latent_shape=SHAPE, noise_fingerprint="n",
                      cond_vector=torch.ones(64), sigmas=[1 - s / 30 for s in range(31)], cfg=1.0, seed=0)
    assert round(thirty.resume_limit * 30) in ReuseSettings().checkpoint_steps(30)


# ------------------------------------------------------------------ the fit
def _resumes(pairs: int) -> list[Resume]:
    """Resumes whose quality follows their structure agreement: at 0.9 and above they stay within 35 dB of plain."""
    resumes = []
    for pair in range(pairs):
        for depth, structure in ((0.2, 0.80 + 0.015 * pair), (0.5, 0.84 + 0.015 * pair)):
            good = structure >= 0.9
            resumes.append(Resume(pair=pair, depth=depth, screen_structure=0.95, screen_guidance=None,
                                  structure=structure, guidance=None, psnr_db=35.0 if good else 20.0,
                                  ssim=0.98 if good else 0.8, oracle_kept=good))
    return resumes


def test_the_fit_accepts_what_meets_the_target_and_holds_on_held_back_pairs():
    result = fit(_resumes(12), QualityTarget(psnr_db=30.0, ssim=0.95, precision=0.95))
    assert (result.fit_pairs, result.held_back_pairs) == (8, 4) and result.met_target
    assert result.fitted.precision == 1.0 and result.fitted.recall == 1.0
    assert result.held_back.precision == 1.0 and result.oracle.precision == 1.0
    assert result.thresholds.guidance == ProbeThresholds().guidance  # no CFG in these runs: left as shipped
    rule = result.thresholds
    assert not accepts(rule, Resume(pair=0, depth=0.2, screen_structure=0.95, screen_guidance=None,
                                    structure=0.85, guidance=None, psnr_db=0, ssim=0))


def test_a_fit_with_nothing_good_to_accept_accepts_nothing():
    bad = [Resume(pair=p, depth=0.5, screen_structure=0.99, screen_guidance=None, structure=0.99, guidance=None,
                  psnr_db=10.0, ssim=0.2) for p in range(6)]
    result = fit(bad, QualityTarget())
    assert result.fitted.accepted == 0 and result.held_back.accepted == 0 and not result.met_target
    profile = Profile(model="m", schedule="s", name="chaotic", thresholds={name: getattr(result.thresholds, name) for name in THRESHOLD_RANGES},
                      target=QualityTarget(), fit_pairs=result.fit_pairs, held_back_pairs=result.held_back_pairs,
                      held_back=result.held_back, oracle=None)
    decided = verdict(result, QualityTarget(), pairs_used=6)
    profile = dataclasses.replace(profile, in_force=decided.in_force, reason=decided.reason)
    said = Calibrated(profile=profile, result=result, resumes=len(bad), table=[], location="here", plots=[],
                      minutes=1.0, pairs_used=6).lines()
    assert any("this profile accepts no resume" in line and "loosen the target" in line for line in said)
    # first what it means for the user's runs, in one line, then how many pairs were used of those needed
    # the shipped rule takes these bad resumes: the profile that resumes nothing is the safer one, so in force
    assert said[0] == decided.reason and said[0].startswith("in force: no rule keeps the target here and the "
                                                            "shipped rule's held-back precision is 0.00")
    assert said[1].startswith("pairs used 6; a stable fit here") and said[-1].endswith("(in force)")


def test_pairs_are_split_by_a_tab_or_by_an_arrow_and_a_line_that_is_no_pair_is_named():
    lines = ["a red fox in snow\ta red fox in fresh snow", "a cat on a sofa => a cat asleep on a sofa"]
    assert parse_pairs(lines, "pairs") == [Pair("a red fox in snow", "a red fox in fresh snow"),
                                           Pair("a cat on a sofa", "a cat asleep on a sofa")]
    assert parse_pairs(prompt_lines("# my edits\n\n a => b \n"), "pairs") == [Pair("a", "b")]
    for line in ("just one prompt", "a => b => c", "a =>  "):
        with pytest.raises(PromptFileError, match=r"pairs, pair 2 .*separated by a tab or by =>"):
            parse_pairs(["x => y", line], "pairs")


# ------------------------------------------------------------------ put in force, or not
def test_a_hand_edited_profile_in_force_with_negative_or_nan_thresholds_is_refused_when_filed_or_imported(store):
    """Filing (`save_profile`, what calibration and the import route call) checks the profile as reading does."""
    for bad in (-0.5, float("nan")):
        thresholds = {**_profile().thresholds, "structure": bad}
        with pytest.raises(ProfileError, match="'structure' must be a number between 0.0 and 1.0"):
            save_profile(store, _profile(thresholds=thresholds))
        data = _profile().as_dict()
        data["thresholds"]["guidance"] = bad
        with pytest.raises(ProfileError, match="guidance|finite"):
            Profile.from_json(json.dumps(data))
    assert stored_profiles(store) == ({}, {})


def test_a_profile_not_in_force_leaves_the_shipped_thresholds_judging_and_says_why(store):
    save_profile(store, _profile(in_force=False, reason="not in force: held-back precision 0.80 is below the target"))
    run = _planned(store)
    assert run.settings.thresholds == ProbeThresholds()
    assert run.report(1.0).judged_by == "shipped thresholds"
    assert any("is not in force (not in force: held-back precision 0.80" in note for note in run.report(1.0).notes)


def test_a_forced_profile_judges_and_every_report_says_it_lacks_held_back_support(store):
    save_profile(store, _profile(held_back=Score(15, 15, 0.8, 1.0), forced=True))
    report = _planned(store).report(1.0)
    assert report.judged_by.startswith("profile 'my wan'")
    assert report.judged_by.endswith("(put in force without held-back support)")
    assert "(put in force without held-back support)" in report.text()


def _fitted(held: Score, shipped: Score | None, met_target: bool = True, pairs_needed: int | None = 40):
    result = fit(_resumes(12), QualityTarget())
    return dataclasses.replace(result, held_back=held, shipped_held_back=shipped, met_target=met_target,
                               pairs_needed=pairs_needed)


@pytest.mark.parametrize(("held", "shipped", "in_force", "said"), [
    (Score(15, 12, 0.80, 1.0), Score(10, 10, 1.0, 0.8), False, "held-back precision 0.80 (12 of 15 accepted resumes "
                                                                "good) is below the target 0.95"),
    (Score(20, 19, 0.95, 1.0), Score(10, 10, 1.0, 0.5), False, "below the shipped rule's 1.00 on the same resumes"),
    (Score(20, 20, 1.0, 1.0), Score(10, 10, 1.0, 0.5), True, "meets the target 0.95, the shipped rule's 1.00"),
    (Score(20, 20, 1.0, 1.0), Score(0, 0, None, None), True, "meets the target 0.95"),
    (Score(0, 10, None, 0.0), Score(5, 5, 1.0, 0.5), False, "accepted none of the 4 held-back pairs' resumes"),
])
def test_held_back_pairs_decide_whether_a_profile_is_in_force(held, shipped, in_force, said):
    decided = verdict(_fitted(held, shipped), QualityTarget(), pairs_used=12)
    assert decided.in_force == in_force and not decided.forced and said in decided.reason
    assert decided.reason.startswith("in force: " if in_force else "not in force: ")
    if not in_force:
        assert decided.reason.endswith("about 28 more pairs (40 in all) would settle it")
    forced = verdict(_fitted(held, shipped), QualityTarget(), pairs_used=12, force=True)
    assert forced.in_force and forced.forced == (not in_force)


def test_a_fit_that_keeps_no_rule_resumes_nothing_in_force_only_where_the_shipped_rule_misses_too():
    nothing = Score(0, 3, None, 0.0)
    assert verdict(_fitted(nothing, Score(6, 3, 0.5, 1.0), met_target=False), QualityTarget(), 12).in_force
    assert not verdict(_fitted(nothing, Score(6, 6, 1.0, 1.0), met_target=False), QualityTarget(), 12).in_force


def test_the_pairs_line_and_the_estimate_of_the_pairs_a_stable_fit_needs():
    result = fit(_resumes(12), QualityTarget())
    assert result.pairs_needed is not None and result.pairs_needed > 12
    assert pairs_line(result, 12) == f"pairs used 12; a stable fit here needs about {result.pairs_needed}"
    assert "cannot be told here" in pairs_line(dataclasses.replace(result, pairs_needed=None), 12)
    no_held_back = verdict(dataclasses.replace(result, held_back_pairs=0), QualityTarget(), 2)
    assert not no_held_back.in_force and "no pair was held back" in no_held_back.reason


def test_the_lower_bound_is_clopper_pearson_one_sided_at_95_percent():
    assert resumes_for_margin(0.95) == 59  # 0.95^59 < 0.05 < 0.95^58
    assert precision_lower_bound(59, 59) >= 0.95 > precision_lower_bound(58, 58)
    assert precision_lower_bound(12, 15) == pytest.approx(0.5602, abs=1e-3)  # beta.ppf(0.05, 12, 4)
    assert precision_lower_bound(0, 5) == 0.0 and precision_lower_bound(0, 0) is None


def _separable(pairs: int) -> list[Resume]:
    """Resumes that are good wherever the structure agreement is at least 0.75, far below the shipped bar."""
    return [Resume(pair=pair, depth=depth, screen_structure=0.99, screen_guidance=None,
                   structure=structure, guidance=None, psnr_db=35.0 if structure >= 0.75 else 20.0,
                   ssim=0.98 if structure >= 0.75 else 0.8)
            for pair in range(pairs) for depth, structure in ((0.2, 0.70), (0.35, 0.78), (0.5, 0.80), (0.8, 0.82))]


def test_few_resumes_never_loosen_the_shipped_rule_and_enough_of_them_may():
    shipped = ProbeThresholds()
    few = fit(_separable(12), QualityTarget())
    assert not few.margin_met and few.thresholds.structure >= shipped.structure
    assert few.thresholds.structure_slope >= shipped.structure_slope
    many = fit(_separable(45), QualityTarget())  # 30 fitted pairs: 90 good resumes above 0.75, none bad
    assert many.margin_met and many.thresholds.structure < shipped.structure
    assert many.lower_bound >= 0.95 and many.held_back.precision == 1.0


def test_one_pair_or_identical_pairs_say_so_and_put_no_profile_in_force():
    said: list[str] = []
    assert distinct_pairs([Pair("a", "b")] * 3 + [Pair("c", "c")], said.append) == [Pair("a", "b")]
    assert "pair 2 ('a' -> 'b') repeats an earlier pair: skipped" in said
    assert "pair 4 ('c') has the same prompt twice: skipped" in said
    assert said[-1].startswith("1 distinct pair of 4 given: no profile will be put in force")
    with pytest.raises(NoPairs, match="0 distinct pairs of 1 given: nothing to calibrate on"):
        distinct_pairs([Pair("c", "c")], said.append)
    said.clear()
    assert len(distinct_pairs([Pair("a", "b"), Pair("a", "c"), Pair("b", "c")], said.append)) == 3 and not said
    one_pair = verdict(fit(_resumes(1), QualityTarget()), QualityTarget(), pairs_used=1)
    assert not one_pair.in_force and "no pair was held back" in one_pair.reason


def test_the_calibration_plot_with_matplotlib_and_one_line_without(tmp_path, monkeypatch):
    measured = [Measured(resume=r, requested_depth=r.depth, earlier="a", new="b", skipped_steps=3, total_steps=10,
                         seconds=1.0) for r in _resumes(6)]
    written, note = calibration_plots(measured, _profile(), tmp_path)
    assert note == "" and [p.name for p in written] == ["plot-structure.png"]
    assert written[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setattr("carnator_core.calibration.plot.pyplot", lambda: None)
    assert calibration_plots(measured, _profile(), tmp_path / "none") == (
        [], "no calibration plot: matplotlib is not installed; pip install 'carnator[plot]' (matplotlib)")


def test_without_the_margin_a_fit_the_shipped_rule_already_meets_keeps_the_shipped_rule():
    """Tightening where the data asks for no change would only lose good resumes on pairs the fit never saw."""
    agreeing = [Resume(pair=pair, depth=0.5, screen_structure=0.99, screen_guidance=None, structure=0.99,
                       guidance=None, psnr_db=40.0, ssim=0.99) for pair in range(12)]
    result = fit(agreeing, QualityTarget())
    assert result.thresholds == ProbeThresholds() and result.met_target and not result.margin_met

"""Calibration profiles and the fit, by what a user sees: a profile filed in a store judges the runs of its model and
schedule where the node's thresholds are left at auto, explicit thresholds still win, a damaged or hand-edited
profile is refused with the reason, and the fit picks the rule that keeps the target precision on resumes it has
not seen."""

from __future__ import annotations

import json

import pytest
import torch

from carnator_core.calibration.fit import Resume, accepts, fit
from carnator_core.calibration.job import Calibrated
from carnator_core.calibration.pairs import Pair, parse_pairs
from carnator_core.calibration.profile import MAX_PROFILE_BYTES, THRESHOLD_RANGES, Profile, ProfileError, QualityTarget
from carnator_core.lookup.compatible import Match
from carnator_core.lookup.shortlist import Candidate
from carnator_core.prompt_file import PromptFileError, prompt_lines
from carnator_core.reuse.probe import ProbeThresholds
from carnator_core.reuse.run import ReuseRun
from carnator_core.reuse.settings import ReuseSettings
from carnator_core.store.entry import EntryMeta, HardKey
from carnator_core.store.profiles import DOCUMENT, profile_for, save_profile, stored_profiles
from carnator_core.store.reuse_store import IndexVectors, ReuseStore
from carnator_core.store.tensor_codec import encode_tensors

KEY = HardKey("a1b2c3", (2, 2, 2), "d4e5f6")
SHAPE = (1, 4, 2, 4, 4)
STEPS = 10


def _profile(**changes) -> Profile:
    values = {"model": KEY.model, "schedule": KEY.schedule, "name": "my wan",
              "thresholds": {"structure": 0.7, "structure_slope": 0.03, "guidance": 0.5, "guidance_slope": 0.03}}
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
    (lambda d: d["thresholds"].update(structure=1.5), "'structure' must be a number between -1.0 and 1.0"),
    (lambda d: d["thresholds"].pop("guidance"), "thresholds must hold exactly"),
    (lambda d: d["thresholds"].update(extra=0.1), "thresholds must hold exactly"),
    (lambda d: d.pop("model"), "'model' must be a non-empty string"),
    (lambda d: d.update(format="something else"), "not a Carnator calibration profile"),
    (lambda d: d.update(version=99), "profile version 99"),
    (lambda d: d["target"].update(precision="high"), "'precision' must be a number"),
    (lambda d: d.update(name="x" * 500), "'name' must be a non-empty string of at most 200"),
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
    checkpoints = [{"step": s, "sigma": 1 - s / STEPS, "guidance": False, "evaluated": True} for s in range(1, STEPS)]
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
    said = Calibrated(profile=profile, result=result, resumes=len(bad), table=[], location=None, plots=[],
                      minutes=1.0).lines()
    assert any("this profile accepts no resume" in line and "loosen the target" in line for line in said)


def test_pairs_are_split_by_a_tab_or_by_an_arrow_and_a_line_that_is_no_pair_is_named():
    lines = ["a red fox in snow\ta red fox in fresh snow", "a cat on a sofa => a cat asleep on a sofa"]
    assert parse_pairs(lines, "pairs") == [Pair("a red fox in snow", "a red fox in fresh snow"),
                                           Pair("a cat on a sofa", "a cat asleep on a sofa")]
    assert parse_pairs(prompt_lines("# my edits\n\n a => b \n"), "pairs") == [Pair("a", "b")]
    for line in ("just one prompt", "a => b => c", "a =>  "):
        with pytest.raises(PromptFileError, match=r"pairs, pair 2 .*separated by a tab or by =>"):
            parse_pairs(["x => y", line], "pairs")

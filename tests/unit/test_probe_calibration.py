"""The probe calibration benchmark runs end to end (figures are not asserted: the full run is a command)."""

import math

import numpy as np
import torch

from carnator_core.bench.probe import (
    RELATIONS,
    SIGNALS,
    Row,
    accepted_but_lost,
    auc,
    calibrate,
    corrected_rule,
    precision_recall,
    prompt_pairs,
    safe_threshold,
    shortcuts_by_relation,
    start_screen_passes,
    summarise,
)
from carnator_core.demo.wan_model import WanConfig, WanT2V
from carnator_core.judging.probe_thresholds import ProbeThresholds


def test_calibration_runs_and_summarises_every_signal():
    model = WanT2V(WanConfig(dim=128, ffn_dim=256, num_layers=1)).eval()
    generator = torch.Generator().manual_seed(0)
    for parameter in model.parameters():  # the zero-initialised output head would predict x0 = x exactly
        parameter.data = torch.randn(parameter.shape, generator=generator) * 0.05
    rows = calibrate(model, prompt_pairs(1, np.random.default_rng(0)), steps=4, depths=[1, 2], cfg_scale=3.0, seed=0)
    assert {row.relation for row in rows} == set(RELATIONS) and len(rows) == 2 * len(RELATIONS)
    summary = summarise(rows)
    assert set(summary["auc"]) == set(SIGNALS)
    assert set(summary["auc_by_depth"]) == {"0.25", "0.50"}
    assert all(math.isfinite(value) for value in summary["unrelated_raw_agreement_by_depth"].values())
    assert all(-1.0 <= r.text_cosine <= 1.0 + 1e-4 and 0.0 <= r.adherence_plain <= 1.0 for r in rows)
    assert set(summary["default_rule_by_depth"]) == set(summary["safe_structure_threshold_by_depth"]) == {"0.25", "0.50"}
    assert all(set(r.lost) <= {"shape", "colour", "motion", "background"} for r in rows)
    assert all(not r.lost for r in rows if r.outcome)
    screen = summary["start_screen_by_relation"]  # one pair per relation, its step-0 signals on every row
    assert set(screen) == set(RELATIONS) and all(s["pairs"] == 1 and s["passed"] in (0, 1) for s in screen.values())
    assert all(math.isfinite(r.start_structure_agreement) and r.start_guidance_cosine is not None for r in rows)
    assert summary["default_rule_after_start_screen"]["accepted"] <= summary["default_rule"]["accepted"]


def _row(structure: float, kept: bool) -> Row:
    return Row("reworded", 0.5, 0.9, structure, 0.9, 0.9, adherence_plain=1.0, adherence_resumed=1.0 if kept else 0.5)


def test_precision_recall_and_safe_threshold():
    assert precision_recall([True, True, False, False], [True, False, True, False]) == {
        "accepted": 2, "good": 2, "precision": 0.5, "recall": 0.5}
    assert precision_recall([False], [False])["precision"] is None
    rows = [_row(0.95, True), _row(0.9, True), _row(0.85, False), _row(0.8, True)]
    safe = safe_threshold(rows)
    assert 0.85 < safe["threshold"] < 0.9 and safe["recall"] == 2 / 3  # above the one resume that lost quality


def test_auc_definition():
    assert auc([0.9, 0.8, 0.1], [True, True, False]) == 1.0
    assert auc([0.1, 0.9], [True, False]) == 0.0
    assert auc([0.5, 0.5], [True, False]) == 0.5
    assert auc([0.5], [True]) is None


def test_accepted_resumes_that_lost_quality_are_listed_by_relation_and_attribute():
    """Only what the default rule accepted (structure 0.95 passes at depth 0.5, 0.5 does not) and lost counts."""
    lost_motion = Row("reworded", 0.5, 0.9, 0.95, 0.95, 0.9, adherence_plain=1.0, adherence_resumed=0.75,
                      lost=["motion"])
    rejected = Row("colour", 0.5, 0.2, 0.5, 0.5, 0.9, adherence_plain=1.0, adherence_resumed=0.75, lost=["colour"])
    assert accepted_but_lost([lost_motion, lost_motion, rejected, _row(0.95, True)]) == {"reworded: motion": 2}


def test_shortcuts_resume_from_the_corrected_donor_state_and_from_the_requests_own_step_0_alone():
    """With shortcuts every row also carries the two other resumes, scored like the donor's."""
    model = WanT2V(WanConfig(dim=128, ffn_dim=256, num_layers=1)).eval()
    generator = torch.Generator().manual_seed(1)
    for parameter in model.parameters():
        parameter.data = torch.randn(parameter.shape, generator=generator) * 0.05
    rows = calibrate(model, prompt_pairs(1, np.random.default_rng(0)), steps=4, depths=[2], cfg_scale=1.0, seed=0,
                     shortcuts=True)
    assert all(r.corrected is not None and r.own_shortcut is not None for r in rows)
    assert all(0.0 <= r.corrected[0] <= 1.0 and 0.0 <= r.own_shortcut[0] <= 1.0 for r in rows)
    assert all(math.isfinite(r.psnr_resumed) and math.isfinite(r.own_shortcut[1]) for r in rows)
    # a reworded pair's prompts predict alike at step 0, so the corrected state stays near the donor's
    reworded = next(r for r in rows if r.relation == "reworded")
    assert abs(reworded.corrected[1] - reworded.psnr_resumed) < abs(reworded.own_shortcut[1] - reworded.psnr_resumed) + 1e-6
    table = shortcuts_by_relation(rows)
    assert set(table) == set(RELATIONS)
    assert all(set(starts) == {"donor", "corrected", "own_shortcut"} and all(s["rows"] == 1 for s in starts.values())
               for starts in table.values())
    assert summarise(rows)["shortcuts_by_relation"] == table
    # the probe at the corrected state, as the engine asks a screened donor, scored beside the donor state's
    assert all(math.isfinite(r.corrected_structure_agreement) for r in rows)
    lenient = ProbeThresholds(structure=0.0, structure_slope=0.0, guidance=-1.0)
    rule = corrected_rule(rows, lenient)
    screened = sum(start_screen_passes(r, lenient) for r in rows)
    assert screened >= sum(start_screen_passes(r) for r in rows)  # the rule's own bar screens too
    assert rule["accepted"] == rule["donor_state"]["accepted"] == screened  # a bar of 0 takes every screened row
    assert rule["good"] == sum(r.corrected[0] >= r.adherence_plain - 1e-9 for r in rows
                               if start_screen_passes(r, lenient))
    assert 0 <= rule["borrowed"] <= rule["good"] and sum(rule["accepted_by_relation"].values()) == screened
    assert shortcuts_by_relation(calibrate(model, prompt_pairs(1, np.random.default_rng(0)), 4, [2], 1.0, 0)) == {}  # without shortcuts: no table

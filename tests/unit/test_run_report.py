"""The JSON of every kind of run report: the fields the CarnatorReport node, `carnator.status` and the badge read."""

from __future__ import annotations

import pytest
import torch

from carnator_core.attention.sparse_attention import SparseAttentionRun, SparseAttentionSettings
from carnator_core.judging.probe_signals import ProbeSignals
from carnator_core.lookup.compatible import Match
from carnator_core.lookup.shortlist import Candidate
from carnator_core.reuse.decision import ProbeRecord
from carnator_core.reuse.outcome import Reason, Resume, SampleFresh
from carnator_core.reuse.report import SEED_ACTION, RunReport, Verdict
from carnator_core.reuse.run import STORE_UNAVAILABLE, ReuseRun
from carnator_core.reuse.settings import ReuseSettings
from carnator_core.store.entry import CheckpointRecord, EntryMeta, HardKey
from carnator_core.store.reuse_store import IndexVectors, ReuseStore
from carnator_core.store.tensor_codec import encode_tensors

KEY = HardKey("model", (2, 4, 4), "schedule")
SHAPE = (1, 16, 2, 8, 8)
FULL_FIELDS = ["hit", "verdict", "mode", "prompt", "judged_by", "donor_id", "donor_prompt", "text_similarity", "agreement", "structure_agreement",
               "guidance_cosine", "skipped_steps", "total_steps", "exact_repeat", "resumed_at", "attention_density", "attention", "heads_reuse",
               "heads_own", "model_calls", "time_s", "time_saved_s", "reason", "seed_miss", "probes", "candidates", "filtered",
               "skipped_donors", "notes", "stage"]
ATTENTION_FIELDS = ["hit", "verdict", "mode", "donor_id", "donor_prompt", "text_similarity", "agreement", "skipped_steps",
                    "total_steps", "attention_density", "heads_reuse", "heads_own", "time_s", "time_saved_s", "reason",
                    "attention"]
ATTENTION_SUMMARY = {"density": 0.25, "sparse_calls": 6, "dense_calls": 2, "borrowed_sparse_calls": 0,
                     "heads_reuse": 3, "heads_own": 1}
CANDIDATE = Candidate(entry_id="donor-1", prompt="a red ball", score=0.9, cond_similarity=0.8, text_similarity=0.95)


def _run(tmp_path, **settings) -> ReuseRun:
    return ReuseRun(settings=ReuseSettings(prompt="a red ball", record=False, **settings),
                    store=ReuseStore(str(tmp_path / "store")), hard_key=KEY, latent_shape=SHAPE,
                    noise_fingerprint="noise", cond_vector=torch.ones(256), sigmas=[1 - s / 10 for s in range(11)],
                    cfg=5.0, seed=3)


DONOR_X0 = torch.linspace(-1.0, 1.0, 16 * 2 * 8 * 8).reshape(SHAPE)


def _match(run: ReuseRun, noise: str = "noise", **match) -> Match:
    """A lookup's match of one stored donor ("a red ball", checkpoint at step 5, predicting DONOR_X0 there) made
    from the initial noise `noise`."""
    meta = EntryMeta(entry_id="donor-1", hard_key=KEY, prompt="a red ball", latent_shape=SHAPE,
                     noise_fingerprint=noise, total_steps=10, sample_seconds=4.0,
                     checkpoints=[CheckpointRecord(step=5, sigma=0.5)])
    run.store.put(meta, {"checkpoints": encode_tensors({"x_5": torch.zeros(SHAPE), "x0_5": DONOR_X0})},
                  IndexVectors(text=None, cond=torch.nn.functional.normalize(torch.ones(256), dim=0)))
    return Match(store_location="store", request=None, candidates=[CANDIDATE], **match)


def test_a_reuse_hit_reports_the_donor_its_signals_and_the_saving(tmp_path):
    run = _run(tmp_path)
    outcome = run.decide(None, lambda states, sigma: [(DONOR_X0.clone(), None) for _ in states],
                         _match(run, filtered={"other model": 2}, notes=["a note"]))
    assert isinstance(outcome, Resume) and outcome.step == 5 and outcome.reason == Reason("probe passed")
    assert outcome.replay is None and outcome.served is not None and outcome.served.evaluated is outcome.state
    data = run.finish(model_calls=5).as_dict()
    assert set(data) == set(FULL_FIELDS)
    assert data["probes"] == [{"donor_id": "donor-1", "donor_prompt": "a red ball", "step": 5, "passed": True,
                               "donor_given_up": False, "batched_with": 0, "confirms_deeper": False, "depth": 0.5,
                               "raw_agreement": 1.0, "structure_agreement": 1.0, "guidance_cosine": None}]
    assert {name: data[name] for name in ("hit", "verdict", "donor_id", "donor_prompt", "text_similarity",
                                          "agreement", "structure_agreement", "skipped_steps", "total_steps",
                                          "model_calls", "reason", "candidates", "filtered", "notes", "stage")} == {
        "hit": True, "verdict": "resumed", "donor_id": "donor-1", "donor_prompt": "a red ball",
        "text_similarity": 0.95, "agreement": 1.0, "structure_agreement": 1.0, "skipped_steps": 5,
        "total_steps": 10, "model_calls": 6, "reason": "",
        "candidates": [{"entry_id": "donor-1", "prompt": "a red ball", "score": 0.9}],
        "filtered": {"other model": 2}, "stage": {},
        # the donor holds step 5 alone of the states a 10-step run records up to half-way
        "notes": ["a note", "donor donor-1 lacks its states at steps 2, 4: probed only at those it holds"],
    }
    assert data["time_saved_s"] == pytest.approx(data["time_s"])  # 5 steps saved of 10, at the run's own pace
    assert RunReport.from_dict(data).as_dict() == data


def test_a_reuse_miss_says_why(tmp_path):
    run = _run(tmp_path)
    outcome = run.decide(None, lambda states, sigma: [(-DONOR_X0, None) for _ in states], _match(run))
    assert outcome == SampleFresh(served=None, continues_from=None, reason=Reason("probe rejected", "probe rejected"))
    data = run.finish(model_calls=10).as_dict()
    assert set(data) == set(FULL_FIELDS)
    assert (data["hit"], data["verdict"], data["reason"], data["donor_id"], data["model_calls"]) == (
        False, "miss", "probe rejected", None, 11)
    assert [(p["step"], p["passed"], p["donor_given_up"]) for p in data["probes"]] == [(5, False, True)]
    assert data["seed_miss"] is False


def test_a_miss_only_for_the_seed_says_so_and_how_to_keep_it(tmp_path):
    run = _run(tmp_path)
    outcome = run.decide(None, lambda states, sigma: [], _match(run, noise="other noise"))
    assert outcome.reason == Reason("donors filtered", "filtered: other initial noise (seed)")
    report = run.finish(model_calls=10)
    data = report.as_dict()
    assert (data["verdict"], data["reason"], data["seed_miss"]) == (
        "miss", "filtered: other initial noise (seed)", True)
    assert f"  seed: {SEED_ACTION}" in report.text().splitlines()
    assert RunReport.from_dict(data).seed_miss
    served = _run(tmp_path / "serving", seed_policy="serving")
    assert served.plan(_match(served, noise="other noise"))  # serving takes the donor to the model
    assert not served.finish(model_calls=10).seed_miss


def test_a_reuse_run_without_its_store_reports_it_unavailable():
    store = ReuseStore("redis://127.0.0.1:1/0")  # nothing listens there: the connection is refused
    run = ReuseRun(settings=ReuseSettings(prompt="a red ball", record=False), store=store, hard_key=KEY,
                   latent_shape=SHAPE, noise_fingerprint="noise", cond_vector=torch.ones(256),
                   sigmas=[1 - s / 10 for s in range(11)], cfg=5.0, seed=3)
    outcome = run.decide(None, lambda states, sigma: [])
    assert outcome == SampleFresh(served=None, continues_from=None,
                                  reason=Reason("store unavailable", STORE_UNAVAILABLE))
    data = run.finish(model_calls=10).as_dict()
    assert set(data) == set(FULL_FIELDS)
    assert data["reason"] == STORE_UNAVAILABLE and data["hit"] is False
    assert len(data["notes"]) == 1 and data["notes"][0].startswith("store unavailable, generating without reuse: ")
    assert "Connection refused" in data["notes"][0]
    assert (data["candidates"], data["filtered"], data["probes"], data["donor_id"]) == ([], {}, [], None)


def test_a_plain_run_reports_its_reason_as_its_note_unless_given_notes():
    data = RunReport.plain("balanced", "denoise mask (inpainting)", 10, 10, 3.0).as_dict()
    assert set(data) == set(FULL_FIELDS)
    assert data == {
        "hit": False, "verdict": "miss", "mode": "balanced", "prompt": "", "judged_by": "", "donor_id": None,
        "donor_prompt": None, "text_similarity": None,
        "agreement": None, "structure_agreement": None, "guidance_cosine": None, "skipped_steps": 0, "exact_repeat": False, "resumed_at": {},
        "total_steps": 10, "attention_density": None, "attention": {}, "heads_reuse": 0, "heads_own": 0,
        "model_calls": 10, "time_s": 3.0, "time_saved_s": 0.0, "reason": "denoise mask (inpainting)",
        "seed_miss": False, "probes": [],
        "candidates": [], "filtered": {}, "skipped_donors": {}, "notes": ["denoise mask (inpainting)"], "stage": {},
    }
    unavailable = RunReport.plain("fast", STORE_UNAVAILABLE, 8, 8, 1.0, ATTENTION_SUMMARY,
                                  ["store unavailable, generating without reuse: closed port"]).as_dict()
    assert set(unavailable) == set(FULL_FIELDS)
    assert unavailable["notes"] == ["store unavailable, generating without reuse: closed port"]
    assert (unavailable["attention"], unavailable["attention_density"], unavailable["heads_reuse"],
            unavailable["heads_own"]) == (ATTENTION_SUMMARY, 0.25, 3, 1)


def test_a_sparse_attention_only_run_reports_the_attention_fields_only():
    attention = SparseAttentionRun(settings=SparseAttentionSettings(source="borrowed", min_tokens=0), video_tokens=256,
                                   first_frame_tokens=64, num_layers=4, total_steps=10)
    data = RunReport.of_sparse_attention(attention, elapsed=1.5).as_dict()
    assert set(data) == set(ATTENTION_FIELDS)
    assert data == {
        "hit": False, "verdict": "miss", "mode": "attention/borrowed", "donor_id": None, "donor_prompt": None, "text_similarity": None,
        "agreement": None, "skipped_steps": 0, "total_steps": 10, "attention_density": None, "heads_reuse": 0,
        "heads_own": 0, "time_s": 1.5, "time_saved_s": 0.0, "reason": "no donor masks adopted",
        "attention": attention.summary(),
    }
    attention.inactive = "sparse attention inactive: attention is patched by sageattention"
    assert RunReport.of_sparse_attention(attention, 0.0).as_dict()["reason"] == attention.inactive
    attention.borrowed_sparse_calls = 4
    hit = RunReport.of_sparse_attention(attention, 0.0).as_dict()
    assert hit["hit"] is True and hit["verdict"] == "masks borrowed" and hit["reason"] == attention.inactive


def _report(**changes) -> RunReport:
    """A finished run as the engine reports it; `changes` say what it reused."""
    screen = ProbeRecord(donor_id="donor-1", donor_prompt="a red ball", step=0, passed=True, donor_given_up=False,
                         batched_with=0, confirms_deeper=True, signals=ProbeSignals(0.0, 0.99, 0.99, 0.93))
    return RunReport(**{"mode": "balanced", "total_steps": 30, "time_s": 2.0, "probes": [screen], **changes})


RESUMED = {"hit": True, "skipped_steps": 15, "donor_id": "donor-1", "donor_prompt": "a red ball",
           "structure_agreement": 0.99, "guidance_cosine": 0.93, "time_saved_s": 1.5}
# A skipped first stage resumes at the stage's length, so it also counts its steps as skipped.
STAGE_SKIPPED = {**RESUMED, "skipped_steps": 30, "time_saved_s": 3.0,
                 "stage": {"index": 0, "first_step": 0, "hands_over": True, "skipped_whole": True}}
MASKS = {"hit": True, "attention": {**ATTENTION_SUMMARY, "borrowed_sparse_calls": 4}}
MISS = {"reason": "probe rejected"}


@pytest.mark.parametrize(("changes", "verdict", "label"), [
    (RESUMED, Verdict.RESUMED, "HIT (resumed)"),
    (STAGE_SKIPPED, Verdict.STAGE_SKIPPED, "HIT (stage skipped)"),
    (MASKS, Verdict.MASKS_BORROWED, "HIT (masks)"),
    (MISS, Verdict.MISS, "MISS"),
])
def test_the_verdict_says_what_the_run_reused(changes, verdict, label):
    report = _report(**changes)
    assert report.verdict is verdict and report.verdict.label == label
    assert report.as_dict()["verdict"] == verdict.value
    assert report.verdict.skips_steps == (verdict in (Verdict.RESUMED, Verdict.STAGE_SKIPPED))


def test_a_handed_over_stage_that_sampled_is_judged_by_its_own_reuse():
    stage = {"index": 0, "first_step": 0, "hands_over": True, "skipped_whole": False}
    assert _report(**RESUMED, stage=stage).verdict is Verdict.RESUMED
    assert _report(**MISS, stage=stage).verdict is Verdict.MISS


def test_text_reads_the_verdict_the_donor_and_the_cost():
    assert _report(**RESUMED).text().splitlines() == [
        "HIT: resumed at step 15/30 from 'a red ball' (structure 0.990, guidance 0.930), ~1.5 s saved",
        "  mode balanced, 2.0 s, probes 1",
    ]
    assert _report(**STAGE_SKIPPED).text().splitlines()[0] == (
        "HIT: stage skipped (30/30 steps), output taken from 'a red ball' (structure 0.990, guidance 0.930), "
        "~3.0 s saved")
    assert _report(**{**RESUMED, "structure_agreement": None, "guidance_cosine": None}).headline().endswith(
        "from 'a red ball' (unverified), ~1.5 s saved")
    assert _report(**MASKS).text().splitlines() == [
        "HIT: attention masks borrowed",
        "  mode balanced, 2.0 s, probes 1",
        "  attention density 0.250, heads reuse/own 3/1",
    ]
    assert _report(**MISS).text().splitlines()[0] == "MISS: probe rejected"
    assert _report().headline() == "MISS: no reuse"


def test_text_lists_the_kernel_fallbacks():
    attention = {"density": 0.5, "heads_reuse": 2, "heads_own": 2, "kernel_fallbacks": ["triton: no GPU"]}
    assert _report(**MISS, attention=attention).text().splitlines()[2:] == [
        "  attention density 0.500, heads reuse/own 2/2", "  kernel fallback: triton: no GPU"]


@pytest.mark.parametrize("changes", [RESUMED, STAGE_SKIPPED, MASKS, MISS])
def test_the_json_rebuilds_the_same_report(changes):
    report = _report(**changes)
    rebuilt = RunReport.from_dict({**report.as_dict(), "prompt_id": "p", "node": "3"})  # as /history has it
    assert rebuilt.verdict is report.verdict and rebuilt.text() == report.text()
    assert rebuilt.as_dict() == report.as_dict()


def test_the_json_of_a_sparse_attention_only_run_rebuilds_it():
    attention = SparseAttentionRun(settings=SparseAttentionSettings(source="borrowed", min_tokens=0), video_tokens=256,
                                   first_frame_tokens=64, num_layers=4, total_steps=10)
    attention.borrowed_sparse_calls = 4
    data = RunReport.of_sparse_attention(attention, elapsed=1.5).as_dict()
    rebuilt = RunReport.from_dict(data)
    assert rebuilt.verdict is Verdict.MASKS_BORROWED and rebuilt.as_dict() == data


def test_a_partial_json_still_renders():
    assert RunReport.from_dict({}).text() == "MISS: no reuse\n  mode , 0.0 s, probes 0"
    partial = RunReport.from_dict({"hit": True, "skipped_steps": 4, "total_steps": 8, "donor_prompt": None,
                                   "attention_density": 0.4, "heads_reuse": 1, "heads_own": 3, "unknown": 1})
    assert partial.verdict is Verdict.RESUMED
    assert partial.text().splitlines() == ["HIT: resumed at step 4/8 from '' (unverified), ~0.0 s saved",
                                           "  mode , 0.0 s, probes 0", "  attention density 0.400, heads reuse/own 1/3"]


def test_a_prompt_of_several_runs_takes_the_most_reuse_any_got():
    assert Verdict.strongest([Verdict.MISS, Verdict.RESUMED, Verdict.MASKS_BORROWED]) is Verdict.RESUMED
    assert Verdict.strongest([Verdict.STAGE_SKIPPED, Verdict.MISS]) is Verdict.STAGE_SKIPPED
    assert Verdict.strongest([]) is Verdict.MISS

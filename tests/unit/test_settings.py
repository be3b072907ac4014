"""Reuse settings from node inputs, by what they make a run do: how deep each mode may resume and how many probes it
spends (a run's probe plan against a stored donor), the probe thresholds, the steps a run records, and the errors a
bad input gives. Expected figures are the ones the node reference documents (docs/nodes.md), not the settings' own
tables read back.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from carnator_core.judging.probe_signals import ProbeSignals
from carnator_core.lookup.compatible import Match
from carnator_core.lookup.shortlist import Candidate
from carnator_core.reuse.run import ReuseRun
from carnator_core.reuse.settings import INPUT_RANGES, ReuseSettings, input_range
from carnator_core.store.entry import CheckpointRecord, EntryMeta, HardKey
from carnator_core.store.reuse_store import IndexVectors, ReuseStore
from carnator_core.store.tensor_codec import encode_tensors

SHAPE = (1, 4, 2, 4, 4)
KEY = HardKey("model", (2, 2, 2), "schedule")
STEPS = 10  # the donor's and the request's schedule


def _donor(store: ReuseStore, noise: str = "noise") -> Candidate:
    """A stored 10-step donor with a checkpoint at every step (as a short schedule records), made from `noise`."""
    steps = range(1, STEPS)
    checkpoints = [CheckpointRecord(step=s, sigma=1 - s / STEPS) for s in steps]
    meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=KEY, prompt="donor", latent_shape=SHAPE,
                     noise_fingerprint=noise, total_steps=STEPS, checkpoints=checkpoints)
    tensors = {f"{kind}_{s}": torch.full(SHAPE, float(s)) for s in steps for kind in ("x", "x0")}
    store.put(meta, {"checkpoints": encode_tensors(tensors)},
              IndexVectors(text=None, cond=torch.nn.functional.normalize(torch.ones(64), dim=0)))
    return Candidate(entry_id=meta.entry_id, prompt="donor", score=1.0, cond_similarity=1.0, text_similarity=None)


def _plan(store: ReuseStore, donor: Candidate, **inputs) -> tuple[list[int], dict[str, int]]:
    """The donor steps a 10-step run with the node inputs `inputs` would probe, in order, and why it skipped donors."""
    run = ReuseRun(settings=ReuseSettings.from_inputs(**inputs), store=store, hard_key=KEY, latent_shape=SHAPE,
                   noise_fingerprint="noise", cond_vector=torch.ones(64),
                   sigmas=[1 - s / STEPS for s in range(STEPS + 1)], cfg=1.0, seed=0)
    targets = run.plan(Match(store_location="", request=None, candidates=[donor]))
    return [target.step for target in targets], run.skipped


# ------------------------------------------------------------------ modes: resume depth and probes
@pytest.mark.parametrize(("mode", "probed"), [
    ("safe", []),  # attention masks only: never resumes, so never probes
    ("balanced", [5, 4, 3]),  # up to half-way, the deepest first, three probe calls by default
    # up to 80 %: balanced's three, then every deeper state, asked only after a pass where balanced would resume
    ("fast", [8, 7, 6, 5, 4, 3]),
])
def test_each_mode_probes_the_documented_depths(store, mode, probed):
    assert _plan(store, _donor(store), mode=mode)[0] == probed


def test_inputs_left_out_plan_as_balanced_with_three_probes(store):
    donor = _donor(store)
    assert _plan(store, donor) == _plan(store, donor, mode="balanced", max_probes=3) == ([5, 4, 3], {})


@pytest.mark.parametrize(("mode", "max_probes", "probed"), [
    ("balanced", 16, [5, 4, 3, 2, 1]),  # every checkpoint within half-way, and never deeper
    ("fast", 16, [8, 7, 6, 5, 4, 3, 2, 1]),  # every checkpoint within 80 %
    ("fast", 1, [8, 7, 6, 5]),  # balanced's one, and what fast may climb to from it
    ("balanced", 0, []),  # no probe calls: no resume
])
def test_an_explicit_probe_budget_overrides_the_default(store, mode, max_probes, probed):
    assert _plan(store, _donor(store), mode=mode, max_probes=max_probes)[0] == probed


def test_the_seed_policy_decides_whether_a_donor_of_other_noise_is_probed(store):
    donor = _donor(store, noise="other noise")
    assert _plan(store, donor) == ([], {"other initial noise (seed)": 1})  # same-noise by default
    assert _plan(store, donor, seed_policy="serving") == ([5, 4, 3], {})


# ------------------------------------------------------------------ probe thresholds
def _passes(settings: ReuseSettings, depth: float, structure: float, guidance: float | None = None) -> bool:
    return settings.thresholds.passes(ProbeSignals(depth=depth, raw_agreement=structure,
                                                   structure_agreement=structure, guidance_cosine=guidance))


def test_default_thresholds_rise_with_depth_as_documented():
    """structure 0.85 and guidance 0.8 at depth 0, both 0.09 stricter per unit of depth."""
    settings = ReuseSettings.from_inputs()
    assert _passes(settings, 0.0, 0.851) and not _passes(settings, 0.0, 0.849)
    assert _passes(settings, 0.5, 0.896) and not _passes(settings, 0.5, 0.894)
    assert _passes(settings, 0.5, 1.0, guidance=0.846) and not _passes(settings, 0.5, 1.0, guidance=0.844)
    assert _passes(settings, 1.0, 0.941) and not _passes(settings, 1.0, 0.939)
    assert not _passes(settings, 0.0, float("nan"))


def test_threshold_inputs_override_the_defaults_and_depth_slope_sets_both_slopes():
    settings = ReuseSettings.from_inputs(structure_threshold=0.7, depth_slope=0.2)
    assert _passes(settings, 0.5, 0.81) and not _passes(settings, 0.5, 0.79)  # 0.7 + 0.2 x 0.5
    assert _passes(settings, 0.5, 1.0, guidance=0.91) and not _passes(settings, 0.5, 1.0, guidance=0.89)  # 0.8 + 0.1
    lenient = ReuseSettings.from_inputs(guidance_threshold=0.0, depth_slope=0.0)
    assert _passes(lenient, 0.8, 0.86, guidance=0.01) and not _passes(lenient, 0.8, 0.84, guidance=0.01)


# ------------------------------------------------------------------ recording
@pytest.mark.parametrize("steps", [1, 2, 4, 7, 8])
def test_few_step_schedules_record_every_step(steps):
    assert ReuseSettings().checkpoint_steps(steps) == list(range(steps))


def test_longer_schedules_record_at_the_fractions_and_step_zero():
    assert ReuseSettings().checkpoint_steps(30) == [0, 6, 10, 15, 20, 24]
    assert ReuseSettings().checkpoint_steps(9) == [0, 2, 3, 4, 6, 7]
    assert ReuseSettings(checkpoint_fractions=(0.5,)).checkpoint_steps(30) == [0, 15]


# ------------------------------------------------------------------ bad values
@pytest.mark.parametrize(("name", "value", "message"), [
    ("top_k", 0, "top_k must lie between 1 and 64, got 0"),
    ("top_k", 65, "top_k must lie between 1 and 64, got 65"),
    ("min_similarity", 1.5, "min_similarity must lie between -1.0 and 1.0, got 1.5"),
    ("max_probes", -1, "max_probes must lie between 0 and 16, got -1"),
    ("max_probes", 17, "max_probes must lie between 0 and 16, got 17"),
    ("structure_threshold", 1.01, "structure_threshold must lie between -1.0 and 1.0, got 1.01"),
    ("guidance_threshold", -2.0, "guidance_threshold must lie between -1.0 and 1.0, got -2.0"),
    ("depth_slope", math.nan, "depth_slope must lie between 0.0 and 1.0, got nan"),
    ("guidance_boost", 2.5, "guidance_boost must lie between 0.0 and 2.0, got 2.5"),
    ("guidance_boost_steps", 21, "guidance_boost_steps must lie between 0 and 20, got 21"),
    ("probe_batch", 17, "probe_batch must lie between 0 and 16, got 17"),
])
def test_a_value_outside_the_documented_range_is_refused_naming_input_range_and_value(name, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ReuseSettings.from_inputs(**{name: value})


@pytest.mark.parametrize("name", sorted(INPUT_RANGES))
def test_the_range_a_node_widget_offers_is_the_range_enforced(name):
    """`input_range` is what the node schemas offer: both edges are accepted, a step beyond either is refused."""
    offered = input_range(name)
    step = 1 if isinstance(offered["max"], int) else 0.01
    for edge in (offered["min"], offered["max"]):
        ReuseSettings.from_inputs(**{name: edge})
    for outside in (offered["min"] - step, offered["max"] + step):
        with pytest.raises(ValueError, match=f"^{name} must lie between"):
            ReuseSettings.from_inputs(**{name: outside})


@pytest.mark.parametrize(("name", "options"), [
    ("mode", ("safe", "balanced", "fast")),
    ("seed_policy", ("same-noise", "serving")),
    ("verification", ("model", "text-only")),
])
def test_an_unknown_choice_is_refused_listing_the_choices(name, options):
    with pytest.raises(ValueError, match=f"^{name} must be one of") as error:
        ReuseSettings.from_inputs(**{name: "sideways"})
    assert all(option in str(error.value) for option in options) and "'sideways'" in str(error.value)
    for option in options:
        assert getattr(ReuseSettings.from_inputs(**{name: option}), name) == option


def test_other_bad_settings_are_named():
    with pytest.raises(ValueError, match="checkpoint fractions must lie strictly between 0 and 1"):
        ReuseSettings(checkpoint_fractions=(0.0, 0.5))
    with pytest.raises(TypeError, match="no_such_input"):
        ReuseSettings.from_inputs(no_such_input=1)
    assert ReuseSettings.from_inputs(prompt=None).prompt == ""  # an unconnected optional prompt is no prompt

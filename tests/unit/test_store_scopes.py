"""Scopes and exact repeats below the host: a namespace outside the safe set is refused with where it was set, a
donor of another scope is neither searched nor counted, profiles are filed per scope, and an exact repeat whose
stored output is missing or damaged is passed over."""

from __future__ import annotations

import json

import pytest
import torch

from carnator_core.judging.calibration_profile import Profile, Score
from carnator_core.lookup.compatible import LookupRequest, find_compatible
from carnator_core.reuse.exact_repeat import EXACT, FINAL_TENSOR, find_exact, prediction_digest
from carnator_core.store import profiles
from carnator_core.store.entry import OTHER_SCOPE, EntryMeta, HardKey
from carnator_core.store.fleet_config import NAMESPACE_ENV, configured_namespace
from carnator_core.store.reuse_store import IndexVectors, ReuseStore
from carnator_core.store.scopes import ScopeError, scope_for
from carnator_core.store.stages import final_blob
from carnator_core.store.tensor_codec import encode_tensors

SHAPE = (1, 16, 2, 4, 4)
COND = torch.nn.functional.normalize(torch.ones(256), dim=0)


@pytest.mark.parametrize("namespace", ["team a", "../etc", "-leading", "x" * 65, "ünï", "a/b"])
def test_a_namespace_outside_the_safe_set_is_refused_naming_where_it_was_set(namespace, tmp_path):
    with pytest.raises(ScopeError, match=f"set in {NAMESPACE_ENV} is refused"):
        configured_namespace(str(tmp_path / "settings.json"), {NAMESPACE_ENV: namespace})
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"namespace": namespace}))
    with pytest.raises(ScopeError, match="settings.json is refused"):
        configured_namespace(str(settings), {})


def test_scopes_compose_namespace_and_user():
    assert configured_namespace("/nonexistent/settings.json", {NAMESPACE_ENV: "studio-1.eu"}) == "studio-1.eu"
    assert (scope_for("", None), scope_for("ns", None), scope_for("", "alice_1"), scope_for("ns", "bob")) == (
        "", "ns", "user:alice_1", "ns/user:bob")
    assert HardKey("m", (1,), "s", scope="user:a").mismatch(HardKey("m", (1,), "s", scope="user:b")) == OTHER_SCOPE
    assert HardKey("m", (1,), "s").mismatch(HardKey("m", (1,), "s", scope="user:b")) == OTHER_SCOPE


def _entry(store: ReuseStore, scope: str, prompt: str = "a red ball", blobs: dict | None = None,
           **extra) -> EntryMeta:
    meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=HardKey("model", (2, 2, 2), "schedule", scope=scope),
                     prompt=prompt, latent_shape=SHAPE, noise_fingerprint="noise", extra=dict(extra))
    blobs = blobs or {}
    store.put(meta, blobs, IndexVectors(text=None, cond=COND))
    return meta


def test_the_lookup_neither_searches_nor_counts_another_scope(tmp_path):
    store = ReuseStore(str(tmp_path / "store"))
    _entry(store, "user:alice")
    for _ in range(3):
        _entry(store, "user:bob")
    match = find_compatible(store, LookupRequest(HardKey("model", (2, 2, 2), "schedule", scope="user:alice"), COND),
                            top_k=5, min_similarity=0.0)
    assert len(match.candidates) == 1 and match.searched == 1 and match.filtered == {}
    nobody = find_compatible(store, LookupRequest(HardKey("model", (2, 2, 2), "schedule", scope="user:carol"), COND),
                             top_k=5, min_similarity=0.0)
    assert nobody.candidates == [] and nobody.searched == 0 and nobody.filtered == {}


def test_profiles_are_filed_and_read_per_scope(tmp_path):
    store = ReuseStore(str(tmp_path / "store"))
    base = Profile(model="a1b2c3", schedule="d4e5f6", name="wan",
                   thresholds={"structure": 0.7, "structure_slope": 0.03, "guidance": 0.5, "guidance_slope": 0.03},
                   held_back=Score(accepted=20, good=20, precision=1.0, recall=1.0), in_force=True, reason="in force")
    profiles.save_profile(store, base)
    profiles.save_profile(store, Profile(**{**base.__dict__, "scope": "user:alice", "name": "alice's"}))
    assert [p.name for p in profiles.stored_profiles(store, "user:alice")[0].values()] == ["alice's"]
    assert [p.name for p in profiles.stored_profiles(store, "")[0].values()] == ["wan"]
    assert profiles.stored_profiles(store, "user:bob")[0] == {}
    assert profiles.profile_for(store, "a1b2c3", "d4e5f6", 1.0, "user:bob") == (None, "")


def test_an_exact_repeat_whose_output_is_missing_or_damaged_is_passed_over(tmp_path):
    store = ReuseStore(str(tmp_path / "store"))
    output = torch.randn(SHAPE)
    first = prediction_digest(output)
    record = {EXACT: {"key": "k", "first": first}}
    good = _entry(store, "", blobs={final_blob(0): encode_tensors({FINAL_TENSOR: output})}, **record)
    missing = _entry(store, "", **record)
    damaged = _entry(store, "", blobs={final_blob(0): b"not safetensors"}, **record)
    nan = _entry(store, "", blobs={final_blob(0): encode_tensors({FINAL_TENSOR: torch.full(SHAPE, float("nan"))})},
                 **record)
    wrong = _entry(store, "", blobs={final_blob(0): encode_tensors({FINAL_TENSOR: torch.zeros(2, 2)})}, **record)
    for entry in (missing, damaged, nan, wrong):
        assert find_exact(store, [entry.entry_id], "k", SHAPE) is None
    found = find_exact(store, [missing.entry_id, damaged.entry_id, good.entry_id], "k", SHAPE)
    assert found is not None and found.entry.entry_id == good.entry_id and torch.equal(found.output, output)
    assert find_exact(store, [good.entry_id], "another key", SHAPE) is None
    assert prediction_digest(torch.tensor(3.0)) != prediction_digest(torch.tensor(3.0, dtype=torch.float64))

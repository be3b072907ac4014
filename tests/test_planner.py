"""The probe plan: which donor checkpoints get the limited probe budget, in which order."""

from __future__ import annotations

import torch

from carnator_core.entry import EntryMeta, HardKey
from carnator_core.planner import RequestFacts, plan_probes
from carnator_core.shortlist import Candidate
from carnator_core.store import IndexVectors, ReuseStore
from carnator_core.tensor_codec import encode_tensors

SHAPE = (1, 16, 2, 8, 8)
FACTS = RequestFacts(schedule="schedule", latent_shape=SHAPE, noise_fingerprint="noise", total_steps=10)


def _donor(store: ReuseStore, name: str, steps: list[int]) -> Candidate:
    meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=HardKey("model", (2, 4, 4), "schedule"), prompt=name,
                     latent_shape=SHAPE, noise_fingerprint="noise", total_steps=10,
                     checkpoints=[{"step": s, "sigma": 1 - s / 10, "guidance": False} for s in steps])
    tensors = {f"{kind}_{s}": torch.full(SHAPE, float(s)) for s in steps for kind in ("x", "x0")}
    store.put(meta, {"checkpoints": encode_tensors(tensors)},
              IndexVectors(text=None, cond=torch.nn.functional.normalize(torch.ones(256), dim=0)))
    return Candidate(entry_id=meta.entry_id, prompt=name, score=1.0, cond_similarity=1.0, text_similarity=None)


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

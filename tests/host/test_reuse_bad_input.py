"""Bad donors and aborted runs: clean misses, nothing written, nothing lost."""

from __future__ import annotations

import itertools

import pytest
import torch

from carnator_core.lookup.shortlist import Candidate
from carnator_core.reuse.plan import RequestFacts, plan_probes
from carnator_core.reuse.recording import entry_writer
from carnator_core.store.entry import CheckpointRecord, EntryMeta, HardKey
from carnator_core.store.reuse_store import IndexVectors, ReuseStore
from carnator_core.store.tensor_codec import encode_tensors

SHAPE = (1, 16, 2, 8, 8)
KEY = HardKey("model", (2, 4, 4), "schedule")
FACTS = RequestFacts(schedule="schedule", latent_shape=SHAPE, noise_fingerprint="noise", total_steps=10)


def _donor(store: ReuseStore, tensors: dict | None, **meta_changes) -> Candidate:
    fields = {"latent_shape": SHAPE, "noise_fingerprint": "noise", "total_steps": 10,
              "checkpoints": [CheckpointRecord(step=5, sigma=0.5)]}
    fields.update(meta_changes)
    meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=KEY, prompt="donor", **fields)
    blobs = {} if tensors is None else {"checkpoints": encode_tensors(tensors)}
    store.put(meta, blobs, IndexVectors(text=None, cond=torch.nn.functional.normalize(torch.ones(256), dim=0)))
    return Candidate(entry_id=meta.entry_id, prompt="donor", score=1.0, cond_similarity=1.0, text_similarity=None)


def _plan(store, candidate, same_noise_only=True):
    return plan_probes(store, [candidate], FACTS, max_fraction=0.5, same_noise_only=same_noise_only, max_probes=3)


@pytest.mark.parametrize(("case", "tensors", "meta_changes", "reason"), [
    ("missing blob", None, {}, "checkpoint blob missing or corrupt"),
    ("NaN", {"x_5": torch.full(SHAPE, float("nan")), "x0_5": torch.zeros(SHAPE)}, {},
     "checkpoint missing, of another shape, or NaN"),
    ("other shape in blob", {"x_5": torch.zeros(1, 16, 2, 4, 4), "x0_5": torch.zeros(1, 16, 2, 4, 4)}, {},
     "checkpoint missing, of another shape, or NaN"),
    ("other latent shape", {"x_5": torch.zeros(SHAPE), "x0_5": torch.zeros(SHAPE)}, {"latent_shape": (2, 16, 2, 8, 8)},
     "other latent shape (batch or size)"),
    ("other schedule", {"x_5": torch.zeros(SHAPE), "x0_5": torch.zeros(SHAPE)}, {"total_steps": 20},
     "other sigma schedule"),
    ("other noise", {"x_5": torch.zeros(SHAPE), "x0_5": torch.zeros(SHAPE)}, {"noise_fingerprint": "other"},
     "other initial noise (seed)"),
    ("too deep only", {"x_8": torch.zeros(SHAPE), "x0_8": torch.zeros(SHAPE)},
     {"checkpoints": [CheckpointRecord(step=8, sigma=0.2)]}, "no checkpoint within the mode's depth"),
])
def test_bad_donors_are_skipped_with_a_reason(tmp_path, case, tensors, meta_changes, reason):
    store = ReuseStore(str(tmp_path / "store"))
    targets, skipped = _plan(store, _donor(store, tensors, **meta_changes))
    assert targets == [] and skipped == {reason: 1}, case


def test_corrupt_checkpoint_blob_is_skipped(tmp_path):
    store = ReuseStore(str(tmp_path / "store"))
    candidate = _donor(store, {"x_5": torch.zeros(SHAPE), "x0_5": torch.zeros(SHAPE)})
    store.backend.set(f"blob/{candidate.entry_id}/checkpoints", b"torn")
    assert _plan(store, candidate)[1] == {"checkpoint blob missing or corrupt": 1}


def test_fp16_checkpoint_of_another_dtype_is_used_in_the_live_dtype(tmp_path):
    store = ReuseStore(str(tmp_path / "store"))
    candidate = _donor(store, {"x_5": torch.ones(SHAPE, dtype=torch.bfloat16), "x0_5": torch.zeros(SHAPE)})
    targets, _ = _plan(store, candidate)
    assert len(targets) == 1 and targets[0].step == 5  # the host casts to the live dtype and device


_stores = itertools.count()


def test_interrupted_run_writes_nothing(comfy, tiny_models):
    import comfy.model_management as mm
    from comfy.patcher_extension import WrappersMP

    store_path = f"stores/aborted-{next(_stores)}"
    store = comfy.call_node("CarnatorStore", path=store_path, size_limit_gb=1.0)[0]
    model = comfy.call_node("UNETLoader", unet_name=tiny_models["wan"].name, weight_dtype="default")[0]
    reusing = comfy.call_node("CarnatorReuse", model=model, store=store, prompt="a red ball", mode="balanced",
                              seed_policy="same-noise", top_k=4, min_similarity=0.5, max_probes=3,
                              structure_threshold=0.8, guidance_threshold=0.8, depth_slope=0.15, guidance_boost=0.0,
                              guidance_boost_steps=0, record=True, sparse_attention="borrowed", enter_recall=0.9,
                              exit_recall=0.75)[0].clone()
    calls = itertools.count()

    def interrupt_at_third_call(executor, *args, **kwargs):
        if next(calls) == 2:
            raise mm.InterruptProcessingException()
        return executor(*args, **kwargs)

    reusing.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "test-interrupt",
                                 interrupt_at_third_call)
    positive = comfy.call_node("HarnessTextConditioning", text="a red ball", family="wan")[0]
    latent = comfy.call_node("EmptyHunyuanLatentVideo", width=64, height=64, length=5, batch_size=1)[0]
    with pytest.raises(mm.InterruptProcessingException):
        comfy.call_node("KSampler", model=reusing, seed=0, steps=6, cfg=1.0, sampler_name="euler",
                        scheduler="simple", positive=positive, negative=positive, latent_image=latent, denoise=1.0)
    entry_writer().flush()
    assert store.totals()["entries"] == 0

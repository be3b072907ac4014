"""Semantic shortlist and compatibility lookup over a real store and the real MiniLM model."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from carnator_core.lookup.compatible import LookupRequest, find_compatible
from carnator_core.lookup.embeddings import condition_vector, text_embedder
from carnator_core.lookup.noise_process import NOISE_PROCESS, OTHER_PROCESS, NoiseProcess
from carnator_core.lookup.shortlist import ShortlistIndex
from carnator_core.store.entry import EntryMeta, HardKey
from carnator_core.store.reuse_store import IndexEntry, IndexVectors, ReuseStore

SUBJECTS = ["a golden retriever", "a red sports car", "an old fisherman", "a paper boat", "a hot air balloon",
            "a ballet dancer", "a steam locomotive", "a black cat", "a surfer", "a flock of pigeons"]
ACTIONS = ["running along", "drifting over", "waiting beside", "spinning above", "crossing",
           "resting near", "racing past", "circling", "jumping into", "sliding down"]
PLACES = ["a sandy beach at sunset", "a snowy mountain pass", "a neon-lit city street", "a quiet forest lake",
          "a crowded market square", "a desert canyon", "a foggy harbour at dawn", "a field of sunflowers",
          "a rainy train platform", "a frozen river"]
KEY = HardKey(model="model-a", grid=(5, 8, 8), schedule="schedule-a")


def encode(texts: list[str]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Sentence vectors and per-token conditioning (MiniLM tokens zero-padded to Wan's width) in one pass."""
    model = text_embedder().model()
    outputs = model.encode(texts, output_value=None, normalize_embeddings=True, show_progress_bar=False)
    sentences = torch.stack([o["sentence_embedding"].float().cpu() for o in outputs])
    # token rows of the prompt itself: a batch pads every prompt to its longest (attention_mask marks the padding)
    tokens = [o["token_embeddings"][o["attention_mask"].bool()].float().cpu() if "attention_mask" in o
              else o["token_embeddings"].float().cpu() for o in outputs]
    return sentences, [torch.nn.functional.pad(t, (0, 4096 - t.shape[-1], 0, 32 - t.shape[0])) for t in tokens]


def token_conditioning(texts: list[str]) -> list[torch.Tensor]:
    return encode(texts)[1]


@pytest.fixture(scope="module")
def thousand_prompt_store(tmp_path_factory) -> tuple[ReuseStore, list[str]]:
    store = ReuseStore(str(tmp_path_factory.mktemp("lookup") / "store"))
    prompts = [f"{s} {a} {p}" for s, a, p in itertools.product(SUBJECTS, ACTIONS, PLACES)]
    texts, conds = encode(prompts)
    assert torch.allclose(texts[:2], text_embedder().embed(prompts[:2]), atol=1e-5)  # same as the production path
    for prompt, text, cond in zip(prompts, texts, conds, strict=True):
        meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=KEY, prompt=prompt)
        store.put(meta, {}, IndexVectors(text=text, cond=condition_vector(cond)))
    return store, prompts


@pytest.mark.parametrize(("stored", "paraphrase"), [
    ("a golden retriever running along a sandy beach at sunset",
     "a golden retriever dog jogging on the sand of a beach during sunset"),
    ("a steam locomotive crossing a frozen river", "an old steam train going across an icy river"),
    ("a black cat resting near a quiet forest lake", "a dark kitten lying down beside a calm lake in the woods"),
])
def test_paraphrase_ranks_first_among_a_thousand(thousand_prompt_store, stored, paraphrase):
    store, prompts = thousand_prompt_store
    assert stored in prompts
    request = LookupRequest(hard_key=KEY, cond_vector=condition_vector(token_conditioning([paraphrase])[0]),
                            prompt=paraphrase, text_vector=text_embedder().embed([paraphrase])[0])
    match = find_compatible(store, request, top_k=5, min_similarity=0.0)
    assert match.searched == 1000
    assert match.best.prompt == stored, match.report()


def test_lookup_without_text_uses_conditioning_alone(thousand_prompt_store):
    store, _ = thousand_prompt_store
    stored = "a paper boat drifting over a rainy train platform"
    request = LookupRequest(hard_key=KEY, cond_vector=condition_vector(token_conditioning([stored])[0]))
    match = find_compatible(store, request, top_k=3, min_similarity=0.0)
    assert match.best.prompt == stored
    assert match.best.text_similarity is None


def test_hard_compatibility_filters_and_explains(thousand_prompt_store):
    store, _ = thousand_prompt_store
    cond = condition_vector(token_conditioning(["a surfer circling a desert canyon"])[0])
    for key, reason in [(HardKey("model-b", KEY.grid, KEY.schedule), "other model"),
                        (HardKey(KEY.model, (9, 8, 8), KEY.schedule), "other token grid"),
                        (HardKey(KEY.model, KEY.grid, KEY.schedule, frame_rate=24.0), "other frame rate")]:
        match = find_compatible(store, LookupRequest(hard_key=key, cond_vector=cond), top_k=3, min_similarity=0.0)
        assert match.candidates == []
        assert match.filtered == {reason: 1000}
        assert f"filtered: 1000 with {reason}" in match.report()
    for schedule in ("", "schedule-b"):  # not known yet at lookup time, or another: the planner places its states
        other = HardKey(KEY.model, KEY.grid, schedule)
        assert find_compatible(store, LookupRequest(hard_key=other, cond_vector=cond), 3, 0.0).candidates


def _flow(multiplier: float = 1000.0) -> NoiseProcess:
    return NoiseProcess(kind="ModelSamplingDiscreteFlow+CONST", timestep_of=lambda sigmas: [s * multiplier
                                                                                             for s in sigmas])


def test_a_donor_of_another_noise_process_is_filtered_and_named(tmp_path):
    """Donors that recorded their noise process are candidates of any schedule of the same process only: another
    sampling kind, or another σ-to-timestep mapping checked on the donor's own sigmas, is filtered with its reason."""
    store = ReuseStore(str(tmp_path / "store"))
    prompt = "a paper boat drifting over a rainy train platform"
    cond = condition_vector(token_conditioning([prompt])[0])
    for steps in (8, 24):
        sigmas = [1.0 - step / steps for step in range(steps + 1)]
        meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=HardKey(KEY.model, KEY.grid, f"schedule-{steps}"),
                         prompt=prompt, total_steps=steps, extra={NOISE_PROCESS: _flow().record(sigmas)})
        store.put(meta, {}, IndexVectors(text=None, cond=cond))
    same = LookupRequest(hard_key=HardKey(KEY.model, KEY.grid, "schedule-30"), cond_vector=cond,
                         noise_process=_flow())
    assert len(find_compatible(store, same, 3, 0.0).candidates) == 2
    eps = NoiseProcess(kind="ModelSamplingDiscrete+EPS", timestep_of=lambda sigmas: [999.0 for _ in sigmas])
    for process in (eps, _flow(multiplier=999.0)):
        match = find_compatible(store, replace(same, noise_process=process), 3, 0.0)
        assert match.candidates == [] and match.filtered == {OTHER_PROCESS: 2}
        assert f"filtered: 2 with {OTHER_PROCESS}" in match.report()


def test_min_similarity_drops_weak_candidates(thousand_prompt_store):
    store, _ = thousand_prompt_store
    cond = condition_vector(token_conditioning(["quantum chromodynamics lecture notes"])[0])
    text = text_embedder().embed(["quantum chromodynamics lecture notes"])[0]
    match = find_compatible(store, LookupRequest(KEY, cond, "quantum chromodynamics lecture notes", text), 3, 0.95)
    assert match.candidates == []
    assert match.filtered["below min similarity"] == 1000


def test_index_follows_the_store_incrementally_and_drops_deleted_entries(tmp_path):
    store = ReuseStore(str(tmp_path / "store"))
    index = ShortlistIndex()
    vectors = [torch.nn.functional.normalize(torch.randn(256), dim=0) for _ in range(3)]
    ids = []
    for vector in vectors:
        meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=KEY)
        store.put(meta, {}, IndexVectors(text=None, cond=vector))
        ids.append(meta.entry_id)
    assert index.refresh(store) == 3
    assert index.refresh(store) == 0
    other_process_view = ReuseStore(str(tmp_path / "store"))
    other_process_view.delete(ids[0])
    request = LookupRequest(hard_key=KEY, cond_vector=vectors[0])
    match = find_compatible(store, request, top_k=3, min_similarity=-1.0)
    assert ids[0] not in [c.entry_id for c in match.candidates]
    assert len(match.candidates) == 2


def test_inverted_file_index_keeps_paraphrases_first(thousand_prompt_store):
    """Lists of 32 rows, 150 rows probed: a query scores a sixth of the store and still finds the paraphrase."""
    store, prompts = thousand_prompt_store
    index = ShortlistIndex(list_size=32, probe_rows=150)
    assert index.refresh(store) == 1000
    pairs = [("an old fisherman waiting beside a foggy harbour at dawn",
              "an elderly fisherman waits by a misty harbor at dawn"),
             ("a golden retriever running along a sandy beach at sunset",
              "a golden retriever dog jogging on the sand of a beach during sunset"),
             ("a steam locomotive crossing a frozen river", "an old steam train going across an icy river"),
             ("a black cat resting near a quiet forest lake", "a dark kitten lying down beside a calm lake in the woods")]
    texts, conds = encode([paraphrase for _, paraphrase in pairs])
    for (stored, _), text, cond in zip(pairs, texts, conds, strict=True):
        result = index.query(KEY, condition_vector(cond), text, top_k=3, min_similarity=0.0)
        assert result.candidates[0].prompt == stored
        assert result.searched == 1000 and 700 < result.filtered["outside the probed index lists"] < 900
    removed = result.candidates[0].entry_id
    index.remove(removed)
    again = index.query(KEY, condition_vector(conds[-1]), None, top_k=3, min_similarity=0.0)
    assert removed not in [c.entry_id for c in again.candidates] and again.searched == 999


def test_same_noise_donors_are_ranked_without_the_similarity_floor(tmp_path):
    """Donors made from the request's initial noise reach the model's step-0 screen whatever their similarity (it
    costs no call); other donors still need `min_similarity`. 10k same-noise entries: the list stays bounded."""
    store = ReuseStore(str(tmp_path / "store"))
    scene = "a purple triangle moving right on a gray background"
    reworded = "a violet wedge drifting to the right over grey"
    texts, conds = encode([scene, reworded, "a green square moving up on a white background"])
    for prompt, noise, index in ((scene, "noise-a", 0), ("unrelated, other seed", "noise-b", 2)):
        meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=KEY, prompt=prompt, noise_fingerprint=noise)
        store.put(meta, {}, IndexVectors(text=texts[index], cond=condition_vector(conds[index])))
    request = LookupRequest(hard_key=KEY, cond_vector=condition_vector(conds[1]), prompt=reworded,
                            text_vector=texts[1], noise="noise-a")
    floor_only = find_compatible(store, request, top_k=4, min_similarity=0.9)
    assert floor_only.candidates == [] and floor_only.filtered["below min similarity"] == 2
    match = find_compatible(store, request, top_k=4, min_similarity=0.9, same_noise_limit=16)
    assert [(c.prompt, c.same_noise) for c in match.candidates] == [(scene, True)]
    assert match.candidates[0].score < 0.9 and match.filtered["below min similarity"] == 1

    index = ShortlistIndex()
    generator = torch.Generator().manual_seed(0)

    index.add_many([IndexEntry(f"e{i}", KEY, f"p{i}", IndexVectors(text=None, cond=torch.randn(64, generator=generator)),
                               "noise-a") for i in range(10_000)])
    result = index.query(KEY, torch.randn(64, generator=generator), None, top_k=4, min_similarity=0.99,
                         noise="noise-a", same_noise_limit=16)
    assert len(result.candidates) == 16 and all(c.same_noise for c in result.candidates)
    scores = [c.score for c in result.candidates]
    assert scores == sorted(scores, reverse=True)
    index.remove(result.candidates[0].entry_id)
    again = index.query(KEY, torch.randn(64, generator=generator), None, top_k=4, min_similarity=0.99,
                        noise="noise-a", same_noise_limit=16)
    assert result.candidates[0].entry_id not in [c.entry_id for c in again.candidates]

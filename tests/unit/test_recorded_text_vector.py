"""The prompt is embedded once per request: the entry a run records carries the text vector its lookup used."""

from __future__ import annotations

import torch

from carnator_core.lookup.compatible import LookupRequest, Match, embed_prompt
from carnator_core.lookup.embeddings import text_embedder
from carnator_core.lookup.prompt_vectors import prompt_vectors
from carnator_core.reuse.recording import PendingEntry, entry_writer
from carnator_core.reuse.run import ReuseRun
from carnator_core.reuse.settings import ReuseSettings
from carnator_core.store.entry import EntryMeta, HardKey
from carnator_core.store.reuse_store import ReuseStore

KEY = HardKey("model", (2, 4, 4), "schedule")
SHAPE = (1, 16, 2, 8, 8)
PROMPT = "a red ball rolls left"


def _unit(seed: int) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(384, generator=torch.Generator().manual_seed(seed)), dim=0)


def _run(store: ReuseStore, prompt: str = PROMPT) -> ReuseRun:
    return ReuseRun(settings=ReuseSettings(prompt=prompt), store=store, hard_key=KEY, latent_shape=SHAPE,
                    noise_fingerprint="noise", cond_vector=_unit(0), sigmas=[1 - s / 10 for s in range(11)], cfg=1.0,
                    seed=0)


def _as_stored(vector: torch.Tensor) -> torch.Tensor:
    """The store keeps index vectors in fp16."""
    return vector.float().half()


def _recorded(store: ReuseStore, run: ReuseRun) -> torch.Tensor | None:
    run.finish(model_calls=10)
    assert entry_writer().flush()
    [entry_id] = list(store.entry_ids())
    return store.get_vectors(entry_id).text


def test_the_lookup_vector_is_recorded(tmp_path):
    store = ReuseStore(str(tmp_path / "store"))
    run = _run(store)
    run.plan()
    assert torch.equal(run.text_vector, embed_prompt(PROMPT)[0])
    assert torch.equal(_recorded(store, run), _as_stored(run.text_vector))


def test_a_lookup_nodes_vector_is_recorded_when_made_for_this_prompt(tmp_path):
    given = _unit(1)  # no embedding of any text: shows the writer took it as it was
    for prompt, expected in ((PROMPT, given), ("another prompt", None)):
        store = ReuseStore(str(tmp_path / prompt))
        request = LookupRequest(hard_key=KEY, cond_vector=_unit(0), prompt=prompt, text_vector=given)
        run = _run(store)
        run.plan(Match(store_location=store.location, request=request, candidates=[]))
        assert run.text_vector is expected
        recorded = _recorded(store, run)
        # a match made for another prompt: the writer takes this run's prompt's vector where lookups take it
        assert torch.equal(recorded, _as_stored(given if expected is not None else prompt_vectors().vector(PROMPT)))
        if expected is None:
            assert torch.allclose(recorded.float(), text_embedder().embed([PROMPT])[0], rtol=0, atol=2e-3)


def test_the_writer_embeds_the_prompt_when_no_vector_comes_with_the_entry(tmp_path):
    store = ReuseStore(str(tmp_path / "store"))
    for text_vector in (_unit(2), None):
        meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=KEY, prompt=PROMPT, latent_shape=SHAPE,
                         noise_fingerprint="noise", total_steps=10)
        entry_writer().submit(PendingEntry(store=store, meta=meta, blobs={}, cond_vector=_unit(0),
                                           text_vector=text_vector))
        assert entry_writer().flush()
        expected = text_vector if text_vector is not None else prompt_vectors().vector(PROMPT)
        assert torch.equal(store.get_vectors(meta.entry_id).text, _as_stored(expected))
        assert torch.allclose(store.get_vectors(meta.entry_id).text.float(), expected, rtol=0, atol=2e-3)

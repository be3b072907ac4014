"""Prompt vectors are embedded once per text, ahead of the lookup when the prompt was queued ahead, and are the
vectors the text model gives: the cache changes when a vector is computed, never what it is."""

from __future__ import annotations

import threading

import torch

from carnator_core.lookup.compatible import embed_prompt
from carnator_core.lookup.embeddings import text_embedder
from carnator_core.lookup.prompt_vectors import PromptVectors, prompt_vectors

PROMPTS = ("a red ball rolls left on a black background", "a small red ball drifting leftwards over black")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same text model's vector of the same text: equal up to the rounding of another thread's matrix products."""
    return a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-5)


def test_a_prefetched_vector_is_the_text_models_and_is_embedded_once():
    vectors = PromptVectors()
    vectors.prefetch(PROMPTS)
    first = vectors.vector(PROMPTS[0])
    assert _same(first, text_embedder().embed([PROMPTS[0]])[0])
    assert abs(float(first.norm()) - 1.0) < 1e-5
    # asked again (a new seed, a re-queued prompt): the same vector, not a new embedding
    assert vectors.vector(PROMPTS[0]) is first
    assert vectors.vector(PROMPTS[1]) is vectors.vector(PROMPTS[1])


def test_a_text_never_queued_is_embedded_when_asked():
    vectors = PromptVectors()
    vector = vectors.vector(PROMPTS[1])
    assert _same(vector, text_embedder().embed([PROMPTS[1]])[0])


def test_empty_and_non_text_prompts_start_nothing():
    vectors = PromptVectors()
    vectors.prefetch(["", "   ", None, 3])
    assert vectors._executor is None


def test_the_oldest_texts_leave_a_full_cache():
    vectors = PromptVectors(capacity=2)
    kept = [vectors.vector(text) for text in ("one", "two")]
    vectors.vector("three")
    assert vectors.vector("two") is kept[1]
    assert vectors.vector("one") is not kept[0]  # embedded again: it had left
    assert _same(vectors.vector("one"), kept[0])


def test_another_text_model_setting_never_serves_this_ones_vectors(monkeypatch):
    vectors = PromptVectors()
    before = vectors.vector(PROMPTS[0])
    # a setting that does not load falls back to the packaged model: same numbers, but its own cache key
    monkeypatch.setenv("CARNATOR_TEXT_MODEL", "/nonexistent/text-model")
    after = vectors.vector(PROMPTS[0])
    assert after is not before and _same(after, before)


def test_threads_asking_at_once_all_get_the_one_vector():
    vectors = PromptVectors()
    vectors.prefetch([PROMPTS[0]])
    results: list[torch.Tensor] = []
    threads = [threading.Thread(target=lambda: results.append(vectors.vector(PROMPTS[0]))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(result is results[0] for result in results)


def test_the_lookup_takes_the_prefetched_vector():
    prompt = "a green triangle rising on a white background, queued ahead"
    prompt_vectors().prefetch([prompt])
    vector, note = embed_prompt(prompt)
    assert note is None and vector is prompt_vectors().vector(prompt)

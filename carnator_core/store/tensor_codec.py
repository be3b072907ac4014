"""Tensors to and from safetensors bytes: the only binary format the store accepts.

safetensors cannot execute code on load (unlike pickle), and its header is validated
before any tensor is built, so a torn or hostile blob becomes a `CorruptBlobError`.
"""

from __future__ import annotations

import json

import torch
from safetensors import SafetensorError
from safetensors.torch import load as _load_safetensors
from safetensors.torch import save as _save_safetensors


class CorruptBlobError(ValueError):
    """A stored blob could not be decoded; the entry holding it is unusable."""


def encode_tensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """Serialise tensors (moved to CPU, made contiguous) as safetensors bytes."""
    prepared = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    return _save_safetensors(prepared, metadata=metadata)


def decode_metadata(blob: bytes) -> dict[str, str]:
    """The string metadata of safetensors bytes (the header's `__metadata__`) without decoding any tensor."""
    if not isinstance(blob, (bytes, bytearray)) or len(blob) < 8:
        raise CorruptBlobError("not a safetensors blob")
    length = int.from_bytes(blob[:8], "little")
    if length > len(blob) - 8:
        raise CorruptBlobError("safetensors header longer than the blob")
    try:
        metadata = json.loads(blob[8:8 + length]).get("__metadata__", {})
    except (ValueError, AttributeError) as error:
        raise CorruptBlobError(f"unreadable safetensors header: {error}") from error
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptBlobError("safetensors metadata must map strings to strings")
    return metadata


def decode_tensors(blob: bytes) -> dict[str, torch.Tensor]:
    """Decode safetensors bytes; any malformed input raises `CorruptBlobError`."""
    if not isinstance(blob, (bytes, bytearray)):
        raise CorruptBlobError(f"expected bytes, got {type(blob).__name__}")
    try:
        return _load_safetensors(bytes(blob))
    except (SafetensorError, ValueError, RuntimeError, OverflowError) as error:
        raise CorruptBlobError(f"not a valid safetensors blob: {error}") from error

"""Several latents packed into one, as a host samples LTX-2's video and audio together.

The sampler sees one `(B, 1, N)` tensor: each latent flattened per batch item and concatenated along the last axis,
in the order of their shapes (the host's `pack_latents`). A reuse run records and resumes the packed state as it is,
so a resume restores every part exactly; what differs per part is the judgement: the probe compares each part on
its own (`carnator_core.reuse.probe`), because the prompt describes the sound as well as the picture.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

PackedShapes = tuple[tuple[int, ...], ...]  # each packed latent's own shape, batch axis first


def packed_shapes(shapes: Sequence[Sequence[int]] | None) -> PackedShapes | None:
    """The shapes as plain int tuples; None for a single latent (nothing packed)."""
    if shapes is None or len(shapes) < 2:
        return None
    return tuple(tuple(int(v) for v in shape) for shape in shapes)


def packing_error(shapes: PackedShapes, packed: torch.Tensor) -> str:
    """Why `packed` is not these shapes packed ("" when it is)."""
    if packed.ndim != 3 or packed.shape[1] != 1:
        return f"packed latent of shape {tuple(packed.shape)} is not (batch, 1, length)"
    if any(len(shape) < 3 or shape[0] != packed.shape[0] for shape in shapes):
        return f"packed latent shapes {[list(s) for s in shapes]} do not match its batch of {packed.shape[0]}"
    total = sum(math.prod(shape[1:]) for shape in shapes)
    if total != packed.shape[-1]:
        return f"packed latent shapes {[list(s) for s in shapes]} add up to {total} values, not {packed.shape[-1]}"
    return ""


def unpack(packed: torch.Tensor, shapes: PackedShapes) -> list[torch.Tensor]:
    """Each latent of a packed tensor, in its own shape (views, no copy)."""
    parts, offset = [], 0
    for shape in shapes:
        size = math.prod(shape[1:])
        parts.append(packed[:, :, offset:offset + size].reshape(packed.shape[0], *shape[1:]))
        offset += size
    return parts

"""Masks for tests: a full mask, which the engine never builds (its masks come from estimates or donors)."""

from __future__ import annotations

import torch

from carnator_core.attention.masks import BlockSparseMask


def full_mask(n_tokens: int, block_size: int, heads: int = 1) -> BlockSparseMask:
    """Every block attended: sparse attention under this mask is dense attention, and its recall is exactly 1."""
    n = -(-n_tokens // block_size)
    return BlockSparseMask(torch.ones(1, heads, n, n, dtype=torch.bool), block_size, n_tokens)

"""The block layout every kernel reads: which key blocks each query block attends.

Rows are padded CSR: `kv_indices[b, h, i, :kv_counts[b, h, i]]` are the key blocks of query block `i`,
ascending; entries past the count are padding and never read. The leading two dimensions are either the
real batch/head counts or 1 (shared), so one layout can serve every head alike or give each head (and each
batch element, e.g. cond and uncond) its own density. Masks live in `carnator_core.attention.masks`; this module is
the neutral ground both sides import, because the kernels must not depend on the rest of the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class BlockLayout:
    kv_indices: torch.Tensor  # int32 (Bm, Hm, num_blocks, width)
    kv_counts: torch.Tensor  # int32 (Bm, Hm, num_blocks)
    block_size: int
    n_tokens: int
    # Per-kernel work plans derived from this layout (row order, groups), built on first use: a layout is
    # reused for every step and call of a layer, so planning once keeps index bookkeeping off the hot path.
    plans: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kv_indices.dim() != 4 or self.kv_counts.shape != self.kv_indices.shape[:3]:
            raise ValueError(
                f"kv_indices must be (Bm, Hm, nq, width) and kv_counts (Bm, Hm, nq); "
                f"got {tuple(self.kv_indices.shape)} and {tuple(self.kv_counts.shape)}"
            )
        if self.block_size <= 0 or self.n_tokens <= 0:
            raise ValueError(f"block_size and n_tokens must be positive, got {self.block_size}, {self.n_tokens}")
        if self.kv_indices.shape[2] != self.num_blocks:
            raise ValueError(f"{self.kv_indices.shape[2]} query blocks, expected {self.num_blocks}")

    @property
    def num_blocks(self) -> int:
        """Blocks per side; the last one is ragged when n_tokens is not a multiple of block_size."""
        return -(-self.n_tokens // self.block_size)

    @property
    def groups(self) -> tuple[int, int]:
        """(Bm, Hm): 1 where the layout is shared across the batch or the heads."""
        return self.kv_counts.shape[0], self.kv_counts.shape[1]

    @classmethod
    def from_dense(cls, blocks: torch.Tensor, block_size: int, n_tokens: int) -> BlockLayout:
        """Build from a boolean block mask (Bm, Hm, nq, nk); rows keep ascending key order."""
        if blocks.dim() != 4 or blocks.dtype != torch.bool or blocks.shape[2] != blocks.shape[3]:
            raise ValueError(f"expected a square boolean (Bm, Hm, n, n) block mask, got {blocks.dtype} {tuple(blocks.shape)}")
        counts = blocks.sum(-1, dtype=torch.int32)
        width = max(int(counts.max()), 1)
        # A stable sort of "not selected" puts the selected blocks first, each group in ascending order.
        order = torch.sort((~blocks).to(torch.uint8), dim=-1, stable=True).indices[..., :width]
        return cls(order.to(torch.int32).contiguous(), counts.contiguous(), block_size, n_tokens)

    def to_dense(self) -> torch.Tensor:
        """Boolean block mask (Bm, Hm, nq, nk)."""
        n = self.num_blocks
        valid = torch.arange(self.kv_indices.shape[-1], device=self.kv_indices.device) < self.kv_counts[..., None]
        dense = torch.zeros(*self.kv_counts.shape, n + 1, dtype=torch.bool, device=self.kv_indices.device)
        # Padding entries are routed to a spare column n and dropped.
        dense.scatter_(-1, torch.where(valid, self.kv_indices.long(), n), True)
        return dense[..., :n]

    def density(self) -> float:
        """Share of (query block, key block) pairs attended, over all rows of the layout."""
        return float(self.kv_counts.sum()) / (self.kv_counts.numel() * self.num_blocks)

    def fits(self, batch: int, heads: int, n_tokens: int) -> bool:
        """Whether this layout can drive attention over (batch, heads, n_tokens)."""
        groups_b, groups_h = self.groups
        return n_tokens == self.n_tokens and groups_b in (1, batch) and groups_h in (1, heads)

    def to(self, device: torch.device | str) -> BlockLayout:
        if self.kv_indices.device == torch.device(device):
            return self
        return BlockLayout(self.kv_indices.to(device), self.kv_counts.to(device), self.block_size, self.n_tokens)

    def expanded(self, batch: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, counts) broadcast to (batch, heads, ...) as views, without copying."""
        width = self.kv_indices.shape[-1]
        return (
            self.kv_indices.expand(batch, heads, self.num_blocks, width),
            self.kv_counts.expand(batch, heads, self.num_blocks),
        )

    @classmethod
    def full(cls, n_tokens: int, block_size: int, device: torch.device | str = "cpu") -> BlockLayout:
        """Every query block attends every key block: block-sparse attention then equals dense attention."""
        n = -(-n_tokens // block_size)
        return cls.from_dense(torch.ones(1, 1, n, n, dtype=torch.bool, device=device), block_size, n_tokens)

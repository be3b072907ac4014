"""Block-sparsity masks: estimated online from pooled Q·K, scored by recall, stored bit-packed.

A mask says, per (batch or shared, head, query block), which key blocks attention reads. It is estimated
from the live request (mean-pooled Q and K per block give a cheap block-level softmax, XAttention/
SpargeAttn style), borrowed from a donor, or both; `recall` measures how much of the live request's
estimated attention mass a (possibly borrowed) mask covers, which is what the hysteresis and
compatibility logic decide on. Everything is vectorised torch on (B, H, blocks, blocks) tensors, i.e.
(N / block_size)^2 per head: negligible next to attention itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

MASK_FORMAT = "carnator.block-mask.v1"


@dataclass(frozen=True)
class BlockSparseMask:
    blocks: torch.Tensor  # bool (Bm, Hm, nq, nk); Bm/Hm are the batch/heads or 1 when shared
    block_size: int
    n_tokens: int

    def __post_init__(self) -> None:
        blocks = self.blocks
        expected = -(-self.n_tokens // self.block_size) if self.block_size > 0 and self.n_tokens > 0 else -1
        if blocks.dtype != torch.bool or blocks.dim() != 4 or blocks.shape[2] != expected or blocks.shape[3] != expected:
            raise ValueError(
                f"blocks must be a boolean (Bm, Hm, {expected}, {expected}) tensor for {self.n_tokens} tokens "
                f"in blocks of {self.block_size}; got {blocks.dtype} {tuple(blocks.shape)}"
            )

    @property
    def grid(self) -> tuple[int, int, int, int]:
        """(Bm, Hm, query blocks, key blocks)."""
        return tuple(self.blocks.shape)  # type: ignore[return-value]

    def density(self) -> float:
        """Share of (query block, key block) pairs attended, over the whole mask."""
        return float(self.blocks.float().mean())

    def fits(self, batch: int, heads: int, n_tokens: int) -> bool:
        """Whether this mask applies to attention over (batch, heads, n_tokens); a borrowed mask that
        does not fit is a clean miss, never an error."""
        groups_b, groups_h = self.grid[:2]
        return n_tokens == self.n_tokens and groups_b in (1, batch) and groups_h in (1, heads)

    def to_bytes(self) -> tuple[bytes, dict]:
        """Bit-packed blocks (numpy packbits, row-major over `grid`) and JSON-able metadata."""
        bits = np.packbits(self.blocks.detach().cpu().numpy().reshape(-1))
        meta = {"format": MASK_FORMAT, "block_size": self.block_size, "n_tokens": self.n_tokens,
                "grid": list(self.grid)}
        return bits.tobytes(), meta

    @classmethod
    def from_bytes(cls, data: bytes, meta: dict) -> BlockSparseMask:
        """Inverse of `to_bytes`; malformed data or metadata raises ValueError."""
        if meta.get("format") != MASK_FORMAT:
            raise ValueError(f"unknown mask format {meta.get('format')!r}")
        grid = [int(x) for x in meta["grid"]]
        count = math.prod(grid)
        if len(grid) != 4 or len(data) != -(-count // 8):
            raise ValueError(f"{len(data)} bytes do not hold a mask of grid {grid}")
        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=count).astype(bool)
        return cls(torch.from_numpy(bits.reshape(grid)), int(meta["block_size"]), int(meta["n_tokens"]))


def pool_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mean over the tokens of each block, (B, H, N, D) -> float32 (B, H, blocks, D); the ragged last block
    averages only its real tokens. Reads strided views in place (no float32 copy of the input)."""
    n = x.shape[2]
    whole = n // block_size
    parts = []
    if whole:
        parts.append(x[:, :, : whole * block_size].unflatten(2, (whole, block_size)).mean(3, dtype=torch.float32))
    if n % block_size:
        parts.append(x[:, :, whole * block_size :].mean(2, keepdim=True, dtype=torch.float32))
    return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]


def estimate_block_mass(q: torch.Tensor, k: torch.Tensor, block_size: int, scale: float | None = None) -> torch.Tensor:
    """Estimated share of each query block's attention that falls on each key block, for q, k (B, H, N, D).

    Pooled queries score pooled keys; adding log(tokens in the key block) makes the block softmax
    approximate the sum of token probabilities. Returns float32 (B, H, nq, nk), rows summing to 1.
    """
    n = k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = pool_blocks(q, block_size) @ pool_blocks(k, block_size).transpose(-1, -2) * scale
    sizes = torch.full((logits.shape[-1],), float(block_size), device=logits.device)
    sizes[-1] = n - (logits.shape[-1] - 1) * block_size
    return torch.softmax(logits + sizes.log(), dim=-1)


def select_blocks(
    mass: torch.Tensor,
    n_tokens: int,
    block_size: int,
    tau: float,
    first_frame_tokens: int,
    min_density: float,
    max_density: float,
) -> BlockSparseMask:
    """Per query block, the smallest set of key blocks whose estimated mass reaches `tau`.

    The diagonal block and the blocks holding the first `first_frame_tokens` tokens are always kept
    (local detail and the attention-sink first frame that video DiTs lean on); they count toward `tau`.
    Beyond them each row keeps at least `min_density` and at most `max_density` of the key blocks, the
    floor guarding heads whose estimate is overconfident, the cap bounding cost. Rows whose estimate is not
    finite (NaN/inf inputs) stay dense. Average `mass` over the batch first to share one mask across it.
    """
    nq, nk = mass.shape[-2:]
    device = mass.device
    forced = torch.zeros(nq, nk, dtype=torch.bool, device=device)
    forced.fill_diagonal_(True)
    forced[:, : -(-first_frame_tokens // block_size)] = True
    forced = forced.expand_as(mass)
    finite = torch.isfinite(mass).all(-1, keepdim=True)
    clean = torch.where(finite, mass, 0.0)
    # Forced blocks sort first (mass <= 1 < 2), then the rest by estimated mass.
    order = torch.argsort(clean + 2.0 * forced, dim=-1, descending=True)
    ranked = clean.gather(-1, order)
    before = ranked.cumsum(-1) - ranked  # mass of the blocks ranked ahead of each one
    needed = (before < tau).sum(-1, keepdim=True)
    low, high = math.ceil(min_density * nk), max(math.floor(max_density * nk), 1)
    needed = needed.clamp(low, high).maximum(forced.sum(-1, keepdim=True))
    keep = torch.arange(nk, device=device) < needed
    blocks = torch.zeros_like(keep).scatter(-1, order, keep) | ~finite
    return BlockSparseMask(blocks, block_size, n_tokens)


def recall(mask: BlockSparseMask, estimate: torch.Tensor) -> torch.Tensor:
    """Share of the estimated attention mass that `mask` covers, per (batch, head): (B, H) in [0, 1].

    Exactly 1.0 for a full mask. Raises ValueError when the mask's grid does not match the estimate's
    (callers check `mask.fits` first and treat a mismatch as a miss).
    """
    groups_b, groups_h, nq, nk = mask.grid
    batch, heads, eq, ek = estimate.shape
    if (nq, nk) != (eq, ek) or groups_b not in (1, batch) or groups_h not in (1, heads):
        raise ValueError(f"mask grid {mask.grid} does not match estimate {tuple(estimate.shape)}")
    covered = (estimate * mask.blocks.to(estimate.device)).sum(dim=(-1, -2))
    return covered / estimate.sum(dim=(-1, -2))

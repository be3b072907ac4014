"""Mask estimation, recall and serialization on structured (video-like) and random inputs."""

from __future__ import annotations

import json
import math

import pytest
import torch
from support.masks import full_mask

from carnator_core.attention.masks import BlockSparseMask, estimate_block_mass, pool_blocks, recall, select_blocks
from carnator_core.attention.sparse_attention import SparseAttentionSettings, masks_from_blob, masks_to_blob
from carnator_core.kernels import BlockLayout, block_sparse_attention, reference_attention

BLOCK = 64
ENGINE = SparseAttentionSettings()  # the knobs a test leaves alone take the engine's defaults


def select(mass: torch.Tensor, n_tokens: int, first_frame_tokens: int = 0, **knobs) -> BlockSparseMask:
    """`select_blocks` in blocks of BLOCK under the engine's default tau and densities, `knobs` changed."""
    knobs = {"tau": ENGINE.tau, "min_density": ENGINE.min_density, "max_density": ENGINE.max_density, **knobs}
    return select_blocks(mass, n_tokens, BLOCK, first_frame_tokens=first_frame_tokens, **knobs)


def estimate_mask(q: torch.Tensor, k: torch.Tensor, first_frame_tokens: int = 0,
                  **knobs) -> tuple[BlockSparseMask, torch.Tensor]:
    """The online mask for q, k as the engine builds it, and the block mass estimate it came from."""
    mass = estimate_block_mass(q, k, BLOCK)
    return select(mass, k.shape[2], first_frame_tokens, **knobs), mass


def video_qk(frames: int, height: int, width: int, dim: int, heads: int, seed: int, sink: float = 1.0):
    """Tokens on a (frames, height, width) grid whose q·k falls off with distance (RoPE-like locality),
    plus a first-frame attention sink. Returns q, k (1, H, N, D) and the first-frame token count."""
    generator = torch.Generator().manual_seed(seed)
    grid = torch.meshgrid(torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")
    position = torch.stack(grid, -1).reshape(-1, 3).float()
    n = position.shape[0]
    freqs = torch.randn(heads, 3, dim // 2, generator=generator) * torch.tensor([0.3, 0.25, 0.25])[None, :, None]
    angle = torch.einsum("nc,hcd->hnd", position, freqs)
    embedding = torch.cat([angle.cos(), angle.sin()], -1) * 3
    q = embedding + 0.3 * torch.randn(heads, n, dim, generator=generator)
    k = embedding + 0.3 * torch.randn(heads, n, dim, generator=generator)
    direction = torch.nn.functional.normalize(torch.randn(heads, 1, dim, generator=generator), dim=-1) * dim**0.5
    q = q + 0.5 * sink * direction
    k[:, : height * width] += sink * direction
    return q[None], k[None], height * width


def partner_qk(blocks: int, dim: int, heads: int, seed: int, partners: int = 3):
    """Each query block attends a few random "partner" key blocks (content, not position, decides)."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(heads, blocks, dim, generator=generator)
    chosen = torch.stack([torch.randperm(blocks, generator=generator)[:partners] for _ in range(heads * blocks)])
    wanted = centres.gather(1, chosen.view(heads, -1, 1).expand(-1, -1, dim)).view(heads, blocks, partners, dim).sum(2)
    n = blocks * BLOCK
    q = 2 * wanted.repeat_interleave(BLOCK, 1) + 0.3 * torch.randn(heads, n, dim, generator=generator)
    k = 2 * centres.repeat_interleave(BLOCK, 1) + 0.3 * torch.randn(heads, n, dim, generator=generator)
    return q[None], k[None]


def true_coverage(q: torch.Tensor, k: torch.Tensor, mask: BlockSparseMask) -> torch.Tensor:
    """Per query token, the share of its exact softmax attention that falls in the mask: (B, H, N)."""
    n = q.shape[2]
    probs = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)
    tokens = mask.blocks.repeat_interleave(mask.block_size, 2).repeat_interleave(mask.block_size, 3)[:, :, :n, :n]
    return (probs * tokens).sum(-1)


@pytest.mark.parametrize("seed", [0, 1])
def test_estimated_mask_keeps_tau_of_true_mass_on_video_like_inputs(seed: int) -> None:
    q, k, first_frame = video_qk(8, 8, 16, 64, heads=4, seed=seed)
    mask, _ = estimate_mask(q, k, tau=0.9, first_frame_tokens=first_frame, min_density=0.0)
    assert mask.density() < 0.35, "the structure should make the mask sparse"
    coverage = true_coverage(q, k, mask).mean(-1)  # per head
    assert (coverage >= 0.9).all(), coverage


@pytest.mark.parametrize("seed", [0, 1])
def test_estimated_mask_keeps_tau_of_true_mass_on_content_structure(seed: int) -> None:
    q, k = partner_qk(24, 64, heads=4, seed=seed)
    mask, _ = estimate_mask(q, k, tau=0.9, min_density=0.0)
    assert mask.density() < 0.15
    assert (true_coverage(q, k, mask).mean(-1) >= 0.9).all()


def test_diagonal_and_first_frame_blocks_are_always_kept() -> None:
    mass = torch.zeros(1, 2, 10, 10)
    mass[..., 9] = 1.0  # the estimate puts everything on the last key block
    mask = select(mass, 10 * BLOCK - 7, first_frame_tokens=130, tau=0.9, min_density=0.0)
    blocks = mask.blocks[0, 0]
    assert blocks.diagonal().all() and blocks[:, :3].all() and blocks[:, 9].all()
    assert blocks.sum(-1).max() <= 5  # diagonal + 3 first-frame blocks + the one with the mass


def test_density_floor_and_cap() -> None:
    generator = torch.Generator().manual_seed(0)
    peaked = torch.softmax(torch.randn(1, 3, 20, 20, generator=generator) * 8, dim=-1)
    floored = select(peaked, 20 * BLOCK, tau=0.5, min_density=0.25)
    assert (floored.blocks.sum(-1) >= 5).all()
    flat = torch.full((1, 3, 20, 20), 1 / 20)
    capped = select(flat, 20 * BLOCK, tau=0.99, min_density=0.0, max_density=0.2)
    assert (capped.blocks.sum(-1) <= 4).all() and capped.blocks.diagonal(dim1=-2, dim2=-1).all()
    assert select(flat, 20 * BLOCK, tau=0.99, min_density=0.0).blocks.sum(-1).min() == 20


def test_higher_tau_keeps_a_superset() -> None:
    q, k = partner_qk(16, 64, heads=2, seed=3)
    mass = estimate_block_mass(q, k, BLOCK)
    loose = select(mass, q.shape[2], tau=0.6, min_density=0.0)
    tight = select(mass, q.shape[2], tau=0.97, min_density=0.0)
    assert (tight.blocks | loose.blocks).equal(tight.blocks) and tight.density() > loose.density()


def test_estimate_rows_are_distributions_and_ragged_blocks_pool_their_own_tokens() -> None:
    x = torch.randn(2, 3, 150, 32)
    pooled = pool_blocks(x, BLOCK)
    assert pooled.shape == (2, 3, 3, 32)
    assert torch.allclose(pooled[:, :, 2], x[:, :, 128:].mean(2), atol=1e-6)
    mass = estimate_block_mass(x, torch.randn(2, 3, 150, 32), BLOCK)
    assert torch.allclose(mass.sum(-1), torch.ones(2, 3, 3), atol=1e-6)


def test_non_finite_inputs_leave_rows_dense() -> None:
    q, k = partner_qk(8, 64, heads=2, seed=0)
    q[0, 1, 70] = float("nan")  # query block 1 of head 1
    mask, _ = estimate_mask(q, k, min_density=0.0)
    assert mask.blocks[0, 1, 1].all() and not mask.blocks[0, 0, 1].all()


def test_recall_of_full_mask_is_exactly_one() -> None:
    q, k = partner_qk(12, 64, heads=3, seed=1)
    mass = estimate_block_mass(q, k, BLOCK)
    assert torch.equal(recall(full_mask(q.shape[2], BLOCK, heads=3), mass), torch.ones(1, 3))


def test_recall_prefers_the_requests_own_mask_over_an_unrelated_one() -> None:
    q, k = partner_qk(16, 64, heads=2, seed=4)
    own, mass = estimate_mask(q, k, tau=0.9, min_density=0.0)
    other, _ = estimate_mask(*partner_qk(16, 64, heads=2, seed=5), tau=0.9, min_density=0.0)
    own_recall, other_recall = recall(own, mass), recall(other, mass)
    assert (own_recall >= 0.9).all() and (own_recall > other_recall + 0.3).all()


def test_recall_rejects_a_mismatched_grid() -> None:
    mass = torch.softmax(torch.randn(1, 2, 8, 8), -1)
    with pytest.raises(ValueError):
        recall(full_mask(10 * BLOCK, BLOCK), mass)
    assert not full_mask(10 * BLOCK, BLOCK).fits(1, 2, 8 * BLOCK)


@pytest.mark.parametrize("grid", [(1, 1, 1, 1), (1, 3, 7, 7), (2, 5, 13, 13)])
def test_serialization_round_trips_bit_exactly(grid: tuple[int, int, int, int]) -> None:
    blocks = torch.rand(grid, generator=torch.Generator().manual_seed(sum(grid))) < 0.3
    mask = BlockSparseMask(blocks, 128, grid[2] * 128 - 3)
    data, meta = mask.to_bytes()
    assert len(data) == math.ceil(blocks.numel() / 8)
    meta = json.loads(json.dumps(meta))
    restored = BlockSparseMask.from_bytes(data, meta)
    assert torch.equal(restored.blocks, blocks)
    assert (restored.block_size, restored.n_tokens, restored.grid) == (128, mask.n_tokens, grid)
    with pytest.raises(ValueError):
        BlockSparseMask.from_bytes(data + b"\0", meta)
    with pytest.raises(ValueError):
        BlockSparseMask.from_bytes(data, {**meta, "format": "other"})


def test_a_runs_masks_name_their_attention_and_masks_of_another_attention_are_none() -> None:
    masks = {layer: full_mask(4 * BLOCK, BLOCK) for layer in (1, 2)}
    meta, tensors = masks_to_blob(masks)
    meta = json.loads(json.dumps(meta))
    assert meta["attention"] == "video self-attention"
    assert {layer: mask.blocks.tolist() for layer, mask in masks_from_blob(meta, tensors).items()} == \
        {layer: mask.blocks.tolist() for layer, mask in masks.items()}
    assert masks_from_blob({**meta, "attention": "audio self-attention"}, tensors) == {}


def test_estimated_mask_drives_the_kernels() -> None:
    """mask -> layout -> sparse attention equals the reference under the same mask; density 1 = dense."""
    q, k, first_frame = video_qk(4, 8, 16, 64, heads=2, seed=2)
    v = torch.randn_like(q)
    mask, _ = estimate_mask(q, k, first_frame_tokens=first_frame)
    layout = BlockLayout.from_dense(mask.blocks, mask.block_size, mask.n_tokens)
    assert torch.equal(layout.to_dense(), mask.blocks)
    error = (block_sparse_attention(q, k, v, layout) - reference_attention(q, k, v, layout)).abs().max()
    assert error <= 1e-5
    full = BlockLayout.full(q.shape[2], BLOCK)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert (block_sparse_attention(q, k, v, full) - dense).abs().max() <= 1e-5

"""How sparse is the demo model's self-attention? (Sparsity reuse can only pay off where attention is sparse.)

Density at 90% mass: for every 16-token query block, the share of 16-token key blocks that must be kept, largest
first, to hold 90% of that query block's attention mass; averaged over query blocks, heads and the batch. Dense
attention is 1.0 (docs/demo-model.md has the demo model's figures).
"""

from __future__ import annotations

import math

import torch

from carnator_core.demo.wan_model import SelfAttention, WanT2V, apply_rope


@torch.no_grad()
def self_attention_probs(model: WanT2V, x: torch.Tensor, timestep: torch.Tensor,
                         context: torch.Tensor) -> list[torch.Tensor]:
    """Softmax attention maps [B, heads, L, L] of every block's self-attention for one forward pass."""
    maps: list[torch.Tensor] = []

    def capture(module: SelfAttention, args: tuple) -> None:
        tokens, rope = args
        q = apply_rope(module._heads(module.norm_q(module.q(tokens))), *rope).transpose(1, 2)
        k = apply_rope(module._heads(module.norm_k(module.k(tokens))), *rope).transpose(1, 2)
        maps.append(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1))

    handles = [block.self_attn.register_forward_pre_hook(capture) for block in model.blocks]
    try:
        model(x, timestep, context)
    finally:
        for handle in handles:
            handle.remove()
    return maps


def block_mass(probs: torch.Tensor, block: int = 16) -> torch.Tensor:
    """[B, H, L, L] attention -> [B, H, nq, nk]: each query block's share of attention per key block (rows sum
    to 1; a ragged last block counts its real rows only)."""
    length = probs.shape[-1]
    pad = (-length) % block
    probs = torch.nn.functional.pad(probs, (0, pad, 0, pad))
    n = probs.shape[-1] // block
    per_block = probs.unflatten(-1, (n, block)).sum(-1).unflatten(-2, (n, block)).sum(-2)
    rows = torch.tensor([min(block, length - i * block) for i in range(n)], dtype=probs.dtype)
    return per_block / rows.view(-1, 1)


def block_density(probs: torch.Tensor, block: int = 16, mass: float = 0.9) -> float:
    """Mean share of key blocks needed to cover `mass` of each query block's attention ([B, H, L, L] probs)."""
    share = block_mass(probs, block)
    n = share.shape[-1]
    cumulative = share.sort(dim=-1, descending=True).values.cumsum(-1)
    needed = (cumulative < mass - 1e-6).sum(-1) + 1
    return float((needed.float() / n).mean())

"""Dense reference of block-masked attention: the definition every fast path is tested against.

For each query block it takes exactly the key/value tokens of its key blocks and runs plain softmax
attention in float32 (float64 stays float64). Slow, meant for tests and error measurements. A query block
with no key block gets zeros. NaN/inf in attended tokens propagate as in dense attention; tokens outside
the mask are never read, as in the fast paths.
"""

from __future__ import annotations

import torch

from .layout import BlockLayout


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    scale: float | None = None,
    query_blocks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked attention over (B, H, N, D); with `query_blocks`, only the rows of those blocks.

    `query_blocks` (1-D block indices) keeps error checks on large N affordable: the result is then
    (B, H, rows, D), the rows of those blocks in the given order, cut at N in a ragged last block.
    """
    batch, heads, n, dim = q.shape
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = dim**-0.5 if scale is None else scale
    bs = layout.block_size
    blocks = layout.to(q.device).to_dense()  # (Bm, Hm, nq, nk)
    chosen = range(layout.num_blocks) if query_blocks is None else [int(i) for i in query_blocks]
    token_spans = [torch.arange(i * bs, min((i + 1) * bs, n), device=q.device) for i in range(layout.num_blocks)]
    out = []
    for i in chosen:
        rows = token_spans[i]
        per_head = torch.zeros(batch, heads, rows.numel(), dim, dtype=compute, device=q.device)
        for b in range(batch):
            for h in range(heads):
                key_blocks = blocks[min(b, blocks.shape[0] - 1), min(h, blocks.shape[1] - 1), i].nonzero()[:, 0]
                if key_blocks.numel() == 0:
                    continue
                cols = torch.cat([token_spans[j] for j in key_blocks.tolist()])
                scores = (q[b, h, rows].to(compute) @ k[b, h, cols].to(compute).T) * scale
                per_head[b, h] = torch.softmax(scores, dim=-1) @ v[b, h, cols].to(compute)
        out.append(per_head)
    return torch.cat(out, dim=2).to(q.dtype)

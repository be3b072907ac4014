"""Block-sparse attention in plain PyTorch, fast on CPU (and correct on any device).

Query blocks are grouped by how many key blocks they attend; each group is processed in chunks whose
gathered key/value blocks fit a cache-sized budget, so one dense batched attention call covers many
query blocks at once and no (query, key) expansion is ever materialised. Rows that attend the ragged last
block have it sorted last, so cutting the gathered keys at the true length removes the padding without a
mask. The cost is one gather of the attended K/V blocks (1/block_size of the attention FLOPs in bytes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.layout import BlockLayout

# Gathered K+V bytes per chunk: large enough for efficient batched GEMMs, small enough to stay in L2/L3.
CHUNK_BYTES = 4 << 20


def _blocked(x: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor:
    """(B, H, N, D) -> contiguous (B*H*num_blocks, block_size, D), zero-padded; a view when already so."""
    batch, heads, n, dim = x.shape
    padded = num_blocks * block_size
    if n == padded and x.is_contiguous():
        return x.view(batch * heads * num_blocks, block_size, dim)
    out = x.new_zeros(batch, heads, padded, dim) if n != padded else torch.empty_like(x, memory_format=torch.contiguous_format)
    out[:, :, :n] = x
    return out.view(batch * heads * num_blocks, block_size, dim)


def cpu_block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, scale: float | None = None
) -> torch.Tensor:
    """Attention over (B, H, N, D) restricted to `layout`; returns a new contiguous (B, H, N, D) tensor."""
    batch, heads, n, dim = q.shape
    bs, nb = layout.block_size, layout.num_blocks
    layout = layout.to(q.device)
    indices, counts = layout.expanded(batch, heads)
    rows_total = batch * heads * nb
    counts = counts.reshape(rows_total).long()
    width = indices.shape[-1]
    valid = torch.arange(width, device=q.device) < counts[:, None]
    # Ascending with padding (nb) last: the ragged last block, when attended, is each row's final entry.
    indices = torch.where(valid, indices.reshape(rows_total, width).long(), nb).sort(-1).values
    tail = n - (nb - 1) * bs  # tokens in the last block
    attends_last = (indices == nb - 1).any(-1) if tail < bs else torch.zeros_like(counts, dtype=torch.bool)
    # Global block ids into the blocked K/V: row r belongs to (b, h) = r // nb.
    indices += (torch.arange(rows_total, device=q.device) // nb * nb)[:, None]

    qb, kb, vb = (_blocked(x, bs, nb) for x in (q, k, v))
    out = torch.zeros_like(qb)
    group_key = counts * 2 + attends_last
    order = torch.argsort(group_key, stable=True)
    keys, sizes = torch.unique_consecutive(group_key[order], return_counts=True)
    start = 0
    for key, size in zip(keys.tolist(), sizes.tolist(), strict=True):
        rows = order[start : start + size]
        start += size
        count, last = key // 2, bool(key % 2)
        if count == 0:
            continue
        kv_len = count * bs - (bs - tail if last else 0)
        per_chunk = max(1, CHUNK_BYTES // (2 * count * bs * dim * q.element_size()))
        for begin in range(0, size, per_chunk):
            chunk = rows[begin : begin + per_chunk]
            m = chunk.numel()
            blocks = indices[chunk, :count].reshape(-1)
            keys_chunk = kb.index_select(0, blocks).view(m, 1, count * bs, dim)[:, :, :kv_len]
            values_chunk = vb.index_select(0, blocks).view(m, 1, count * bs, dim)[:, :, :kv_len]
            result = F.scaled_dot_product_attention(qb.index_select(0, chunk)[:, None], keys_chunk, values_chunk, scale=scale)
            out.index_copy_(0, chunk, result[:, 0])
    return out.view(batch, heads, nb * bs, dim)[:, :, :n]

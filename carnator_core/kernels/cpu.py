"""Block-sparse attention in plain PyTorch, fast on CPU.

Per query block, all its key blocks are gathered into one contiguous key sequence and attended with a
single softmax, so nothing needs merging. Query blocks with equally many key blocks share one batched
matrix product (`torch.bmm`, i.e. the BLAS GEMM: the fastest fp32 kernel a CPU has), and the softmax runs
in place on the score buffer, normalising after the second product (D columns instead of L). Chunks of
query blocks are sized so that scores and gathered keys/values stay cache-sized and the buffers are reused.

PyTorch's fused CPU flash attention over long key runs, with partial results merged by log-sum-exp, is
slower: a flash call over one query block runs below the kernel's peak, while the two GEMMs here run at dense
SDPA's throughput (`python -m carnator_core.bench attention` compares the paths; docs/measurements.md).

A ragged last block is always a query block's last key block (rows are ascending) and is cut at the true
token count. Query blocks with no key block stay zero; NaN/inf propagate as through dense attention.
bf16 inputs are computed in bf16 where the CPU has AMX tiles (a faster GEMM than fp32; the softmax
still accumulates in fp32 inside ATen), other half-precision inputs in fp32; results come back in the input's
dtype. Work plans (row order, groups, index lists) are cached on the layout, which a layer reuses for every
call until its mask changes: on short sequences planning costs as much as the attention.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from .layout import BlockLayout

# Bytes of each per-call buffer (scores, gathered keys, gathered values): large enough to amortise each GEMM,
# small enough to stay in cache.
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


def _sorted_rows(layout: BlockLayout, batch: int, heads: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B*H*nb, width) ascending global key block ids per query block (padding sorts last) and their counts.

    Query block r belongs to (batch, head) r // nb, whose key blocks start at global id (r // nb) * nb.
    """
    nb = layout.num_blocks
    indices, counts = layout.to(device).expanded(batch, heads)
    rows = batch * heads * nb
    counts = counts.reshape(rows).long()
    width = indices.shape[-1]
    valid = torch.arange(width, device=device) < counts[:, None]
    local = torch.where(valid, indices.reshape(rows, width).long(), nb).sort(-1).values
    return local + (torch.arange(rows, device=device) // nb * nb)[:, None], counts


@dataclass(frozen=True)
class _Chunk:
    """Query blocks attended by one pair of batched GEMMs: all have `blocks` key blocks (`tokens` real keys)."""

    rows: torch.Tensor
    key_blocks: torch.Tensor  # the rows' key block ids, flattened row by row
    blocks: int
    tokens: int
    span: slice | None  # the rows as a slice when consecutive, so queries and outputs need no index copies


@dataclass(frozen=True)
class _Plan:
    chunks: tuple[_Chunk, ...]
    empty_rows: torch.Tensor | None  # query blocks with no key block (their output is zero)
    buffer_elements: int


def _plan(layout: BlockLayout, batch: int, heads: int, dim: int, element: int, device: torch.device) -> _Plan:
    """Group query blocks by key-block count (and raggedness) into cache-sized chunks, once per layout."""
    key = ("cpu", batch, heads, dim, element, str(device))
    cached = layout.plans.get(key)
    if cached is not None:
        return cached
    bs, nb = layout.block_size, layout.num_blocks
    tail = layout.n_tokens - (nb - 1) * bs  # real tokens in the last block
    indices, counts = _sorted_rows(layout, batch, heads, device)
    last = indices.gather(1, (counts - 1).clamp(min=0)[:, None])[:, 0]
    ragged = (counts > 0) & (last % nb == nb - 1) & (tail < bs)
    kind = counts * 2 + ragged
    order = torch.argsort(kind, stable=True)
    kinds, sizes = torch.unique_consecutive(kind[order], return_counts=True)
    chunks = []
    for group, kind_value in zip(torch.split(order, sizes.tolist()), kinds.tolist(), strict=True):
        blocks = kind_value // 2
        if blocks == 0:
            continue
        tokens = blocks * bs - (bs - tail if kind_value % 2 else 0)
        per_call = max(1, CHUNK_BYTES // (element * blocks * bs * max(bs, dim)))
        for rows in torch.split(group, per_call):
            first = int(rows[0])
            consecutive = int(rows[-1]) - first == rows.numel() - 1
            chunks.append(_Chunk(rows, indices[rows, :blocks].reshape(-1), blocks, tokens,
                                 slice(first, first + rows.numel()) if consecutive else None))
    empty = torch.nonzero(counts == 0)[:, 0]
    plan = _Plan(tuple(chunks), empty if empty.numel() else None,
                 max(CHUNK_BYTES // element, int(counts.max()) * bs * max(bs, dim)))
    layout.plans[key] = plan
    return plan


def cpu_block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, scale: float | None = None
) -> torch.Tensor:
    """Attention over CPU (B, H, N, D) tensors restricted to `layout`; returns (B, H, N, D)."""
    batch, heads, n, dim = q.shape
    bs, nb = layout.block_size, layout.num_blocks
    compute = q.dtype if q.dtype in (torch.float32, torch.float64) or _fast_bfloat16(q.dtype) else torch.float32
    scale = dim**-0.5 if scale is None else scale
    qb, kb, vb = (_blocked(x.to(compute), bs, nb) for x in (q, k, v))
    plan = _plan(layout, batch, heads, dim, qb.element_size(), q.device)
    out = torch.empty_like(qb)
    if plan.empty_rows is not None:
        out[plan.empty_rows] = 0
    buffers = _Buffers.for_call(qb, plan.buffer_elements)
    for chunk in plan.chunks:
        _attend_rows(chunk, scale, qb, kb, vb, out, buffers)
    return out.to(q.dtype).view(batch, heads, nb * bs, dim)[:, :, :n]


class _Buffers:
    """Gathered keys, values and scores, reused by every chunk and by later calls in the same thread: fresh
    multi-MB allocations cost page faults on every call."""

    _local = threading.local()

    def __init__(self, like: torch.Tensor, elements: int) -> None:
        self.keys, self.values, self.scores = (like.new_empty(elements) for _ in range(3))

    @classmethod
    def for_call(cls, like: torch.Tensor, elements: int) -> _Buffers:
        cached: _Buffers | None = getattr(cls._local, "buffers", None)
        # inference tensors (ComfyUI samples under inference mode) cannot be written outside it
        if (cached is None or cached.keys.dtype != like.dtype or cached.keys.numel() < elements
                or cached.keys.is_inference() != torch.is_inference_mode_enabled()):
            cached = cls._local.buffers = cls(like, elements)
        return cached

    @staticmethod
    def take(buffer: torch.Tensor, *shape: int) -> torch.Tensor:
        return buffer[: math.prod(shape)].view(*shape)


def _attend_rows(chunk: _Chunk, scale: float, qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor,
                 out: torch.Tensor, buffers: _Buffers) -> None:
    """One chunk's query blocks, each over its key blocks, into `out`."""
    m, bs, dim = chunk.rows.numel(), qb.shape[1], qb.shape[2]
    blocks, tokens, span = chunk.blocks, chunk.tokens, chunk.span
    keys = torch.index_select(kb, 0, chunk.key_blocks, out=buffers.take(buffers.keys, m * blocks, bs, dim))
    values = torch.index_select(vb, 0, chunk.key_blocks, out=buffers.take(buffers.values, m * blocks, bs, dim))
    keys = keys.view(m, blocks * bs, dim)[:, :tokens]
    values = values.view(m, blocks * bs, dim)[:, :tokens]
    queries = qb[span] if span is not None else qb.index_select(0, chunk.rows)
    scores = buffers.take(buffers.scores, m, bs, tokens)
    torch.baddbmm(scores, queries, keys.transpose(1, 2), beta=0, alpha=scale, out=scores)
    _softmax_(scores)
    if span is not None:
        torch.bmm(scores, values, out=out[span])
    else:
        out.index_copy_(0, chunk.rows, torch.bmm(scores, values))


def _fast_bfloat16(dtype: torch.dtype) -> bool:
    """bf16 GEMMs beat fp32 on CPUs with AMX tiles; elsewhere bf16 is computed in fp32, which is faster than
    bf16 without them."""
    return dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported()


def _softmax_(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, in place: ATen's fused CPU kernel reads a row fully (its max) before
    writing it, so it may alias its output, unlike `torch.softmax`, which allocates."""
    return torch.ops.aten._softmax.out(scores, -1, False, out=scores)

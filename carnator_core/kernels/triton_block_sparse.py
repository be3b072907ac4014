"""FlashAttention-style block-sparse attention forward in Triton (CUDA; CPU only via TRITON_INTERPRET=1).

One program owns BLOCK_M query rows of one (batch, head) and walks only the key blocks its layout row
lists, in BLOCK_N-token tiles, with the online softmax (running max and sum, rescaled accumulator) in
float32. Inputs may be any strided (B, H, N, D) view with unit stride on D, so ComfyUI's (B, N, H*D)
tensors are read in place. Ragged last blocks are masked by token index. NaN/inf propagate as in dense
attention; a query block with no key block yields zeros.

Importing this module imports triton, so the dispatcher imports it lazily (only for CUDA tensors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import BlockLayout

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_BLOCK_SIZES = (64, 128)


@triton.jit
def _block_sparse_fwd(
    Q, K, V, Out, KvIndices, KvCounts,
    scale,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_ib, stride_ih, stride_iq,
    stride_cb, stride_ch, stride_cq,
    heads, n_tokens,
    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    # 64-bit offsets: one (B, H, N, D) tensor of a long video can exceed 2**31 elements.
    b = (pid_bh // heads).to(tl.int64)
    h = (pid_bh % heads).to(tl.int64)
    query_block = (pid_m * BLOCK_M) // BLOCK

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < n_tokens
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)

    count = tl.load(KvCounts + b * stride_cb + h * stride_ch + query_block * stride_cq)
    index_row = KvIndices + b * stride_ib + h * stride_ih + query_block * stride_iq
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh

    qk_scale = scale * 1.4426950408889634  # exp -> exp2
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for j in range(0, count):
        key_block = tl.load(index_row + j)
        for sub in tl.static_range(BLOCK // BLOCK_N):
            offs_n = key_block * BLOCK + sub * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = offs_n < n_tokens
            kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None], mask=col_ok[None, :], other=0.0)
            s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
            s = tl.where(col_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A tile that is entirely past N leaves m_new at -inf; subtract 0 then so exp2 gives 0, not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_safe)
            p = tl.math.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
            m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])


def triton_supports(q: torch.Tensor, layout: BlockLayout) -> str | None:
    """None when the kernel can run these inputs, else the reason it cannot."""
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype}"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"head dim {q.shape[-1]}"
    if layout.block_size not in SUPPORTED_BLOCK_SIZES:
        return f"block size {layout.block_size}"
    return None


def triton_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over (B, H, N, D) views restricted to `layout`, written into `out` (any (B, H, N, D) view)."""
    batch, heads, n, dim = q.shape
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    indices, counts = layout.to(q.device).expanded(batch, heads)
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    block_m = min(layout.block_size, 128 if dim <= 64 else 64)
    grid = (triton.cdiv(n, block_m), batch * heads)
    _block_sparse_fwd[grid](
        q, k, v, out, indices, counts,
        dim**-0.5 if scale is None else scale,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        indices.stride(0), indices.stride(1), indices.stride(2),
        counts.stride(0), counts.stride(1), counts.stride(2),
        heads, n,
        BLOCK=layout.block_size, BLOCK_M=block_m, BLOCK_N=64, HEAD_DIM=dim,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if dim <= 64 else 8, num_stages=2,
    )
    return out

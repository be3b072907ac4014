"""One entry point for block-sparse attention that picks the fastest correct path for the inputs.

- CUDA: our Triton kernel (fp16/bf16/fp32, head dim 64/128, blocks of 64/128).
- CPU: `cpu.py` (batched GEMMs over gathered key blocks). It is faster than compiled FlexAttention
  (`python -m carnator_core.bench attention --backend cpu|flex`) and needs no compiler, so
  FlexAttention is kept as an explicit `backend="flex"` only (it falls back to the CPU path itself).
- anything unsupported (cross-attention shapes, a layout for another token count, an integer dtype, a
  head dim the Triton kernel lacks, Triton missing): dense SDPA, with one log line per distinct reason.
  Never a wrong result.
- a kernel that fails to compile or launch, or disagrees with the masked reference, on its first call of a
  configuration (`guard.py`): dense SDPA for that configuration from then on, listed by `kernel_fallbacks()`.

Accepts ComfyUI's two conventions: (B, H, N, D), or (B, N, H*D) together with `heads`, returned alike.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from carnator_core import process_state

from .cpu import cpu_block_sparse_attention
from .flex import flex_block_sparse_attention
from .guard import KernelGuard
from .layout import BlockLayout

log = logging.getLogger("carnator.kernels")

BACKENDS = ("auto", "triton", "flex", "cpu", "dense")


def kernel_guard() -> KernelGuard:
    """The process's guard (`process_state`). Every sparse kernel call goes through it, so a kernel that cannot run
    on this machine costs speed only."""
    return process_state.one("kernel guard", KernelGuard)


def kernel_fallbacks() -> list[str]:
    """Kernel configurations of this process that failed their first-call check and run dense, with reasons."""
    return kernel_guard().fallbacks()


def _fall_back(reason: str) -> None:
    logged: set[str] = process_state.one("dense fallbacks logged", set)  # each reason is logged once per process
    if reason not in logged:
        logged.add(reason)
        log.warning("carnator: block-sparse attention unsupported (%s); using dense attention", reason)


def _unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout) -> str | None:
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        return f"q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} (only self-attention)"
    if not q.dtype.is_floating_point or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype}"
    batch, heads, n, _ = q.shape
    if not layout.fits(batch, heads, n):
        return f"layout for {layout.n_tokens} tokens and groups {layout.groups} vs input (B={batch}, H={heads}, N={n})"
    return None


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, scale: float | None,
         backend: str, out: torch.Tensor | None) -> torch.Tensor:
    """Sparse attention on (B, H, N, D) views; `out` is an optional (B, H, N, D) view to write into."""
    if backend == "auto":
        backend = "triton" if q.is_cuda else "cpu"
    if backend == "triton":
        try:
            from .triton_block_sparse import triton_block_sparse_attention, triton_supports
        except ImportError as error:
            _fall_back(f"Triton not importable: {error}")
            return F.scaled_dot_product_attention(q, k, v, scale=scale)
        reason = triton_supports(q, layout)
        if reason is None:
            guard = kernel_guard()
            return guard.run("triton", lambda *args: triton_block_sparse_attention(*args, out), q, k, v, layout, scale)
        _fall_back(f"Triton kernel: {reason}")
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    if backend == "flex":
        result = kernel_guard().run("flex", flex_block_sparse_attention, q, k, v, layout, scale)
        if result is not None:
            return result
        if q.is_cuda:
            _fall_back("FlexAttention cannot run these inputs")
            return F.scaled_dot_product_attention(q, k, v, scale=scale)
        backend = "cpu"
    if backend == "cpu":
        if q.device.type != "cpu":
            raise ValueError(f"backend 'cpu' needs CPU tensors, got {q.device}")
        return kernel_guard().run("cpu", cpu_block_sparse_attention, q, k, v, layout, scale)
    if backend == "dense":
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    *,
    heads: int | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Softmax attention where query block i sees only the key blocks `layout` lists for it.

    q, k, v: (B, H, N, D), or (B, N, H*D) with `heads` (ComfyUI's layout when skip_reshape is False); the
    result has the input's layout. `scale` defaults to 1/sqrt(D), like SDPA. `backend` forces a path
    (benchmarks and tests); "auto" is the fast one for the device.
    """
    packed = heads is not None and q.dim() == 3
    if packed:
        batch, n, width = q.shape
        split = [x.view(x.shape[0], x.shape[1], heads, -1).transpose(1, 2) for x in (q, k, v)]
        q4, k4, v4 = split
    else:
        q4, k4, v4 = q, k, v
    reason = _unsupported(q4, k4, v4, layout)
    if reason is not None:
        _fall_back(reason)
        result = F.scaled_dot_product_attention(q4, k4, v4, scale=scale)
    else:
        # On CUDA the Triton kernel writes (B, N, H, D) directly, so packed output needs no extra copy.
        out = None
        if packed and q.is_cuda:
            out = torch.empty(batch, n, heads, width // heads, dtype=q.dtype, device=q.device).transpose(1, 2)
        result = _run(q4, k4, v4, layout, scale, backend, out)
    if packed:
        return result.transpose(1, 2).reshape(batch, n, width)
    return result

"""Block-sparse attention through PyTorch's FlexAttention, compiled by torch.compile.

FlexAttention iterates only the listed key blocks (a `BlockMask` built straight from our CSR layout), on
CPU through Inductor's C++ template and on CUDA through generated Triton. Compilation costs tens of
seconds on first use per shape and needs a working C++ compiler (CPU) or Triton (CUDA); when it fails,
`flex_available()` turns False for the process and callers use another path.

Blocks are passed as "partial" blocks with a no-op mask_mod: Inductor's CPU template in torch 2.14 emits
code that does not compile for "full" blocks, and a no-op mask costs nothing measurable.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from carnator_core import process_state

from .layout import BlockLayout

log = logging.getLogger("carnator.kernels")


@dataclass
class FlexCompilation:
    """FlexAttention as this process compiled it (`compiled`), or why it cannot run here (`broken`)."""

    compiled: Callable | None = None
    broken: str | None = None


def _compilation() -> FlexCompilation:
    return process_state.one("FlexAttention compilation", FlexCompilation)


def flex_available() -> bool:
    """False once compiling FlexAttention has failed in this process (or torch lacks it)."""
    if _compilation().broken is not None:
        return False
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError as error:
        _mark_broken(f"FlexAttention is not in this torch ({error})")
        return False
    return True


def _mark_broken(reason: str) -> None:
    _compilation().broken = reason
    log.warning("carnator: FlexAttention unavailable, using another block-sparse path: %s", reason)


def _flex() -> Callable:
    compilation = _compilation()
    if compilation.compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        # dynamic=False: one specialised kernel per shape, which is what video models present.
        compilation.compiled = torch.compile(flex_attention, dynamic=False)
    return compilation.compiled


def to_flex_block_mask(layout: BlockLayout, batch: int, heads: int, device: torch.device):
    """FlexAttention BlockMask for `layout`; its index rows are padded to one entry per key block."""
    from torch.nn.attention.flex_attention import BlockMask

    # Expanded to (B, H): one compiled kernel per input shape, whether the layout is shared or per head.
    indices, counts = layout.to(device).expanded(batch, heads)
    pad = layout.num_blocks - indices.shape[-1]
    if pad > 0:
        indices = torch.cat([indices, indices.new_zeros(*indices.shape[:-1], pad)], dim=-1)
    return BlockMask.from_kv_blocks(
        counts.contiguous(),
        indices.contiguous(),
        BLOCK_SIZE=layout.block_size,
        seq_lengths=(layout.n_tokens, layout.n_tokens),
        compute_q_blocks=False,
    )


def flex_block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, scale: float | None = None
) -> torch.Tensor | None:
    """Attention over (B, H, N, D) restricted to `layout`, or None when FlexAttention cannot run these inputs."""
    if not flex_available():
        return None
    # Inductor's FlexAttention drops NaN scores (a NaN query row comes back as zeros, rows that see an
    # inf key stay finite) where dense attention yields NaN. Non-finite inputs go to a path that keeps
    # dense semantics, so a poisoned input is never hidden; the check is one cheap pass per tensor.
    if not all(bool(torch.isfinite(x).all()) for x in (q, k, v)):
        return None
    block_mask = to_flex_block_mask(layout, q.shape[0], q.shape[1], q.device)
    try:
        return _flex()(q, k, v, block_mask=block_mask, scale=scale)
    except Exception as error:  # noqa: BLE001 - any compiler/toolchain failure means "use another path"
        _mark_broken(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        return None

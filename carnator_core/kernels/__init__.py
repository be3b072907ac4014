"""Block-sparse attention math: Triton kernel, CPU path, FlexAttention path, dense reference.

`block_sparse_attention(q, k, v, layout, heads=..., scale=...)` is the entry point; `BlockLayout` says
which key blocks each query block attends; `kernel_fallbacks()` lists kernel configurations that failed their
first-call check and run dense. Nothing here imports the rest of `carnator_core`.
"""

from .dispatch import BACKENDS, block_sparse_attention, kernel_fallbacks
from .layout import BlockLayout
from .reference import reference_attention

__all__ = ["BACKENDS", "BlockLayout", "block_sparse_attention", "kernel_fallbacks", "reference_attention"]

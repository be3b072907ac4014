"""First-call guard of the fast kernels: a kernel that cannot run, or runs wrong, costs speed, never a prompt.

A fast kernel can fail where it was never run: a Triton release it was not written for, shared memory beyond a
smaller GPU's, a dtype an older architecture lacks. So the first call of each configuration (kernel, device,
dtype, head dim, block size) runs under `KernelGuard.run`: compile and launch errors are caught (on CUDA after a
synchronize, so asynchronous launch errors surface there), and a slice of the result is compared with the
masked reference. A configuration that fails is logged once and answered by dense SDPA from then on, with the
reason listed by `fallbacks()` for the run report; one that passes is a set lookup on every later call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .layout import BlockLayout
from .reference import reference_attention

log = logging.getLogger("carnator.kernels")

# (q, k, v, layout, scale) -> (B, H, N, D) result, or None when the kernel declines the inputs (no verdict then).
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, BlockLayout, float | None], torch.Tensor | None]

# Largest error allowed on the checked slice, relative to the largest |v| of its (batch, head) (at least 1): an
# attention output is an average of values, so its error scales with them. Loose enough for every correct
# kernel's rounding, far below what a wrong kernel produces.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}
DEFAULT_TOLERANCE = 5e-2


def config_key(name: str, q: torch.Tensor, layout: BlockLayout) -> tuple:
    """What decides whether a kernel compiles and runs correctly: its tile shapes, dtype and device."""
    return (name, q.device, q.dtype, q.shape[-1], layout.block_size)


def describe(key: tuple) -> str:
    name, device, dtype, dim, block_size = key
    return f"{name} kernel on {device}, {str(dtype).removeprefix('torch.')}, head dim {dim}, block size {block_size}"


class KernelGuard:
    """Registry of verified and failed kernel configurations; `run` calls a kernel through it."""

    def __init__(self) -> None:
        self._verified: set[tuple] = set()
        self._failed: dict[tuple, str] = {}
        self._lock = threading.Lock()
        self.checks = 0  # first-call checks run (compared slices), for tests and benchmarks

    def run(self, name: str, kernel: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            layout: BlockLayout, scale: float | None) -> torch.Tensor | None:
        """The kernel's result, or dense SDPA where this configuration failed; None where the kernel declined."""
        key = config_key(name, q, layout)
        if key in self._verified:
            return kernel(q, k, v, layout, scale)
        if key in self._failed:
            return F.scaled_dot_product_attention(q, k, v, scale=scale)
        return self._first_call(key, kernel, q, k, v, layout, scale)

    def fallbacks(self) -> list[str]:
        """One line per configuration that runs dense SDPA instead of its kernel, with the reason."""
        with self._lock:
            return [f"{describe(key)}: {reason}; dense attention used" for key, reason in self._failed.items()]

    def _first_call(self, key: tuple, kernel: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    layout: BlockLayout, scale: float | None) -> torch.Tensor | None:
        try:
            out = kernel(q, k, v, layout, scale)
            if out is None:
                return None
            if q.is_cuda and torch.cuda.is_current_stream_capturing():
                return out  # a CUDA graph is being captured: nothing can be read back now, a later call verifies
            if q.is_cuda:
                torch.cuda.synchronize(q.device)
            with self._lock:
                self.checks += 1
            reason = mismatch(out, q, k, v, layout, scale)
        except torch.cuda.OutOfMemoryError:
            raise  # memory is the caller's to manage; dense attention would need more of it, not less
        except Exception as error:  # noqa: BLE001 - any compile or launch error means "not on this configuration"
            reason = error_text(error)
        if reason is None:
            with self._lock:
                self._verified.add(key)
            return out
        with self._lock:
            first = key not in self._failed
            self._failed.setdefault(key, reason)
        if first:
            log.warning("carnator: %s failed its first-call check (%s); using dense attention for it",
                        describe(key), reason)
        return F.scaled_dot_product_attention(q, k, v, scale=scale)


def error_text(error: BaseException) -> str:
    """One line for the log and the report. Compilers wrap the cause in a message that starts with source
    positions (Triton's CompilationError), so the line is the innermost cause's first line."""
    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    lines = str(root).strip().splitlines()
    kind = type(error).__name__ if root is error else f"{type(error).__name__} ({type(root).__name__})"
    return f"{kind}: {lines[0]}" if lines else kind


def mismatch(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout,
             scale: float | None) -> str | None:
    """None when `out` agrees with the masked reference on a slice, else how it differs.

    The slice is the last (batch, head), where a wrong batch or head offset shows (the first has offset zero),
    at its first, middle and last query blocks (the last one may be ragged); the reference runs on that
    slice alone, so the check stays cheap on long sequences.
    """
    b, h = q.shape[0] - 1, q.shape[1] - 1
    groups_b, groups_h = layout.groups
    lb, lh = min(b, groups_b - 1), min(h, groups_h - 1)
    head_layout = BlockLayout(layout.kv_indices[lb:lb + 1, lh:lh + 1], layout.kv_counts[lb:lb + 1, lh:lh + 1],
                              layout.block_size, layout.n_tokens)
    blocks = sorted({0, layout.num_blocks // 2, layout.num_blocks - 1})
    one = (slice(b, b + 1), slice(h, h + 1))
    expected = reference_attention(q[one], k[one], v[one], head_layout, scale, torch.tensor(blocks)).float()
    bs, n = layout.block_size, layout.n_tokens
    actual = torch.cat([out[one][:, :, i * bs:min((i + 1) * bs, n)] for i in blocks], dim=2).float()
    if not torch.equal(actual.isnan(), expected.isnan()):
        return "NaN where the masked reference has none, or none where it has"
    error = float((actual - expected).nan_to_num(nan=0.0).abs().max())
    bound = TOLERANCE.get(q.dtype, DEFAULT_TOLERANCE) * max(1.0, float(v[one].float().abs().max()))
    if not error <= bound:
        return f"result differs from the masked reference by {error:.3g} (allowed {bound:.3g})"
    return None

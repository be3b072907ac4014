"""The Triton block-sparse kernel against the dense reference.

On a CUDA machine the cases run directly on the GPU. Without one they run on CPU under Triton's
interpreter, which reads TRITON_INTERPRET only when triton is first imported: the driver test re-runs
this module in a fresh process with the variable set, and the cases are skipped in the parent process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from carnator_core.kernels import BlockLayout, block_sparse_attention, dispatch, kernel_fallbacks, reference_attention
from carnator_core.kernels.guard import KernelGuard

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
RUN_HERE = DEVICE == "cuda" or INTERPRETED
kernel_case = pytest.mark.skipif(not RUN_HERE, reason="runs in the TRITON_INTERPRET=1 subprocess of the driver test")

TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def test_cases_under_the_interpreter_in_a_subprocess() -> None:
    if RUN_HERE:
        pytest.skip("the cases run directly in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout


def _attention(q, k, v, layout, scale=None):
    from carnator_core.kernels.triton_block_sparse import triton_block_sparse_attention

    return triton_block_sparse_attention(q, k, v, layout, scale)


def _inputs(batch, heads, n, dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, dim, generator=generator).to(dtype).to(DEVICE) for _ in range(3)]


def _layout(groups_b, heads, n, block_size, seed=0):
    """Each head its own density (0.2 .. 0.8)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-n // block_size)
    density = torch.linspace(0.2, 0.8, heads)[None, :, None, None]
    mask = torch.rand(groups_b, heads, blocks, blocks, generator=generator) < density
    return BlockLayout.from_dense(mask, block_size, n).to(DEVICE)


def _assert_close(actual, expected, dtype):
    error = (actual.float() - expected.float()).abs().max().item()
    assert error <= TOLERANCE[dtype], f"max abs error {error} > {TOLERANCE[dtype]}"


DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        INTERPRETED, reason="Triton's interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584)")),
]


@kernel_case
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(2, 3, 320, 64, 64), (2, 3, 300, 64, 64), (1, 2, 300, 128, 128), (1, 2, 200, 64, 128)],
    ids=["even", "ragged64", "ragged128_d128", "ragged128_d64"],
)
def test_random_masks_match_reference(dtype, shape):
    batch, heads, n, dim, block_size = shape
    q, k, v = _inputs(batch, heads, n, dim, dtype)
    layout = _layout(batch, heads, n, block_size)
    _assert_close(_attention(q, k, v, layout), reference_attention(q, k, v, layout), dtype)


@kernel_case
def test_full_mask_equals_dense_sdpa():
    q, k, v = _inputs(2, 2, 300, 64, torch.float32, seed=1)
    out = _attention(q, k, v, BlockLayout.full(300, 64, DEVICE))
    _assert_close(out, F.scaled_dot_product_attention(q, k, v), torch.float32)


@kernel_case
def test_packed_comfy_layout_is_read_in_place():
    """(B, N, H*D) tensors are strided (B, H, N, D) views; the dispatcher hands them over without copies."""
    batch, heads, n, dim = 2, 2, 300, 64
    q, k, v = _inputs(batch, heads, n, dim, torch.float32, seed=2)
    packed = [x.transpose(1, 2).reshape(batch, n, heads * dim) for x in (q, k, v)]
    layout = _layout(1, heads, n, 64, seed=2)
    out = block_sparse_attention(*packed, layout, heads=heads, backend="triton", scale=0.2)
    expected = reference_attention(q, k, v, layout, scale=0.2).transpose(1, 2).reshape(batch, n, heads * dim)
    _assert_close(out, expected, torch.float32)


@kernel_case
def test_nan_inf_and_empty_rows_behave_like_dense():
    q, k, v = _inputs(2, 2, 256, 64, torch.float32, seed=3)
    q[0, 0, 10] = float("nan")
    k[1, 1, 200] = float("inf")
    mask = torch.rand(2, 2, 4, 4, generator=torch.Generator().manual_seed(3)) < 0.6
    mask[0, 1, 2] = False
    layout = BlockLayout.from_dense(mask, 64, 256).to(DEVICE)
    out = _attention(q, k, v, layout)
    expected = reference_attention(q, k, v, layout)
    assert torch.equal(out.isnan(), expected.isnan()) and out.isnan().any()
    finite = ~expected.isnan()
    _assert_close(out[finite], expected[finite], torch.float32)
    assert torch.equal(out[0, 1, 128:192], torch.zeros_like(out[0, 1, 128:192]))


# ---------------------------------------------------------------- first-call guard, with the kernel really failing


@kernel_case
def test_a_kernel_that_fails_to_compile_falls_back_to_dense(caplog):
    """Head dim 48 is past `triton_supports`: the kernel's tl.arange over it fails to compile (or to interpret)."""
    from carnator_core.kernels.triton_block_sparse import triton_block_sparse_attention

    q, k, v = _inputs(1, 2, 200, 48, torch.float32, seed=4)
    layout = _layout(1, 2, 200, 64, seed=4)
    guard = KernelGuard()
    with caplog.at_level("WARNING", logger="carnator.kernels"):
        results = [guard.run("triton", triton_block_sparse_attention, q, k, v, layout, None) for _ in range(2)]
    dense = F.scaled_dot_product_attention(q, k, v)
    assert all(torch.equal(out, dense) for out in results)
    assert len([r for r in caplog.records if "first-call check" in r.getMessage()]) == 1
    (reason,) = guard.fallbacks()
    assert "head dim 48" in reason and guard.checks == 0


@kernel_case
def test_a_kernel_that_runs_but_is_wrong_is_caught_by_the_check():
    """Block size 32 is past `triton_supports`: the kernel runs, walks no key tile (BLOCK // BLOCK_N == 0) and
    returns zeros, which the comparison with the masked reference catches."""
    from carnator_core.kernels.triton_block_sparse import triton_block_sparse_attention

    q, k, v = _inputs(1, 2, 200, 64, torch.float32, seed=5)
    layout = _layout(1, 2, 200, 32, seed=5)
    guard = KernelGuard()
    out = guard.run("triton", triton_block_sparse_attention, q, k, v, layout, 0.2)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, scale=0.2))
    assert guard.checks == 1 and "differs from the masked reference" in guard.fallbacks()[0]


@kernel_case
def test_dispatch_returns_the_kernel_result_only_where_it_is_right(fresh_process_state):
    """bf16 through the dispatcher: right on GPUs, wrong under the interpreter (its tl.dot multiplies bf16 bit
    patterns, triton-lang/triton#11584). Whichever it is here, the dispatcher returns the kernel's result only
    when it agrees with the reference, and dense SDPA with the reason listed otherwise."""
    q, k, v = _inputs(2, 2, 256, 64, torch.bfloat16, seed=6)
    layout = _layout(1, 2, 256, 64, seed=6)
    raw = _attention(q, k, v, layout)
    right = (raw.float() - reference_attention(q, k, v, layout).float()).abs().max().item() <= TOLERANCE[torch.bfloat16]
    for _ in range(2):
        out = block_sparse_attention(q, k, v, layout, backend="triton")
        if right:
            assert torch.equal(out, raw) and kernel_fallbacks() == []
        else:
            assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))
            assert "differs from the masked reference" in kernel_fallbacks()[0]
    assert dispatch.kernel_guard().checks == 1

"""Block-sparse attention paths (CPU, FlexAttention, dispatch) against the dense reference.

The Triton kernel has its own module (tests/unit/test_triton_kernel.py) because it must run under
TRITON_INTERPRET=1, which Triton reads once at import.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import carnator_core.kernels.cpu
from carnator_core.kernels import BlockLayout, block_sparse_attention, dispatch, kernel_fallbacks, reference_attention
from carnator_core.kernels.cpu import cpu_block_sparse_attention
from carnator_core.kernels.flex import flex_available, flex_block_sparse_attention
from carnator_core.kernels.guard import KernelGuard

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

# (batch, heads, tokens, head_dim, block_size); 300 tokens leave a ragged last block.
SHAPES = [(2, 3, 320, 64, 64), (2, 3, 300, 64, 64), (1, 2, 300, 64, 128)]


def _flex(q, k, v, layout, scale=None):
    if not flex_available():
        pytest.fail("FlexAttention must compile on the test machine (C++ compiler present)")
    out = flex_block_sparse_attention(q, k, v, layout, scale)
    assert out is not None, "FlexAttention failed to compile"
    return out


PATHS = {"cpu": cpu_block_sparse_attention, "flex": _flex}


def random_layout(groups_b: int, heads: int, n: int, block_size: int, seed: int = 0) -> BlockLayout:
    """Each head its own density (0.2 .. 0.8); some rows may attend nothing."""
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-n // block_size)
    density = torch.linspace(0.2, 0.8, heads)[None, :, None, None]
    mask = torch.rand(groups_b, heads, blocks, blocks, generator=generator) < density
    return BlockLayout.from_dense(mask, block_size, n)


def inputs(batch: int, heads: int, n: int, dim: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, dim, generator=generator).to(dtype) for _ in range(3)]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    error = (actual.float() - expected.float()).abs().max().item()
    assert error <= TOLERANCE[dtype], f"max abs error {error} > {TOLERANCE[dtype]}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", SHAPES, ids=["even", "ragged64", "ragged128"])
def test_random_masks_match_reference(path: str, shape: tuple[int, ...]) -> None:
    batch, heads, n, dim, block_size = shape
    q, k, v = inputs(batch, heads, n, dim)
    layout = random_layout(batch, heads, n, block_size)
    assert len(set(layout.kv_counts.sum(dim=(0, 2)).tolist())) == heads, "heads should differ in density"
    assert_close(PATHS[path](q, k, v, layout), reference_attention(q, k, v, layout), torch.float32)


def banded_layout(n: int, heads: int, block_size: int, width: int) -> BlockLayout:
    """Per head a band of `width` blocks at its own offset, plus global columns: rows of equal and of
    varying counts, consecutive and scattered."""
    blocks = -(-n // block_size)
    i, j = torch.arange(blocks)[:, None], torch.arange(blocks)[None, :]
    mask = torch.stack([((j - i - h) >= -width // 2) & ((j - i - h) < width - width // 2) for h in range(heads)])
    mask[:, :, 0] = True
    mask[1:, ::3, blocks // 2] = True
    return BlockLayout.from_dense(mask[None], block_size, n)


@pytest.mark.parametrize("chunk_bytes", [1, 64 << 10, carnator_core.kernels.cpu.CHUNK_BYTES], ids=["one-row", "small", "default"])
@pytest.mark.parametrize("n", [24 * 64, 24 * 64 - 37], ids=["even", "ragged"])
def test_cpu_chunking_matches_reference(chunk_bytes: int, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bands, global columns and random rows, split into calls of one, a few or many query blocks (both the
    sliced and the index-copied output paths), equal one softmax over the row."""
    monkeypatch.setattr(carnator_core.kernels.cpu, "CHUNK_BYTES", chunk_bytes)
    q, k, v = inputs(2, 3, n, 16, seed=7)
    for layout in (banded_layout(n, 3, 64, 10), random_layout(2, 3, n, 64, seed=7), BlockLayout.full(n, 64)):
        assert_close(cpu_block_sparse_attention(q, k, v, layout), reference_attention(q, k, v, layout), torch.float32)


@pytest.mark.parametrize("path", PATHS)
def test_bf16_matches_reference(path: str) -> None:
    batch, heads, n, dim, block_size = SHAPES[1]
    q, k, v = inputs(batch, heads, n, dim, torch.bfloat16)
    layout = random_layout(1, heads, n, block_size, seed=3)
    out = PATHS[path](q, k, v, layout)
    assert out.dtype == torch.bfloat16
    assert_close(out, reference_attention(q, k, v, layout), torch.bfloat16)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", SHAPES[:2], ids=["even", "ragged64"])
def test_full_mask_equals_dense_sdpa(path: str, shape: tuple[int, ...]) -> None:
    batch, heads, n, dim, block_size = shape
    q, k, v = inputs(batch, heads, n, dim, seed=1)
    out = PATHS[path](q, k, v, BlockLayout.full(n, block_size))
    assert_close(out, F.scaled_dot_product_attention(q, k, v), torch.float32)


@pytest.mark.parametrize("path", PATHS)
def test_rows_without_key_blocks_are_zero(path: str) -> None:
    batch, heads, n, dim, block_size = SHAPES[0]
    q, k, v = inputs(batch, heads, n, dim)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool)
    mask[0, 0, 2] = False
    out = PATHS[path](q, k, v, BlockLayout.from_dense(mask, block_size, n))
    assert torch.equal(out[:, :, 128:192], torch.zeros_like(out[:, :, 128:192]))
    assert out[:, :, :128].abs().sum() > 0


@pytest.mark.parametrize("backend", ["cpu", "flex"])
def test_nan_and_inf_propagate_like_dense(backend: str) -> None:
    """A poisoned query row is NaN only in its own row; a poisoned key only where it is attended."""
    batch, heads, n, dim, block_size = SHAPES[0]
    q, k, v = inputs(batch, heads, n, dim, seed=2)
    q[0, 0, 10] = float("nan")
    k[0, 1, 200] = float("inf")  # key block 3
    layout = random_layout(batch, heads, n, block_size, seed=4)
    out = block_sparse_attention(q, k, v, layout, backend=backend)
    expected = reference_attention(q, k, v, layout)
    assert torch.equal(out.isnan(), expected.isnan())
    assert out.isnan().any()
    finite = ~expected.isnan()
    assert_close(out[finite], expected[finite], torch.float32)
    # With every block attended the result is dense attention's, NaNs included.
    full = block_sparse_attention(q, k, v, BlockLayout.full(n, block_size), backend=backend)
    assert torch.equal(full.isnan(), F.scaled_dot_product_attention(q, k, v).isnan())


def test_flex_declines_non_finite_inputs() -> None:
    """FlexAttention drops NaN scores, so the dispatcher must not hand it poisoned inputs."""
    batch, heads, n, dim, block_size = SHAPES[0]
    q, k, v = inputs(batch, heads, n, dim)
    k[0, 0, 3, 0] = float("nan")
    assert flex_block_sparse_attention(q, k, v, BlockLayout.full(n, block_size)) is None


@pytest.mark.parametrize("threads", [1, 2])
def test_flex_matches_the_reference_whatever_thread_count_an_earlier_test_left(threads: int) -> None:
    """A benchmark's `main` sets torch's thread count for its process; FlexAttention, compiled before or after, still
    matches the reference (and `torch_threads_kept` gives the next test the count this one found)."""
    torch.set_num_threads(threads)
    batch, heads, n, dim, block_size = SHAPES[0]
    q, k, v = inputs(batch, heads, n, dim, seed=6)
    layout = random_layout(batch, heads, n, block_size, seed=6)
    assert_close(_flex(q, k, v, layout), reference_attention(q, k, v, layout), torch.float32)


def test_batch_groups_give_cond_and_uncond_their_own_masks() -> None:
    batch, heads, n, dim, block_size = SHAPES[0]
    q, k, v = inputs(batch, heads, n, dim)
    layout = random_layout(batch, heads, n, block_size, seed=5)
    assert not torch.equal(layout.kv_counts[0], layout.kv_counts[1])
    out = block_sparse_attention(q, k, v, layout)
    assert_close(out, reference_attention(q, k, v, layout), torch.float32)


def test_packed_comfy_layout_matches_split_heads() -> None:
    """(B, N, H*D) with `heads` is ComfyUI's convention; the result comes back in it."""
    batch, heads, n, dim, block_size = SHAPES[1]
    q, k, v = inputs(batch, heads, n, dim)
    layout = random_layout(1, heads, n, block_size)
    packed = [x.transpose(1, 2).reshape(batch, n, heads * dim) for x in (q, k, v)]
    out = block_sparse_attention(*packed, layout, heads=heads)
    assert out.shape == (batch, n, heads * dim)
    expected = reference_attention(q, k, v, layout).transpose(1, 2).reshape(batch, n, heads * dim)
    assert_close(out, expected, torch.float32)


def test_dispatch_scale_matches_reference() -> None:
    batch, heads, n, dim, block_size = SHAPES[0]
    q, k, v = inputs(batch, heads, n, dim)
    layout = random_layout(1, heads, n, block_size, seed=6)
    assert_close(block_sparse_attention(q, k, v, layout, scale=0.3), reference_attention(q, k, v, layout, 0.3),
                 torch.float32)


@pytest.mark.parametrize(
    "case",
    ["cross_attention", "token_count", "head_groups", "triton_head_dim"],
)
def test_unsupported_inputs_fall_back_to_dense_with_one_log_line(
    case: str, caplog: pytest.LogCaptureFixture, fresh_process_state
) -> None:
    batch, heads, n, dim, block_size = SHAPES[0]
    q, k, v = inputs(batch, heads, n, dim)
    layout = random_layout(1, heads, n, block_size)
    backend = "auto"
    if case == "cross_attention":
        k, v = k[:, :, :77], v[:, :, :77]
    elif case == "token_count":
        layout = random_layout(1, heads, n - 64, block_size)
    elif case == "head_groups":
        layout = random_layout(1, heads + 1, n, block_size)
    else:
        q, k, v = (x[..., :48] for x in (q, k, v))
        backend = "triton"
    with caplog.at_level(logging.WARNING, logger="carnator.kernels"):
        first = block_sparse_attention(q, k, v, layout, backend=backend)
        second = block_sparse_attention(q, k, v, layout, backend=backend)
    dense = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(first, dense) and torch.equal(second, dense)
    assert len([r for r in caplog.records if "using dense attention" in r.getMessage()]) == 1


def test_layout_round_trips_dense_masks() -> None:
    mask = torch.rand(2, 3, 7, 7, generator=torch.Generator().manual_seed(0)) < 0.4
    layout = BlockLayout.from_dense(mask, 64, 7 * 64 - 5)
    assert torch.equal(layout.to_dense(), mask)
    assert layout.density() == pytest.approx(mask.float().mean().item())
    for row in range(7):
        listed = layout.kv_indices[1, 2, row, : layout.kv_counts[1, 2, row]]
        assert torch.equal(listed, mask[1, 2, row].nonzero()[:, 0].int())
    assert layout.fits(2, 3, 7 * 64 - 5) and not layout.fits(2, 3, 7 * 64) and not layout.fits(4, 3, 7 * 64 - 5)


def test_layout_rejects_inconsistent_shapes() -> None:
    with pytest.raises(ValueError):
        BlockLayout(torch.zeros(1, 1, 4, 4, dtype=torch.int32), torch.zeros(1, 1, 4, dtype=torch.int32), 64, 100)
    with pytest.raises(ValueError):
        BlockLayout.from_dense(torch.ones(1, 1, 3, 4, dtype=torch.bool), 64, 200)


def test_a_reused_layout_plans_each_input_shape_apart() -> None:
    """Layouts are reused across steps and calls (and cond/uncond batches); their cached work plans must
    follow the batch, head count and dtype of every call."""
    layout = random_layout(1, 1, 300, 64)
    for batch, heads, dtype in ((1, 2, torch.float32), (2, 3, torch.float32), (1, 2, torch.bfloat16), (1, 2, torch.float32)):
        q, k, v = inputs(batch, heads, 300, 64, dtype, seed=batch + heads)
        assert_close(cpu_block_sparse_attention(q, k, v, layout), reference_attention(q, k, v, layout), dtype)
    computed_in_bf16 = carnator_core.kernels.cpu._fast_bfloat16(torch.bfloat16)  # else bf16 runs in fp32, sharing its plan
    assert len(layout.plans) == (3 if computed_in_bf16 else 2)


# ---------------------------------------------------------------- first-call guard
# The guard is given the pack's own CPU kernel, correct or driven into real failures: a layout for another token
# count (a stale layout) and inputs read at the wrong head. tests/unit/test_triton_kernel.py fails the Triton kernel.


def _stale_layout(tokens_off: int):
    """The CPU kernel run with a full layout for `tokens_off` more (or fewer) tokens than the inputs have."""

    def kernel(q, k, v, layout, scale):
        kernel.calls += 1
        stale = BlockLayout.full(layout.n_tokens + tokens_off, layout.block_size)
        return cpu_block_sparse_attention(q, k, v, stale, scale)

    kernel.calls = 0
    return kernel


def _counted(kernel):
    def counted(*args):
        counted.calls += 1
        return kernel(*args)

    counted.calls = 0
    return counted


def test_guard_checks_a_correct_kernel_once_per_configuration() -> None:
    batch, heads, n, dim, block_size = SHAPES[1]
    q, k, v = inputs(batch, heads, n, dim, seed=8)
    q[-1, -1, 5] = float("nan")  # the checked slice holds NaN and inf, as a real input may; still no mismatch
    k[-1, -1, 100] = float("inf")
    layout = random_layout(batch, heads, n, block_size, seed=8)
    guard, kernel = KernelGuard(), _counted(cpu_block_sparse_attention)
    expected = reference_attention(q, k, v, layout)
    for _ in range(3):
        out = guard.run("cpu", kernel, q, k, v, layout, None)
        assert torch.equal(out.isnan(), expected.isnan())
        assert_close(out.nan_to_num(), expected.nan_to_num(), torch.float32)
    assert (guard.checks, kernel.calls) == (1, 3)
    guard.run("cpu", kernel, *(x.bfloat16() for x in (q, k, v)), layout, None)  # another dtype, another check
    guard.run("cpu", kernel, q, k, v, random_layout(batch, heads, n, 128), None)  # another block size
    assert guard.checks == 3 and guard.fallbacks() == []


@pytest.mark.parametrize("tokens_off", [-128, 128], ids=["raises", "wrong"])
def test_a_failing_kernel_falls_back_to_dense_logged_once(tokens_off: int, caplog: pytest.LogCaptureFixture) -> None:
    """Fewer tokens in the layout make the CPU kernel raise; more make it attend padding: both run dense SDPA,
    the kernel is not tried again for that configuration, and the reason is listed."""
    batch, heads, n, dim, block_size = SHAPES[0]
    q, k, v = inputs(batch, heads, n, dim, seed=9)
    layout = random_layout(batch, heads, n, block_size, seed=9)
    guard, kernel = KernelGuard(), _stale_layout(tokens_off)
    with caplog.at_level(logging.WARNING, logger="carnator.kernels"):
        results = [guard.run("cpu", kernel, q, k, v, layout, 0.3) for _ in range(3)]
    dense = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    assert all(torch.equal(out, dense) for out in results)
    assert kernel.calls == 1
    assert len([r for r in caplog.records if "first-call check" in r.getMessage()]) == 1
    (reason,) = guard.fallbacks()
    assert reason.startswith("cpu kernel on cpu, float32, head dim 64, block size 64: ")
    assert ("RuntimeError" if tokens_off < 0 else "differs from the masked reference") in reason
    # other configurations are untouched
    assert torch.equal(guard.run("cpu", cpu_block_sparse_attention, q, k, v, random_layout(batch, heads, n, 128), 0.3),
                       cpu_block_sparse_attention(q, k, v, random_layout(batch, heads, n, 128), 0.3))


@pytest.mark.parametrize("wrong", ["head", "batch"])
def test_the_check_catches_a_kernel_that_reads_the_wrong_head_or_batch(wrong: str) -> None:
    """Offset bugs leave (batch 0, head 0) right, so the check looks at the last batch element and head."""
    batch, heads, n, dim, block_size = SHAPES[0]
    q, k, v = inputs(batch, heads, n, dim, seed=10)
    layout = random_layout(1, heads, n, block_size, seed=10)

    def first_only(q, k, v, layout, scale):
        pick = (slice(None), slice(0, 1)) if wrong == "head" else (slice(0, 1),)
        return cpu_block_sparse_attention(*(x[pick].expand_as(x) for x in (q, k, v)), layout, scale)

    guard = KernelGuard()
    assert torch.equal(guard.run("cpu", first_only, q, k, v, layout, None), F.scaled_dot_product_attention(q, k, v))
    assert "differs from the masked reference" in guard.fallbacks()[0]


def test_dispatch_calls_kernels_through_the_guard(fresh_process_state) -> None:
    """Verified once, then straight to the kernel; the packed layout is the same configuration."""
    batch, heads, n, dim, block_size = SHAPES[1]
    q, k, v = inputs(batch, heads, n, dim, seed=11)
    layout = random_layout(1, heads, n, block_size, seed=11)
    packed = [x.transpose(1, 2).reshape(batch, n, heads * dim) for x in (q, k, v)]
    for _ in range(2):
        assert_close(block_sparse_attention(q, k, v, layout), reference_attention(q, k, v, layout), torch.float32)
        block_sparse_attention(*packed, layout, heads=heads, backend="cpu")
    assert dispatch.kernel_guard().checks == 1 and kernel_fallbacks() == []

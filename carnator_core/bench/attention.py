"""Attention benchmark: dense SDPA vs block-sparse attention at video-DiT shapes, as ratios to 1/density.

`python -m carnator_core.bench attention [--device cpu|cuda] [--json] [--quick] [--backend auto|cpu|flex|triton]
[--record NAME]`

Masks have the structure video DiTs show (and `carnator_core.attention.masks` estimates): each query block keeps
its nearest key blocks in the flattened sequence and at the same spatial place in neighbouring frames
(multi-diagonal bands), plus a few global blocks per head (the first-frame sink and two random ones).
Dense and sparse calls are interleaved and medians reported, so a load change on a shared machine hits
both alike. Correctness: max abs error against the dense reference under the same mask, on a sample
of query blocks (the full reference is O(N^2) memory per head).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from carnator_core.kernels import BACKENDS, BlockLayout, block_sparse_attention, reference_attention
from carnator_core.recorded_runs import Recording, add_record_option

HEADS, HEAD_DIM = 12, 128
DENSITIES = (0.1, 0.125, 0.25, 0.5)
SIZES = {"cpu": (4096, 8192, 16384), "cuda": (4096, 8192, 16384, 32760)}
EXTRA_DENSITIES = {"cpu": (), "cuda": (0.15,)}  # the GPU target is stated at 15%
LATENT_FRAMES = 8


def video_layout(n: int, heads: int, block_size: int, density: float, seed: int = 0) -> BlockLayout:
    """Exactly round(density * blocks) key blocks per query block: globals first, then the nearest blocks
    in (sequence, frame) distance; ties broken by a little per-head noise."""
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-n // block_size)
    count = max(1, round(density * blocks))
    per_frame = max(1, blocks // LATENT_FRAMES)
    i = torch.arange(blocks)[:, None]
    j = torch.arange(blocks)[None, :]
    # Distance to the same spatial place m frames away, temporal hops costing a little more than spatial.
    distance = torch.stack([(i - j - m * per_frame).abs() * (1 + 0.5 * abs(m)) + 2 * abs(m) for m in range(-2, 3)]).amin(0)
    score = -distance.float()[None].expand(heads, -1, -1).clone()
    score += 0.1 * torch.rand(heads, blocks, blocks, generator=generator)
    score[:, :, 0] = float("inf")  # first-frame sink
    extra = torch.randint(1, blocks, (heads, 2), generator=generator)
    score.scatter_(2, extra[:, None, :].expand(-1, blocks, -1), float("inf"))
    chosen = score.topk(count, dim=-1).indices
    mask = torch.zeros(1, heads, blocks, blocks, dtype=torch.bool).scatter_(3, chosen[None], True)
    return BlockLayout.from_dense(mask, block_size, n)


def _timer(device: str, clock: str) -> Callable[[Callable[[], torch.Tensor]], float]:
    """Wall time, or this process's CPU time: on a shared CPU with one torch thread the latter is what
    the work itself costs, unaffected by how much of a core the other jobs leave (cache effects remain)."""
    now = time.process_time if clock == "process" else time.perf_counter

    def timed(fn: Callable[[], torch.Tensor]) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        start = now()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return now() - start

    return timed


def _sample_blocks(blocks: int) -> torch.Tensor:
    return torch.tensor(sorted({0, blocks // 3, (2 * blocks) // 3, blocks - 1}))


def measure(n: int, device: str, densities: tuple[float, ...], repeats: int, backend: str, dtype: torch.dtype,
            block_size: int, clock: str, log: Callable[[str], None]) -> list[dict]:
    """Rows for one sequence length: dense once per repeat, interleaved with every density."""
    timed = _timer(device, clock)
    generator = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, generator=generator).to(device=device, dtype=dtype)
               for _ in range(3))
    layouts = {d: video_layout(n, HEADS, block_size, d, seed=n).to(device) for d in densities}

    def dense() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)

    def sparse(density: float) -> Callable[[], torch.Tensor]:
        return lambda: block_sparse_attention(q, k, v, layouts[density], backend=backend)

    dense()  # warm-up (and, for FlexAttention, compilation) outside the timings
    outputs = {d: sparse(d)() for d in densities}
    dense_times: list[float] = []
    sparse_times: dict[float, list[float]] = {d: [] for d in densities}
    for _ in range(repeats):
        dense_times.append(timed(dense))
        for d in densities:
            sparse_times[d].append(timed(sparse(d)))
    dense_s = statistics.median(dense_times)
    rows = []
    for d in densities:
        layout = layouts[d]
        sample = _sample_blocks(layout.num_blocks)
        token_rows = (sample[:, None] * block_size + torch.arange(block_size)).reshape(-1)
        token_rows = token_rows[token_rows < n].to(device)
        expected = reference_attention(q, k, v, layout, query_blocks=sample)
        error = (outputs[d][:, :, token_rows].float() - expected.float()).abs().max().item()
        sparse_s = statistics.median(sparse_times[d])
        actual = layout.density()
        rows.append({"n": n, "heads": HEADS, "head_dim": HEAD_DIM, "density": round(actual, 4),
                     "dense_s": round(dense_s, 4), "sparse_s": round(sparse_s, 4),
                     "speedup": round(dense_s / sparse_s, 2), "ideal": round(1 / actual, 2), "max_abs_err": error})
        log(f"{n:>6} {HEADS:>5} {HEAD_DIM:>8} {actual:>8.4f} {dense_s:>9.3f} {sparse_s:>9.3f} "
            f"{dense_s / sparse_s:>8.2f} {1 / actual:>6.2f} {dense_s / sparse_s * actual:>9.2f} {error:>11.2e}")
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m carnator_core.bench attention", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object {'rows': [...]} instead of a table")
    parser.add_argument("--quick", action="store_true", help="smallest size only, 2 repeats (a smoke run)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="block-sparse path (default: dispatch's pick)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads for torch")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per shape (default 3, quick 2)")
    parser.add_argument("--sizes", type=lambda s: tuple(int(x) for x in s.split(",")), help="comma-separated N")
    parser.add_argument("--block-size", type=int, choices=(64, 128), default=128, help="mask block size in tokens")
    parser.add_argument("--clock", choices=("wall", "process"), default="wall",
                        help="process = this process's CPU time; use with --threads 1 on a shared CPU")
    add_record_option(parser, "the rows")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is available")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    sizes = args.sizes or (SIZES[args.device][:1] if args.quick else SIZES[args.device])
    densities = tuple(sorted(DENSITIES + EXTRA_DENSITIES[args.device]))
    repeats = args.repeats or (2 if args.quick else 3)

    config = {"device": args.device, "backend": args.backend, "dtype": str(dtype).removeprefix("torch."),
              "threads": args.threads, "repeats": repeats, "block_size": args.block_size, "clock": args.clock, "torch": torch.__version__,
              "loadavg_before": [round(x, 2) for x in os.getloadavg()]}
    log = (lambda _line: None) if args.json else print
    log("attention benchmark: " + ", ".join(f"{key}={value}" for key, value in config.items()))
    log(f"{'n':>6} {'heads':>5} {'head_dim':>8} {'density':>8} {'dense_s':>9} {'sparse_s':>9} "
        f"{'speedup':>8} {'ideal':>6} {'of_ideal':>9} {'max_abs_err':>11}")
    recording = Recording(args.record, "carnator_core.bench attention", argv)
    rows = [row for n in sizes
            for row in measure(n, args.device, densities, repeats, args.backend, dtype, args.block_size, args.clock, log)]
    config["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    if (path := recording.store({"rows": rows, "config": config}, torch_threads=args.threads)) is not None:
        log(f"recorded {path}")
    if args.json:
        print(json.dumps({"rows": rows, "config": config}))
    else:
        print(f"load average after: {config['loadavg_after']}")
    return 0

"""Store benchmark: what a worker pays to record an entry, to fetch a hit's blobs, and to look up donors.

`python -m carnator_core.bench store --backend {diskcache,redis} [--url redis://host:port/db] [--json]`

- entry: shaped like a Wan 2.1 1.3B 480p 81-frame request (latent 16x21x60x104, five fp16
  checkpoints of x, x0 and half-resolution guidance, bit-packed block masks of 28 sparse layers
  x 12 heads over 32760 tokens in blocks of 64, a PNG thumbnail), built with the recorder's own code;
  entry_bytes_multistep: the same request sampled by a multistep sampler (uni_pc, the Wan 2.1
  template's), whose entry also keeps one prediction per step up to the deepest checkpoint;
  get_history_ms: the first fetch of those predictions, which such a hit reads besides;
- put_ms / get_ms: medians of writing that entry and of fetching what a hit reads (metadata,
  checkpoints, masks; decoded); for Redis also through the worker's local blob cache;
- lookup_ms: median per-request lookup with an in-memory index of 100k and 1M entries (the
  store's append-log check plus the shortlist query);
- hit_fetch_share: a demo-model hit's blob fetch as a share of the sampling steps it saves
  (balanced mode resumes half-way through 30 steps; steps timed on a randomly initialised demo model).

Without `--url`, Redis runs as a private `redis-server` on a free loopback port for the run.
Entries the benchmark writes are deleted again; a Redis database that holds other data is refused.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis
import torch

from carnator_core.attention.masks import BlockSparseMask
from carnator_core.attention.sparse_attention import masks_to_blob
from carnator_core.bench.lookup import build_index
from carnator_core.demo.wan_model import WanConfig, WanT2V
from carnator_core.lookup.fingerprint import noise_fingerprint
from carnator_core.recorded_runs import Recording, add_record_option
from carnator_core.reuse.recording import RunRecorder
from carnator_core.reuse.settings import ReuseSettings
from carnator_core.store.entry import EntryMeta, HardKey
from carnator_core.store.reuse_store import IndexVectors, ReuseStore
from carnator_core.store.tensor_codec import encode_tensors
from carnator_core.store.tensor_names import HISTORY_BLOB
from carnator_core.store.thumbnail import preview_png

WAN_LATENT = (1, 16, 21, 60, 104)  # Wan 2.1 1.3B, 832x480, 81 frames
WAN_LAYERS, WAN_HEADS = 30, 12
DEMO_LATENT = (1, 16, 5, 16, 16)
DEMO_STEPS = 30


def make_entry(latent_shape: tuple[int, ...], layers: int, heads: int, steps: int, seed: int = 0,
               multistep: bool = False) -> tuple[EntryMeta, dict[str, bytes], IndexVectors]:
    """A recorded entry of a request of this geometry: checkpoints, masks (dense first/last layer), thumbnail; and
    with `multistep`, the sampler's predictions a multistep sampler's entry keeps for its replay."""
    generator = torch.Generator().manual_seed(seed)
    recorder = RunRecorder(set(ReuseSettings().checkpoint_steps(steps)))
    if multistep:
        recorder.history_until = max(recorder.checkpoint_steps)
        for step in range(recorder.history_until):
            recorder.capture_prediction(step, torch.randn(latent_shape, generator=generator))
    for step in sorted(recorder.checkpoint_steps):
        x, x0, guidance = (torch.randn(latent_shape, generator=generator) for _ in range(3))
        if step == 0:
            recorder.capture_start(1.0, noise_fingerprint(x), x0, guidance)
        else:
            recorder.capture(step, 1.0 - step / steps, x, x0, guidance)
    listing, blobs = recorder.blobs()
    tokens = latent_shape[2] * (latent_shape[3] // 2) * (latent_shape[4] // 2)
    blocks = -(-tokens // 64)
    masks = {layer: BlockSparseMask(torch.rand(1, heads, blocks, blocks, generator=generator) < 0.2, 64, tokens)
             for layer in range(1, layers - 1)}
    masks_meta, mask_tensors = masks_to_blob(masks)
    blobs["masks"] = encode_tensors(mask_tensors)
    frame = torch.randn(latent_shape[1], *latent_shape[3:], generator=generator)
    blobs["thumb"] = preview_png(frame, torch.rand(latent_shape[1], 3, generator=generator).tolist())
    meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=HardKey("bench-model", (latent_shape[2], *(
        d // 2 for d in latent_shape[3:])), "bench-schedule"), prompt=f"benchmark entry {seed}",
        latent_shape=latent_shape, total_steps=steps, sample_seconds=float(steps), checkpoints=listing,
        masks=masks_meta)
    vectors = IndexVectors(text=torch.nn.functional.normalize(torch.randn(384, generator=generator), dim=0),
                           cond=torch.nn.functional.normalize(torch.randn(256, generator=generator), dim=0))
    return meta, blobs, vectors


def _median_ms(action: Callable[[], object], repeats: int) -> float:
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        timings.append(time.perf_counter() - started)
    return statistics.median(timings) * 1e3


def fetch_hit(store: ReuseStore, entry_id: str) -> None:
    """What a hit reads: metadata, then the checkpoints the probe needs and the masks attention borrows."""
    if (store.get_meta(entry_id) is None or store.get_tensors(entry_id, "checkpoints") is None
            or store.get_tensors(entry_id, "masks") is None):
        raise RuntimeError(f"entry {entry_id} could not be read back from {store.location}")


def bench_put_get(location: str, puts: int, cache_root: str | None) -> dict[str, float]:
    store = ReuseStore(location, size_limit=2**40)
    written = []
    try:
        put_timings = []
        for number in range(puts):
            meta, blobs, vectors = make_entry(WAN_LATENT, WAN_LAYERS, WAN_HEADS, 30, seed=number)
            started = time.perf_counter()
            store.put(meta, blobs, vectors)
            put_timings.append(time.perf_counter() - started)
            written.append(meta.entry_id)
        entry_bytes = meta.total_bytes + len(meta.to_json())
        result = {"entry_bytes": entry_bytes, "put_ms": statistics.median(put_timings) * 1e3}
        get_timings = []
        for entry_id in written:  # each entry once: the first, network-bound fetch of a hit
            started = time.perf_counter()
            fetch_hit(store, entry_id)
            get_timings.append(time.perf_counter() - started)
        result["get_ms"] = statistics.median(get_timings) * 1e3
        multistep, blobs, vectors = make_entry(WAN_LATENT, WAN_LAYERS, WAN_HEADS, 30, multistep=True)
        store.put(multistep, blobs, vectors)
        written.append(multistep.entry_id)
        result["entry_bytes_multistep"] = multistep.total_bytes + len(multistep.to_json())

        def fetch_history() -> None:  # what a multistep sampler's hit reads besides: the predictions it replays
            if store.get_tensors(multistep.entry_id, HISTORY_BLOB) is None:
                raise RuntimeError(f"entry {multistep.entry_id} lost its history in {store.location}")

        result["get_history_ms"] = _median_ms(fetch_history, 3)
        result["put_mb_s"] = entry_bytes / 2**20 / (result["put_ms"] / 1e3)
        result["get_mb_s"] = (meta.blob_bytes["checkpoints"] + meta.blob_bytes["masks"]) / 2**20 / (
            result["get_ms"] / 1e3)
        if cache_root is not None:
            worker = ReuseStore(location, blob_cache_root=cache_root)
            fetch_hit(worker, written[0])  # the first hit pulls the blobs over the network
            result["get_local_cache_ms"] = _median_ms(lambda: fetch_hit(worker, written[0]), max(3, puts))
            worker.close()
        return result
    finally:
        for entry_id in written:
            store.delete(entry_id)
        store.close()


def bench_lookup(location: str, sizes: list[int], queries: int) -> dict[str, float]:
    """Per-request lookup: the store's append-log check (a round trip on Redis) plus the in-memory query."""
    store = ReuseStore(location)
    timings: dict[str, float] = {}
    generator = torch.Generator().manual_seed(0)
    for size in sizes:
        index, keys, _ = build_index(size, generator)
        index.refresh(store)
        texts = torch.nn.functional.normalize(torch.randn(queries, 384, generator=generator), dim=1)
        conds = torch.nn.functional.normalize(torch.randn(queries, 256, generator=generator), dim=1)
        samples = []
        for i in range(queries):
            started = time.perf_counter()
            index.refresh(store)
            index.query(keys[1], conds[i], texts[i], 8, 0.0)
            samples.append(time.perf_counter() - started)
        timings[str(size)] = statistics.median(samples[1:]) * 1e3
        del index
    store.close()
    return timings


def hit_fetch_share(location: str) -> dict[str, float]:
    """A demo-model hit's blob fetch against the time of the steps a balanced-mode resume saves."""
    store = ReuseStore(location)
    meta, blobs, vectors = make_entry(DEMO_LATENT, WanConfig().num_layers, WanConfig().num_heads, DEMO_STEPS)
    store.put(meta, blobs, vectors)
    try:
        fetch_ms = _median_ms(lambda: fetch_hit(store, meta.entry_id), 20)
    finally:
        store.delete(meta.entry_id)
        store.close()
    model = WanT2V(WanConfig()).eval()
    x = torch.randn(2, *DEMO_LATENT[1:])  # cond and uncond, as CFG evaluates them
    timestep, context = torch.full((2,), 500.0), torch.randn(2, 32, 384)
    with torch.inference_mode():
        step_ms = _median_ms(lambda: model(x, timestep, context), 10)
    saved_steps = DEMO_STEPS // 2
    return {"demo_fetch_ms": fetch_ms, "demo_step_ms": step_ms,
            "hit_fetch_share": fetch_ms / (saved_steps * step_ms)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def private_redis() -> Iterator[str]:
    """A throwaway redis-server on a free loopback port (no persistence), stopped afterwards."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found: install it (apt-get install redis-server) or pass --url")
    port = _free_port()
    with tempfile.TemporaryDirectory() as directory:
        process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                    "--appendonly", "no", "--dir", directory], stdout=subprocess.DEVNULL)
        try:
            client, deadline = redis.Redis(port=port, socket_timeout=1), time.monotonic() + 10
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            process.wait(10)


def run(backend: str, url: str | None, puts: int, sizes: list[int], queries: int) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        if backend == "diskcache":
            location, cache_root = f"{directory}/store", None
            return _measure(backend, location, cache_root, puts, sizes, queries)
        if url is not None:
            return _measure(backend, url, f"{directory}/blob-cache", puts, sizes, queries)
        with private_redis() as private_url:
            return _measure(backend, private_url, f"{directory}/blob-cache", puts, sizes, queries)


def _measure(backend: str, location: str, cache_root: str | None, puts: int, sizes: list[int], queries: int) -> dict:
    result = {"backend": backend} | bench_put_get(location, puts, cache_root)
    result["lookup_ms"] = bench_lookup(location, sizes, queries)
    return result | hit_fetch_share(location)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m carnator_core.bench store", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("diskcache", "redis"), required=True)
    parser.add_argument("--url", help="Redis store URL (default: a private redis-server for the run)")
    parser.add_argument("--puts", type=int, default=5, help="Wan-sized entries written and fetched")
    parser.add_argument("--lookup-entries", default="100000,1000000", help="index sizes, comma-separated")
    parser.add_argument("--queries", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    add_record_option(parser)
    args = parser.parse_args(argv)
    if args.url and args.backend != "redis":
        parser.error("--url selects a Redis server: use it with --backend redis")
    sizes = [int(size) for size in args.lookup_entries.split(",")]
    recording = Recording(args.record, "carnator_core.bench store", argv)
    result = run(args.backend, args.url, args.puts, sizes, args.queries)
    recording.store(result, torch_threads=torch.get_num_threads())
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['backend']}: Wan 2.1 1.3B 480p 81-frame entry {result['entry_bytes'] / 2**20:.1f} MiB, "
          f"{result['entry_bytes_multistep'] / 2**20:.1f} MiB sampled by a multistep sampler (uni_pc)")
    print(f"  put {result['put_ms']:.0f} ms ({result['put_mb_s']:.0f} MiB/s), hit fetch {result['get_ms']:.0f} ms "
          f"({result['get_mb_s']:.0f} MiB/s)" + (f", from the local blob cache {result['get_local_cache_ms']:.0f} ms"
                                                  if "get_local_cache_ms" in result else ""))
    print(f"  a multistep sampler's hit also fetches its predictions: {result['get_history_ms']:.0f} ms")
    for size, ms in result["lookup_ms"].items():
        print(f"  lookup with {int(size):,} entries: {ms:.1f} ms")
    print(f"  demo-model hit: fetch {result['demo_fetch_ms']:.1f} ms vs {DEMO_STEPS // 2} saved steps of "
          f"{result['demo_step_ms']:.1f} ms = {result['hit_fetch_share']:.1%}")
    return 0

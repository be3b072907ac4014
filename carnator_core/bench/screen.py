"""Step-0 screen cost: what judging N same-noise donors costs besides the request's own first evaluation.

`python -m carnator_core.bench screen [--entries 100000] [--donors 1 16 256] [--repeats 5] [--json]`

A real on-disk store holds same-noise donors recorded as a run records them (`RunRecorder`: the step-0 record in its
own blob, checkpoints at the demo schedule's steps) on the demo model's latent; the shortlist index holds
`--entries` synthetic entries besides them, most under the same hard key. Per N, timed as one request's planning
(median over `--repeats`): the shortlist query with `screen_limit` N, `plan_probes` (each donor's metadata and
step-0 record; the checkpoints of the few donors the probe budget keeps) and the comparison of the live step-0
evaluation with every donor's (`probe_signals`). The same with no same-noise donor is the baseline. Against one
demo-model call at that latent (cond and uncond, as the request's step 0 runs), the cost per donor screened is
reported as a share of a model call, with the bytes read per donor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from carnator_core.bench.lookup import build_index
from carnator_core.bench.probe import FlowSampler, load_model, sigmas_for
from carnator_core.bench.tables.store import screen_markdown
from carnator_core.demo import world
from carnator_core.demo.text import token_embeddings
from carnator_core.lookup.fingerprint import noise_fingerprint
from carnator_core.lookup.shortlist import ShortlistIndex
from carnator_core.recorded_runs import Recording, add_record_option
from carnator_core.reuse.plan import RequestFacts, plan_probes
from carnator_core.reuse.probe import probe_signals
from carnator_core.reuse.recording import RunRecorder
from carnator_core.reuse.settings import ReuseSettings
from carnator_core.store.entry import EntryMeta, HardKey
from carnator_core.store.reuse_store import IndexEntry, IndexVectors, ReuseStore

KEY = HardKey("model-0", (21, 30, 52), "schedule-0")  # the synthetic index's main key (`bench.lookup`)
SHAPE = (1, 16, *world.CLIP)
STEPS = 30


class _CountingStore(ReuseStore):
    """A real store that counts the blob bytes it hands out."""

    bytes_read = 0

    def get_blob(self, entry_id: str, name: str) -> bytes | None:
        blob = super().get_blob(entry_id, name)
        self.bytes_read += len(blob) if blob is not None else 0
        return blob


def record_donors(store: ReuseStore, count: int, start: torch.Tensor, generator: torch.Generator) -> list[IndexEntry]:
    """`count` donors made from the initial state `start`, recorded through the recorder's own code."""
    sigmas = sigmas_for(STEPS)
    entries = []
    for number in range(count):
        recorder = RunRecorder(set(ReuseSettings().checkpoint_steps(STEPS)))
        for step in sorted(recorder.checkpoint_steps):
            x0, guidance = torch.randn(SHAPE, generator=generator), torch.randn(SHAPE, generator=generator)
            if step == 0:
                recorder.capture_start(sigmas[0], noise_fingerprint(start), x0, guidance)
            else:
                recorder.capture(step, sigmas[step], torch.randn(SHAPE, generator=generator), x0, guidance)
        listing, blobs = recorder.blobs()
        meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=KEY, prompt=f"donor {number}", latent_shape=SHAPE,
                         noise_fingerprint=noise_fingerprint(start), total_steps=STEPS, checkpoints=listing)
        vectors = IndexVectors(text=torch.nn.functional.normalize(torch.randn(384, generator=generator), dim=0),
                               cond=torch.nn.functional.normalize(torch.randn(256, generator=generator), dim=0))
        store.put(meta, blobs, vectors)
        entries.append(IndexEntry(meta.entry_id, KEY, meta.prompt, vectors, noise=meta.noise_fingerprint))
    return entries


def plan_and_screen(index: ShortlistIndex, store: ReuseStore, start: torch.Tensor, live: tuple[torch.Tensor, ...],
                    limit: int, query: IndexVectors) -> int:
    """One request's planning with `limit` same-noise donors screened; returns the donors compared at step 0."""
    settings = ReuseSettings()
    result = index.query(KEY, query.cond, query.text, settings.top_k, settings.min_similarity,
                         noise=noise_fingerprint(start), same_noise_limit=limit)
    facts = RequestFacts(schedule=KEY.schedule, latent_shape=SHAPE, noise_fingerprint=noise_fingerprint(start),
                         total_steps=STEPS)
    targets, _ = plan_probes(store, result.candidates, facts, settings.max_resume_fraction, same_noise_only=True,
                             max_probes=settings.max_probes)
    starts = [target.start for target in targets if target.start is not None]
    x0_live, guidance_live = live
    for record in starts:
        probe_signals(0.0, start, x0_live, record.x0, guidance_live, record.guidance)
    return len(starts)


def model_call_ms(repeats: int, weights: str | None) -> float:
    """One demo-model evaluation (cond and uncond) at the benchmark's latent, median of `repeats`."""
    sampler = FlowSampler(load_model(weights), 4.0, sigmas_for(STEPS))
    context, uncond = token_embeddings(["a red ball moving right on a black background"]), token_embeddings([""])
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    sampler.predict(x, sampler.sigmas[0], context, uncond)  # warm-up
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        sampler.predict(x, sampler.sigmas[0], context, uncond)
        timings.append(time.perf_counter() - started)
    return statistics.median(timings) * 1e3


def bench_screen(entries: int, donor_counts: list[int], repeats: int, weights: str | None) -> dict:
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(SHAPE, generator=generator)
    live = (torch.randn(SHAPE, generator=generator), torch.randn(SHAPE, generator=generator))
    query = IndexVectors(text=torch.nn.functional.normalize(torch.randn(384, generator=generator), dim=0),
                         cond=torch.nn.functional.normalize(torch.randn(256, generator=generator), dim=0))
    call_ms = model_call_ms(repeats, weights)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        store = _CountingStore(directory)
        index, _, _ = build_index(entries, generator)
        index.add_many(record_donors(store, max(donor_counts), start, generator))
        for limit in [0, *donor_counts]:
            timings, screened, read = [], 0, 0
            for _ in range(repeats + 1):  # the first fills the OS file cache, as earlier requests would have
                store.bytes_read = 0
                started = time.perf_counter()
                screened = plan_and_screen(index, store, start, live, limit, query)
                timings.append(time.perf_counter() - started)
                read = store.bytes_read
            rows.append({"donors": limit, "screened": screened, "plan_ms": statistics.median(timings[1:]) * 1e3,
                         "bytes_read": read})
        store.close()
    baseline = rows[0]
    for row in rows[1:]:
        extra = max(1, row["screened"] - baseline["screened"])
        row["ms_per_donor"] = (row["plan_ms"] - baseline["plan_ms"]) / extra
        row["share_of_model_call_per_donor"] = row["ms_per_donor"] / call_ms
        row["bytes_per_donor"] = (row["bytes_read"] - baseline["bytes_read"]) / extra
    return {"entries": entries, "latent_shape": list(SHAPE), "model_call_ms": call_ms, "rows": rows}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m carnator_core.bench screen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=100_000, help="synthetic entries in the shortlist index")
    parser.add_argument("--donors", type=int, nargs="+", default=[1, 16, 256], help="same-noise donors screened")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--weights", help="demo model .safetensors (default: $CARNATOR_DEMO_WEIGHTS, else shipped)")
    parser.add_argument("--json", action="store_true")
    add_record_option(parser)
    args = parser.parse_args(argv)
    recording = Recording(args.record, "carnator_core.bench screen", argv)
    result = bench_screen(args.entries, sorted(set(args.donors)), args.repeats, args.weights)
    recording.store(result, torch_threads=torch.get_num_threads())
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"step-0 screen on the demo latent {tuple(result['latent_shape'])}, index of {result['entries']} entries; "
          f"one model call {result['model_call_ms']:.1f} ms")
    print(screen_markdown(result))
    return 0

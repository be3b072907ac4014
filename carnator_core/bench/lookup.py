"""Lookup latency: shortlist queries against an index of N synthetic entries.

`python -m carnator_core.bench lookup [--entries 100000] [--queries 200] [--json]`

Entries carry MiniLM-sized text vectors and projected conditioning vectors; a share of them
sits under other hard keys (other models, grids, schedules) as in a real shared store.
Figures: the query alone (index in memory, as every request after the first sees it), how
often a near-duplicate of a stored entry finds it first (large groups are searched through
their nearest index lists only), and the one-time index build from a real on-disk store
(`--store-entries`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from carnator_core.lookup.shortlist import ShortlistIndex
from carnator_core.recorded_runs import Recording, add_record_option
from carnator_core.store.entry import EntryMeta, HardKey
from carnator_core.store.reuse_store import IndexEntry, IndexVectors, ReuseStore


def _unit(rows: int, width: int, generator: torch.Generator) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(rows, width, generator=generator), dim=1)


def _keys(count: int) -> list[HardKey]:
    """80% of entries share the queried key; the rest spread over 20 other keys."""
    main = HardKey("model-0", (21, 30, 52), "schedule-0")
    others = [HardKey(f"model-{i % 4}", (21, 30, 52), f"schedule-{i}") for i in range(1, 21)]
    return [main if i % 5 else others[i % len(others)] for i in range(count)]


def build_index(entries: int, generator: torch.Generator, keep: set[int] = frozenset(), batch: int = 10_000
                ) -> tuple[ShortlistIndex, list[HardKey], dict[int, IndexVectors]]:
    """An index of `entries` synthetic entries, added in batches as a store refresh adds them; also the
    vectors of the entries numbered in `keep`."""
    index = ShortlistIndex()
    keys = _keys(entries)
    kept = {}
    for start in range(0, entries, batch):
        count = min(batch, entries - start)
        texts, conds = _unit(count, 384, generator), _unit(count, 256, generator)
        vectors = [IndexVectors(text=texts[i], cond=conds[i]) for i in range(count)]
        index.add_many([IndexEntry(f"e{start + i}", keys[start + i], f"prompt {start + i}", vectors[i])
                        for i in range(count)])
        kept |= {number: vectors[number - start] for number in keep if start <= number < start + count}
    return index, keys, kept


def _near(vector: torch.Tensor, cosine: float, generator: torch.Generator) -> torch.Tensor:
    """A unit vector at exactly `cosine` to the unit vector `vector`."""
    noise = torch.randn(vector.shape, generator=generator)
    noise = torch.nn.functional.normalize(noise - (noise @ vector) * vector, dim=0)
    return cosine * vector + (1 - cosine**2) ** 0.5 * noise


def planted_recall(index: ShortlistIndex, keys: list[HardKey], planted: dict[int, IndexVectors], top_k: int,
                   cosine: float = 0.9) -> float:
    """Share of near-duplicate queries (text and conditioning at `cosine` to one stored entry) that rank it first.

    Random vectors have no neighbourhoods, so this is the case that matters for reuse: a request
    close to one earlier request must find it although a large group is searched only in part.
    """
    generator = torch.Generator().manual_seed(2)
    found = 0
    for number, vectors in planted.items():
        result = index.query(keys[number], _near(vectors.cond, cosine, generator),
                             _near(vectors.text, cosine, generator), top_k, 0.0)
        found += bool(result.candidates) and result.candidates[0].entry_id == f"e{number}"
    return found / max(1, len(planted))


def bench_query(entries: int, queries: int, top_k: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    planted = set(range(0, entries, max(1, entries // 100)))
    index, keys, kept = build_index(entries, generator, planted)
    add_seconds = time.perf_counter() - started
    query_texts, query_conds = _unit(queries, 384, generator), _unit(queries, 256, generator)
    index.query(keys[1], query_conds[0], query_texts[0], top_k, 0.0)  # warm-up
    timings = []
    for i in range(queries):
        started = time.perf_counter()
        index.query(keys[1], query_conds[i], query_texts[i], top_k, 0.0)
        timings.append(time.perf_counter() - started)
    return {"entries": entries, "query_ms": statistics.median(timings) * 1e3,
            "query_p95_ms": sorted(timings)[int(0.95 * len(timings))] * 1e3, "index_add_s": add_seconds,
            "planted_recall": planted_recall(index, keys, kept, top_k)}


def bench_store_build(entries: int) -> dict[str, float]:
    """Time to fill an index from a real store directory (what a fresh process pays once)."""
    generator = torch.Generator().manual_seed(1)
    with tempfile.TemporaryDirectory() as directory:
        store = ReuseStore(directory)
        texts, conds, keys = _unit(entries, 384, generator), _unit(entries, 256, generator), _keys(entries)
        for i in range(entries):
            meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=keys[i], prompt=f"prompt {i}")
            store.put(meta, {}, IndexVectors(text=texts[i], cond=conds[i]))
        started = time.perf_counter()
        index = ShortlistIndex()
        index.refresh(store)
        build = time.perf_counter() - started
        store.close()
    return {"store_entries": entries, "index_build_s": build, "index_build_ms_per_1k": build / entries * 1e6}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m carnator_core.bench lookup", description=__doc__)
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--store-entries", type=int, default=10_000)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    add_record_option(parser)
    args = parser.parse_args(argv)
    recording = Recording(args.record, "carnator_core.bench lookup", argv)
    result = bench_query(args.entries, args.queries, args.top_k) | bench_store_build(args.store_entries)
    recording.store(result, torch_threads=torch.get_num_threads())
    if args.json:
        print(json.dumps(result))
    else:
        print(f"lookup over {result['entries']} entries: median {result['query_ms']:.2f} ms, "
              f"p95 {result['query_p95_ms']:.2f} ms (index in memory); near-duplicate found first in "
              f"{result['planted_recall']:.0%} of queries")
        print(f"index build from a store of {result['store_entries']} entries: {result['index_build_s']:.2f} s "
              f"({result['index_build_ms_per_1k']:.0f} ms per 1k entries)")
    return 0

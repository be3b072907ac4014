"""Exact repeats: what the same request queued again costs, against sampling it plain.

`python -m carnator_core.bench exact-repeats [--n 8] [--steps 30] [--json] [--record NAME]`

On a headless ComfyUI with the demo model and the official Wan 2.1 template's sampler settings (uni_pc, simple,
cfg 6, shift 8): each of `--n` prompts of the unrelated stream is sampled once through CarnatorReuse, which records it
(its first run); then each is queued again, interleaved with the same prompt sampled plain (no Carnator node; which
of the two goes first alternates from prompt to prompt). Per prompt: the repeat's verdict, model calls and sampler
time against plain's, and whether its latent is the first run's bit for bit. The store gives the entry size: bytes
per entry, and the output blob that makes an entry repeatable.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from carnator_core.bench.streams import make_stream
from carnator_core.bench.tables.exact_repeats import exact_repeats_markdown
from carnator_core.bench.workload_configurations import DENSE_ATTENTION, store_dir
from carnator_core.bench.workload_stream import Bench, Sample
from carnator_core.client import ComfyError
from carnator_core.comfyui_location import ComfyNotFound, find_comfyui
from carnator_core.demo import graphs
from carnator_core.demo.server import DemoSetupError, demo_server, demo_weights
from carnator_core.recorded_runs import Recording, add_record_option, comfyui_version
from carnator_core.reuse.report import Verdict
from carnator_core.store.reuse_store import ReuseStore
from carnator_core.store.stages import final_blob

STORE = store_dir("exact-repeats")
MAX_CALLS = 2  # the target: an exact repeat costs at most this many model calls


def _graph(unet: str, prompt: str, steps: int, record: bool) -> dict:
    """The demo graph with the Wan 2.1 template's sampler settings; with `record`, one CarnatorReuse before it."""
    graph = graphs.base_graph(unet, prompt, seed=42, steps=steps, cfg=6.0, sampler_name="uni_pc", scheduler="simple")
    graph[graphs.MODEL_CHAIN]["inputs"]["shift"] = 8.0
    return graphs.with_reuse(graph, STORE, prompt, sparse_attention="off") if record else graph


def _row(prompt: str, first: Sample, plain: Sample, repeat: Sample) -> dict:
    return {"prompt": prompt, "first_calls": first.model_calls, "plain_calls": plain.model_calls,
            "plain_seconds": plain.seconds, "repeat_calls": repeat.model_calls, "repeat_seconds": repeat.seconds,
            "verdict": repeat.verdict.value, "identical": bool(torch.equal(repeat.latent, first.latent)),
            "plain_identical": bool(torch.equal(plain.latent, first.latent))}


def entry_sizes(directory: Path) -> dict[str, float]:
    """Mean bytes per entry of the store at `directory`, and of the output blob an exact repeat is served from."""
    store = ReuseStore(str(directory))
    try:
        ids = list(store.entry_ids())
        finals = [len(store.get_blob(entry_id, final_blob(0)) or b"") for entry_id in ids]
        totals = store.totals()
    finally:
        store.close()
    return {"entries": len(ids), "bytes_per_entry": totals["bytes"] / max(1, totals["entries"]),
            "final_bytes_per_entry": statistics.fmean(finals) if finals else 0.0}


def summarise(rows: list[dict], sizes: dict[str, float]) -> dict:
    exact = [row for row in rows if row["verdict"] == Verdict.EXACT_REPEAT.value]
    calls = statistics.median(row["repeat_calls"] for row in rows)
    plain_calls = statistics.median(row["plain_calls"] for row in rows)
    time_ratios = sorted(row["plain_seconds"] / row["repeat_seconds"] for row in rows)
    return {"repeats": len(rows), "exact": len(exact), "identical": sum(row["identical"] for row in rows),
            "median_calls": calls, "plain_median_calls": plain_calls, "calls_ratio": plain_calls / calls,
            "time_ratio": statistics.median(time_ratios), "time_ratio_range": [time_ratios[0], time_ratios[-1]],
            **sizes,
            "targets": {"at_most_two_calls": {"target": MAX_CALLS, "value": max(r["repeat_calls"] for r in rows),
                                              "met": all(r["repeat_calls"] <= MAX_CALLS for r in rows)},
                        "bit_identical": {"value": sum(r["identical"] for r in rows), "of": len(rows),
                                          "met": all(r["identical"] for r in rows)}}}


def run(prompts: list[str], steps: int, weights: Path, say) -> tuple[list[dict], dict[str, float]]:
    base_dir = Path(tempfile.mkdtemp(prefix="carnator-bench-"))
    say(f"starting ComfyUI headless (base directory {base_dir}) ...")
    try:
        with demo_server(base_dir, weights, extra_args=DENSE_ATTENTION, env={"OMP_NUM_THREADS": "1"}) as (client,
                                                                                                       unet):
            bench = Bench(client, base_dir)
            firsts = []
            for number, prompt in enumerate(prompts, 1):
                firsts.append(bench.sample_recorded("first", _graph(unet, prompt, steps, True), steps, store=STORE,
                                                    entries=number))
                say(f"[{number}/{len(prompts)}] recorded {prompt!r}: {firsts[-1].model_calls} calls")
            rows = []
            for number, (prompt, first) in enumerate(zip(prompts, firsts, strict=True), 1):
                order = ("plain", "repeat") if number % 2 else ("repeat", "plain")
                ran = {name: bench.sample(name, _graph(unet, prompt, steps, name == "repeat"), steps)
                       for name in order}
                rows.append(_row(prompt, first, ran["plain"], ran["repeat"]))
                say(f"[{number}/{len(prompts)}] again: {rows[-1]['verdict']}, {rows[-1]['repeat_calls']} calls "
                    f"({'the first run bit for bit' if rows[-1]['identical'] else 'NOT the first run'}); plain "
                    f"{rows[-1]['plain_calls']} calls")
        return rows, entry_sizes(base_dir / STORE)
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m carnator_core.bench exact-repeats", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=8, help="prompts, each recorded and then queued again")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--weights", help="demo model .safetensors (default: $CARNATOR_DEMO_WEIGHTS, else shipped)")
    parser.add_argument("--json", action="store_true", help="print only the result object as JSON")
    add_record_option(parser)
    args = parser.parse_args(argv)
    if args.n < 1 or args.steps < 2:
        parser.error("needs --n >= 1 and --steps >= 2")

    def say(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    try:
        weights = demo_weights(args.weights)
        recording = Recording(args.record, "carnator_core.bench exact-repeats", argv)
        prompts = make_stream("unrelated", args.n)
        rows, sizes = run(prompts, args.steps, weights, say)
        comfyui = comfyui_version(find_comfyui())
    except (ComfyNotFound, DemoSetupError, ComfyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    result = {"settings": {"steps": args.steps, "sampler": "uni_pc", "scheduler": "simple", "cfg": 6.0, "shift": 8.0,
                           "seed": 42, "server_threads": 1, "comfyui_args": list(DENSE_ATTENTION)},
              "summary": summarise(rows, sizes), "rows": rows}
    recording.store(result, comfyui=comfyui, torch_threads=1)
    print(json.dumps(result) if args.json else exact_repeats_markdown(result))
    return 0 if result["summary"]["targets"]["bit_identical"]["met"] else 1

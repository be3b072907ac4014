"""Workload benchmark: a prompt stream through a real headless ComfyUI, every configuration side by side.

    python -m carnator_core.bench workload --stream {near-dup,unrelated,mixed,adversarial,edit-loop}
        [--prompts FILE] [--graph single|two-expert] [--n 6] [--seed fixed|random] [--steps 30] [--cfg 1.0]
        [--weights FILE] [--threads 1] [--attention-heavy] [--shared-store] [--json] [--out DIR] [--record NAME]

Configurations (each with its own store directory, all in one server so they share the loaded model):
plain · easycache (ComfyUI's EasyCache) · text-only (CarnatorReuse verification=text-only: skip depth from
prompt similarity, no probe, NIRVANA/Chorus style) · own-masks (CarnatorSparseAttention, online masks) ·
any-donor-masks (CarnatorSparseAttention borrowed+own, masks of an unrelated donor prompt via a
CarnatorCompatibilityLookup fed that prompt's conditioning) · safe · balanced · fast (CarnatorReuse modes,
node defaults) · balanced+easycache · plain-<n>: plain at n = steps // 2, steps // 3 and steps // 4 steps (same seed,
sampler and scheduler), named by their step count (plain-15, plain-10, plain-7 at 30 steps). A fraction whose step
count is 0 or one a larger fraction already runs has no configuration (a progress line says so): `--steps 2` runs
plain-1 alone, `--steps 4` plain-2 and plain-1.

Every other configuration's `equal_quality_speedup`, but for the step caches (EasyCache), whose leftover noise the
detail measure would count as detail, weighs it by the one yardstick the calibration also uses
(`bench.yardstick`: as adherent, as close to plain by PSNR, as detailed) against the cheapest plain run as good: of
those fewer-steps runs and of the plain-steps curve, plain sampled after the stream at the step counts that bracket
each configuration's quality (`bench.plain_steps_curve`, at most three more counts), else full plain. It gives that
run's mean model calls over the configuration's with a 90 % bootstrap interval over the requests, the words ("saves
1.61x (...)", "lower the steps instead", "not settled"), the steps plain needs and the measure that decided; and the
median time ratio where that run is one of the interleaved rows (the curve's runs are not timed against the stream).
A hit is a request that skipped steps (resumed, or a stage skipped);
`masks_only_rate` is the share that borrowed a donor's attention masks and sampled every step.

Method: one prompt at a time, every configuration on it, the order rotated per prompt so that machine drift
(other processes on a shared CPU) spreads over all configurations. A configuration's time is the wall time
of the nodes it adds plus the sampler's (per-node times from ComfyUI's websocket, never past the prompt's end as the
server stamped it: `PromptRun`); text encoding, model loading and file saving are the same everywhere and left out.
The server's torch runs on `--threads` threads (1 by default): on a CPU the sampler then takes one core and the rest
serve ComfyUI's own threads and Carnator's background work, as a GPU server's CPU does beside its sampling, and
identical runs spread less than with every core shared between them. Every configuration first runs once on a
throwaway prompt (2 steps, plain-<n> its n; separate stores) so that no timed run pays for loading a model or a
kernel. After a run that records, the benchmark waits until the server's background writer has stored the entry,
so the write neither overlaps the next timed run nor is missed by the next lookup. Quality: PSNR/SSIM of the
decoded clip against the same prompt's plain clip (same seed), and the demo oracle's adherence (share of
shape, colour, motion and background that match the prompt; prompts it cannot parse are left out).

`--graph two-expert` runs the stream on the Wan 2.2 14B template's shape instead: the demo model as both experts,
each loader -> ModelSamplingSD3 -> (CarnatorReuse) -> KSamplerAdvanced, the first sampling to the half-way boundary
with leftover noise and the second continuing; configurations plain, its plain-<n> (the boundary at n // 2, at
least 1), safe, balanced and fast, and the first expert's calls per request reported apart. Every table also gives
the calls and the speedup of the requests that resumed; `edit-loop` adds which kinds of edit resumed and how deep.

`--shared-store` has safe, balanced and fast look up in one store, each prompt recorded there by one of them in turn,
which runs it after the others: every mode meets the same donors, recorded by requests in every mode, and none meets
its own prompt's; the nesting check (`nesting`) then
compares the modes on the same store: per prompt, steps skipped beside model calls.

`--attention-heavy` adds a timing-only configuration: a random-weight Wan 2.1 model on >= 4k video tokens,
where attention dominates a step as in full-size models, plain versus CarnatorSparseAttention with own masks.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from carnator_core.bench import plot, stages
from carnator_core.bench.plain_steps_curve import MAX_LOWERED_COUNTS, next_count
from carnator_core.bench.quality import PSNR_IDENTICAL, detail_ratio, mse, psnr_from_mse, ssim
from carnator_core.bench.random_wan import write_random_wan
from carnator_core.bench.stages import STAGED_GRAPHS
from carnator_core.bench.streams import KINDED_STREAMS, STREAMS, edit_kinds, make_stream
from carnator_core.bench.yardstick import FULL, RequestOutcome, curve_row, equal_quality, falls_short
from carnator_core.client import ComfyClient, ComfyError, PromptRun
from carnator_core.comfyui_location import ComfyNotFound, find_comfyui
from carnator_core.demo import graphs, world
from carnator_core.demo.oracle import score
from carnator_core.demo.server import DemoSetupError, demo_server, demo_weights
from carnator_core.demo.wan_model import WanConfig
from carnator_core.judging.fewer_steps import fewer_steps, fewer_steps_count, step_count
from carnator_core.prompt_file import RULE as PROMPT_FILE_RULE
from carnator_core.prompt_file import read_prompt_file
from carnator_core.recorded_runs import Recording, add_record_option, comfyui_version
from carnator_core.reuse.report import RunReport, Verdict
from carnator_core.store.reuse_store import ReuseStore

CONFIGS = ("plain", "easycache", "text-only", "own-masks", "any-donor-masks", "safe", "balanced", "fast",
           "balanced+easycache")
FIELDS = ("speedup", "model_calls", "hit_rate", "masks_only_rate", "attention_density", "psnr", "ssim", "detail",
          "adherence",
          "bytes_per_entry")
# Plain's median server CPU time / this configuration's (None where unknown); the mean model calls and the speedup
# (plain's median time / the hits' median time) of the requests that resumed (None without one); the mean model calls
# per request of each stage, in stage order (two-expert graph: first and second expert; else the one sampler); the
# configuration against the cheapest plain run of as good a quality (`equal_quality_speedup`; None for plain runs).
EXTRA_FIELDS = ("cpu_speedup", "hit_model_calls", "hit_speedup", "stage_model_calls", "equal_quality_speedup")
# The two-expert graph (`--graph two-expert`, the Wan 2.2 14B template's shape): plain and the reuse modes, one
# CarnatorReuse on each expert.
TWO_EXPERT_CONFIGS = ("plain", "safe", "balanced", "fast")
# What each stream must show, by configuration (the benchmark's JSON reports each as measured and met or not):
# calls_speedup: plain's mean model calls over the configuration's; adherence_gap: the mean adherence the
# configuration loses against plain; extra_calls: the most model calls one request makes beyond plain's;
# time_speedup: plain's median time over the configuration's (on the unrelated stream: what a miss costs).
STREAM_TARGETS: dict[str, dict[str, dict[str, float]]] = {
    "edit-loop": {"fast": {"calls_speedup": 2.0, "adherence_gap": 0.01},
                  "balanced": {"calls_speedup": 1.5, "adherence_gap": 0.01}},
    "near-dup": {"fast": {"calls_speedup": 1.6}},
    "adversarial": {mode: {"adherence_gap": 0.0} for mode in ("safe", "balanced", "fast")},
    "unrelated": {mode: {"extra_calls": 1.0, "time_speedup": 0.97} for mode in ("safe", "balanced", "fast")},
}
AT_LEAST = frozenset({"calls_speedup", "time_speedup"})  # the measures a target bounds from below, the others above
# Configurations that skip steps by extrapolating the model's output within a request: what they leave of the noise
# reads as high-frequency detail, so the yardstick's detail measure would credit it, and they are not weighed.
STEP_CACHES = frozenset({"easycache", "balanced+easycache"})
RECORDING = frozenset({"text-only", "safe", "balanced", "fast", "balanced+easycache"})  # their runs add entries
# `--shared-store`: these modes look up in one store, and each prompt is recorded there by one of them in turn, so
# that every mode meets the same donors, recorded by requests in every mode.
SHARED_MODES = ("safe", "balanced", "fast")
SHARED_STORE = "shared"
WARMUP_PROMPT = "a green square resting on a white background"
WARMUP_STEPS = 2
DONOR_SEED = 987654321
EASYCACHE_LINE = re.compile(r"EasyCache - skipped (\d+)/(\d+) steps")
# ComfyUI's CPU default for dense attention is its sub-quadratic chunked kernel, far slower than PyTorch's
# SDPA; every dense call (plain, and the dense steps/layers of the sparse configurations) uses SDPA instead,
# so that speedups measure sparsity and reuse, not a kernel swap.
DENSE_ATTENTION = ("--use-pytorch-cross-attention",)
HEAVY_CLIP = (9, 48, 48)  # 9 x 24 x 24 = 5184 video tokens after Wan's 1x2x2 patches
HEAVY_MODEL = WanConfig(dim=256, ffn_dim=1024, num_layers=2)
HEAVY_STEPS = 8
# Random weights attend almost uniformly (no structure to find), so the mask density is capped: the
# configuration measures what a given density buys end to end, not whether the masks are right. A 2-layer
# model has no interior layers, so the dense edge blocks (2 of 30 in Wan 1.3B) are switched off here.
# own-masks and any-donor-masks measure the masks themselves, so every mask runs sparse however full it is and
# however few the tokens (the node's defaults run masks fuller than 0.6 dense, and the demo's 320 tokens dense whole).
MASKS_ALWAYS_SPARSE = {"dense_above": 1.0, "min_tokens": 0}
HEAVY_ATTENTION = {"max_density": 0.25, "dense_first_blocks": 0, "dense_last_blocks": 0}


def _store_dir(name: str, prefix: str = "stores") -> str:
    return f"{prefix}/{re.sub('[^a-z0-9]+', '_', name)}"


def expert_boundary(steps: int) -> int:
    """The two-expert graph's hand-over step: half-way, and after the one step of a 1-step run (a first expert
    that ends at step 0 would hand over its latent without the noise)."""
    return max(1, steps // 2)


def config_graph(name: str, base: dict, prompt: str, donor_prompt: str, store_prefix: str = "stores",
                 seed_policy: str = "same-noise", shared: bool = False, records: bool = True) -> dict:
    """The base demo graph with configuration `name` spliced in front of its sampler (plain at fewer steps: the
    base graph with its sampler's steps lowered). `shared`: its reuse node uses the store of `SHARED_STORE`, and
    records there only where `records`."""
    steps = fewer_steps_count(name)
    if steps is not None:
        graph = copy.deepcopy(base)
        graph[graphs.SAMPLER]["inputs"]["steps"] = steps
        return graph
    store = _store_dir(SHARED_STORE if shared else name, store_prefix)
    record = {} if records else {"record": False}

    def reuse(graph: dict, **options) -> dict:
        return graphs.with_reuse(graph, store, prompt, seed_policy=seed_policy, **record, **options)

    def any_donor() -> dict:
        graph, match = graphs.with_donor_lookup(base, store, donor_prompt)
        return graphs.with_sparse_attention(graph, "borrowed+own", match, **MASKS_ALWAYS_SPARSE)

    builders: dict[str, Callable[[], dict]] = {
        "plain": lambda: base,
        "easycache": lambda: graphs.with_easycache(base),
        "text-only": lambda: reuse(base, mode="balanced", verification="text-only", sparse_attention="off"),
        "own-masks": lambda: graphs.with_sparse_attention(base, "own", **MASKS_ALWAYS_SPARSE),
        "any-donor-masks": any_donor,
        "safe": lambda: reuse(base, mode="safe"),
        "balanced": lambda: reuse(base, mode="balanced"),
        "fast": lambda: reuse(base, mode="fast"),
        "balanced+easycache": lambda: graphs.with_easycache(reuse(base, mode="balanced")),
    }
    return builders[name]()


def donor_prompt_for(prompts: list[str]) -> str:
    """A canonical prompt as far from every scorable stream prompt as the world allows (the arbitrary donor)."""
    parsed = [p for p in (world.parse_prompt(x) for x in prompts) if p is not None]

    def closest_overlap(attrs: dict[str, str]) -> int:  # attributes shared with the most similar stream prompt
        return max((sum(attrs[k] == p[k] for k in world.ATTRIBUTES) for p in parsed), default=0)

    return world.canonical_prompt(min(world.all_attribute_sets(), key=closest_overlap))


@dataclass
class Sample:
    """One configuration on one prompt."""

    seconds: float
    model_calls: int
    verdict: Verdict  # the strongest of its sampling runs' (two experts: two runs)
    skipped_steps: int
    density: float
    rgb: torch.Tensor
    report: dict | None
    quality: dict[str, Any] = field(default_factory=dict)
    cpu_seconds: float | None = None  # the server's CPU time for the whole prompt and its background store write
    first_expert_calls: int | None = None  # two-expert graph: the first expert's model calls

    @property
    def hit(self) -> bool:
        """Whether the request skipped steps: what a reuse hit saves is model calls, which borrowed masks do not."""
        return self.verdict.skips_steps

    @property
    def masks_only(self) -> bool:
        return self.verdict is Verdict.MASKS_BORROWED


class Bench:
    """The server session: queue graphs, time them, read back latents, reports and the EasyCache log."""

    def __init__(self, client: ComfyClient, base_dir: Path) -> None:
        self.client, self.base_dir = client, base_dir
        self.object_info = client.object_info()
        self.log = base_dir / "comfyui.log"
        self.counter = 0

    def server_cpu_seconds(self) -> float | None:
        """The server process's user+system CPU time so far (Linux /proc), None when unknown.

        On a shared machine wall times of identical runs spread by +-30 % (other tenants take the second
        core); with one torch thread the CPU time is the work itself, so the CPU ratio is the steadier one.
        """
        pid = self.client.server_pid
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError, TypeError):
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def run(self, graph: dict) -> tuple[PromptRun, str]:
        """Execute `graph`; returns the run and the server log lines it produced."""
        start = self.log.stat().st_size if self.log.exists() else 0
        run = self.client.run(graphs.complete(graph, self.object_info))
        with self.log.open("rb") as handle:
            handle.seek(start)
            log = handle.read().decode(errors="replace")
        return run, log

    def sample(self, name: str, graph: dict, steps: int, boundary: int | None = None) -> Sample:
        """One request; with `boundary` (two-expert graph) the model calls add up over both experts' reports and the
        first expert's are kept apart."""
        self.counter += 1
        graph = graphs.with_save_latent(graph, f"bench/{_store_dir(name, '')[1:]}_{self.counter:04d}")
        run, log = self.run(graph)
        saved = run.history["outputs"][graphs.SAVE_LATENT]["latents"][0]
        latent = load_file(str(self.base_dir / "output" / saved["subfolder"] / saved["filename"]))["latent_tensor"]
        reports = [r for r in run.reports if "model_calls" in r]
        report = (run.reports or [None])[0]
        skipped_by_easycache = sum(int(m.group(1)) for m in EASYCACHE_LINE.finditer(log))
        calls = sum(r["model_calls"] for r in reports) if reports else steps
        density = report.get("attention_density") if report else None
        first_expert = None if boundary is None else (reports[0]["model_calls"] if reports else boundary)
        return Sample(seconds=run.seconds_except(graphs.SHARED_NODES), model_calls=calls - skipped_by_easycache,
                      verdict=Verdict.strongest(RunReport.from_dict(r).verdict for r in run.reports),
                      skipped_steps=sum(int(r.get("skipped_steps", 0)) for r in reports),
                      density=1.0 if density is None else float(density),
                      rgb=world.decode(world.from_raw(latent[0].float())), report=report,
                      first_expert_calls=first_expert)

    def sample_recorded(self, name: str, graph: dict, steps: int, boundary: int | None = None, *,
                        store: str | None = None, entries: int = 0) -> Sample:
        """`sample`, then, for a configuration that records into `store`, the wait until the server's background
        writer has stored `entries` entries; the server's CPU time over both is the sample's `cpu_seconds`."""
        cpu_before = self.server_cpu_seconds()
        sample = self.sample(name, graph, steps, boundary)
        if store is not None:
            self.wait_for_entries(store, entries)
        cpu_after = self.server_cpu_seconds()
        if cpu_before is not None and cpu_after is not None:
            sample.cpu_seconds = cpu_after - cpu_before
        return sample

    def wait_for_entries(self, store: str, count: int, timeout: float = 60.0) -> dict[str, float]:
        """Store totals once the server's background writer has stored `count` entries."""
        deadline = time.monotonic() + timeout
        while True:
            totals = store_totals(self.base_dir / store)
            if totals["entries"] >= count or time.monotonic() > deadline:
                return totals
            time.sleep(0.05)


def _bytes_per_entry(directory: Path) -> float:
    totals = store_totals(directory)
    return totals["bytes"] / max(1, totals["entries"])


def store_totals(directory: Path) -> dict[str, float]:
    if not directory.exists():
        return {"entries": 0, "bytes": 0}
    store = ReuseStore(str(directory))
    try:
        return store.totals()
    finally:
        store.close()


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _median_seconds(runs: list[Sample]) -> float:
    return _median([s.seconds for s in runs])


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _mean_calls(runs: list[Sample]) -> float:
    return sum(s.model_calls for s in runs) / len(runs)


def _adherence(runs: list[Sample]) -> float | None:
    return _mean([s.quality["adherence"] for s in runs])


def equal_quality_speedup(runs: list[Sample], plain: list[Sample], fewer: dict[str, list[Sample]], steps: int,
                          timed: frozenset[str] = frozenset()) -> dict[str, Any]:
    """`runs` weighed by the yardstick (`bench.yardstick`) against full `plain` and the plain runs at fewer steps
    (`fewer`, by name): the cheapest as good, its calls over theirs with the interval, and its median time over
    theirs where it is one of the `timed` configurations (run interleaved with the others), else None."""
    weighed = equal_quality([_outcome(s) for s in runs], [_outcome(s) for s in plain],
                            {fewer_steps_count(name): [_outcome(s) for s in samples] for name, samples in fewer.items()},
                            steps)
    reference = fewer.get(weighed.against, plain)
    timed_reference = weighed.against == FULL or weighed.against in timed
    return {**weighed.as_dict(),
            "time": round(_median_seconds(reference) / _median_seconds(runs), 3) if timed_reference else None}


def curve_table(samples: dict[str, list[Sample]], curve: dict[str, list[Sample]], steps: int) -> list[dict[str, Any]]:
    """Every plain run the stream weighs against, fewest steps first: its calls and the yardstick's three measures."""
    runs = {steps: samples["plain"], **{fewer_steps_count(name): runs for name, runs in {**samples, **curve}.items()
                                        if fewer_steps_count(name) is not None}}
    return [{**curve_row(count, [_outcome(s) for s in runs[count]]), "bisected": f"plain-{count}" in curve}
            for count in sorted(runs)]


def _outcome(sample: Sample) -> RequestOutcome:
    return RequestOutcome(model_calls=sample.model_calls, mse=sample.quality["mse"], detail=sample.quality["detail"],
                          adherence=sample.quality["adherence"])


def plain_steps_curve(samples: dict[str, list[Sample]], curve: dict[str, list[Sample]], steps: int,
                      sample_at: Callable[[int, int], Sample], prompts: list[str],
                      progress: Callable[[str], None]) -> None:
    """Plain at the step counts that bracket each weighed configuration's quality (`bench.plain_steps_curve`),
    sampled on every prompt (`sample_at(prompt index, steps)`) and scored into `curve` by name, beside the fixed
    fewer-steps runs already in `samples`."""
    weighed = {name: runs for name, runs in samples.items()
               if name != "plain" and name not in STEP_CACHES and fewer_steps_count(name) is None}

    def lowered() -> dict[int, list[Sample]]:
        return {fewer_steps_count(name): runs for name, runs in {**samples, **curve}.items()
                if fewer_steps_count(name) is not None}

    def judge(runs: list[Sample]) -> Callable[[int], bool]:
        return lambda n: falls_short([_outcome(s) for s in lowered()[n]], [_outcome(s) for s in runs],
                                     [_outcome(s) for s in samples["plain"]]) is None

    for _ in range(MAX_LOWERED_COUNTS):
        count = next_count(steps, lowered(), [judge(runs) for runs in weighed.values()])
        if count is None:
            return
        progress(f"plain-steps curve: plain at {step_count(count)} on every prompt")
        runs = [sample_at(i, count) for i in range(len(prompts))]
        curve[f"plain-{count}"] = runs
        score_samples(prompts, {"plain": samples["plain"], f"plain-{count}": runs})


def summarise(samples: dict[str, list[Sample]], store_bytes: dict[str, float], steps: int,
              curve: dict[str, list[Sample]] | None = None) -> list[dict[str, Any]]:
    """One row per configuration, with the FIELDS and EXTRA_FIELDS of the JSON report; `curve` holds the plain runs
    the bisection added (`plain_steps_curve`), weighed against but not rows of their own (they ran after the stream,
    not interleaved with it)."""
    curve = curve or {}
    plain_time = _median_seconds(samples["plain"])
    plain_cpu = _median([s.cpu_seconds for s in samples["plain"] if s.cpu_seconds is not None])
    fewer = {name: runs for name, runs in samples.items() if fewer_steps_count(name) is not None}
    rows = []
    for name, runs in samples.items():
        cpu = _median([s.cpu_seconds for s in runs if s.cpu_seconds is not None])
        hits = [s for s in runs if s.hit]
        first_expert = _mean([s.first_expert_calls for s in runs])
        calls = _mean_calls(runs)
        rows.append({
            "name": name,
            "speedup": round(plain_time / _median_seconds(runs), 3),
            "cpu_speedup": round(plain_cpu / cpu, 3) if plain_cpu > 0 and cpu > 0 else None,  # NaN: unknown
            "model_calls": round(calls, 2),
            "hit_rate": round(sum(s.hit for s in runs) / len(runs), 3),
            "masks_only_rate": round(sum(s.masks_only for s in runs) / len(runs), 3),
            "attention_density": round(sum(s.density for s in runs) / len(runs), 3),
            "psnr": _psnr(runs),
            "ssim": round(_mean([s.quality["ssim"] for s in runs]), 4),
            "detail": round(_mean([s.quality["detail"] for s in runs]), 4),
            "adherence": _round(_adherence(runs), 3),
            "bytes_per_entry": round(store_bytes.get(name, 0.0)),
            "hit_model_calls": _round(_mean([s.model_calls for s in hits]), 2),
            "hit_speedup": round(plain_time / _median_seconds(hits), 3) if hits else None,
            "stage_model_calls": [round(calls, 2)] if first_expert is None else
                                 [round(first_expert, 2), round(calls - first_expert, 2)],
            "equal_quality_speedup": None if name == "plain" or name in fewer or name in STEP_CACHES else
                                     equal_quality_speedup(runs, samples["plain"], {**fewer, **curve}, steps,
                                                           frozenset(fewer)),
        })
    return rows


def targets(stream: str, samples: dict[str, list[Sample]]) -> list[dict[str, Any]]:
    """The stream's `STREAM_TARGETS`, each with what this run measured and whether it met it."""
    plain = samples["plain"]
    plain_calls = _mean_calls(plain)
    plain_adherence = _adherence(plain)
    rows = []
    for name, wanted in STREAM_TARGETS.get(stream, {}).items():
        runs = samples.get(name)
        if not runs:
            continue
        adherence = _adherence(runs)
        measured = {
            "calls_speedup": plain_calls / _mean_calls(runs),
            "adherence_gap": None if adherence is None or plain_adherence is None else plain_adherence - adherence,
            "extra_calls": max(s.model_calls - p.model_calls for s, p in zip(runs, plain, strict=True)),
            "time_speedup": _median_seconds(plain) / _median_seconds(runs),
        }
        for measure, bound in wanted.items():
            value = measured[measure]
            met = None if value is None else (value >= bound if measure in AT_LEAST else value <= bound + 1e-9)
            rows.append({"config": name, "measure": measure, "target": bound,
                         "measured": _round(value, 3), "met": met})
    return rows


def nesting(prompts: list[str], samples: dict[str, list[Sample]]) -> dict[str, list[dict[str, Any]]]:
    """Where the modes are not nested, per prompt: fast resuming shallower than balanced (fewer steps skipped), fast
    taking more than balanced's model calls plus one (its one call beyond balanced's), and balanced more than safe
    plus one (its one probe call a miss may cost); each such prompt with both calls and steps skipped. Empty lists
    are the goal. Only the checks whose modes all ran are there."""
    checks: dict[str, tuple[str, str, Callable[[Sample, Sample], bool]]] = {
        "fast_shallower_than_balanced": ("fast", "balanced", lambda a, b: a.skipped_steps < b.skipped_steps),
        "fast_over_balanced_plus_one": ("fast", "balanced", lambda a, b: a.model_calls > b.model_calls + 1),
        "balanced_over_safe_plus_one": ("balanced", "safe", lambda a, b: a.model_calls > b.model_calls + 1)}
    found: dict[str, list[dict[str, Any]]] = {}
    for check, (deeper, shallower, broken) in checks.items():
        if deeper not in samples or shallower not in samples:
            continue
        found[check] = [
            {"prompt": prompt, deeper: {"model_calls": a.model_calls, "skipped_steps": a.skipped_steps},
             shallower: {"model_calls": b.model_calls, "skipped_steps": b.skipped_steps}}
            for prompt, a, b in zip(prompts, samples[deeper], samples[shallower], strict=True) if broken(a, b)]
    return found


def _nesting_lines(found: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The markdown's line on nested modes, and a line per prompt where they are not."""
    if not found:
        return []
    said = {"fast_shallower_than_balanced": "fast resumed shallower than balanced",
            "fast_over_balanced_plus_one": "fast took more than balanced + 1 model calls",
            "balanced_over_safe_plus_one": "balanced took more than safe + 1"}
    lines = ["", "Nested modes: " + "; ".join(f"{said[check]} on {len(rows)} prompt{'s' * (len(rows) != 1)}"
                                              for check, rows in found.items()) + "."]
    for rows in found.values():
        for row in rows:
            modes = [name for name in row if name != "prompt"]
            lines.append(f"- {row['prompt']!r}: " + ", ".join(
                f"{name} {row[name]['model_calls']} calls ({row[name]['skipped_steps']} steps skipped)"
                for name in modes))
    return lines


def _verdict(met: bool | None) -> str:
    return "unmeasured" if met is None else "met" if met else "not met"


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _psnr(runs: list[Sample]) -> float | None:
    """PSNR of the runs' clips together (mean squared error over them) against their same-seed plain clips."""
    return round(psnr_from_mse(_mean([s.quality["mse"] for s in runs])), 2) if runs else None


def score_samples(prompts: list[str], samples: dict[str, list[Sample]]) -> None:
    """PSNR/SSIM and the detail ratio against the same prompt's plain clip, and oracle adherence (None when
    unscorable)."""
    for i, prompt in enumerate(prompts):
        reference = samples["plain"][i].rgb
        for name in samples:
            sample = samples[name][i]
            result = score(prompt, sample.rgb)
            error = mse(sample.rgb, reference)
            sample.quality = {"mse": error, "psnr": psnr_from_mse(error), "ssim": ssim(sample.rgb, reference),
                              "detail": detail_ratio(sample.rgb, reference), "adherence": result.adherence,
                              "observed": result.observed}


def _mask_donor_graph(base: dict, store: str, donor: str) -> dict:
    """The arbitrary donor's run, recording its own masks into `store` whatever its token count (any-donor-masks
    borrows them)."""
    return graphs.with_reuse(graphs.with_sparse_attention(base, "own", **MASKS_ALWAYS_SPARSE), store, donor,
                             mode="safe", sparse_attention="off")


def _recorder(shared: list[str], i: int) -> str | None:
    """Which of the modes sharing one store records the `i`th prompt there: each in turn."""
    return shared[i % len(shared)] if shared else None


def _recorder_last(names: tuple[str, ...], recorder: str | None) -> tuple[str, ...]:
    """`names` in their order with the recorder moved last: no mode meets the entry of its own prompt."""
    return tuple(name for name in names if name != recorder) + ((recorder,) if recorder in names else ())


def run_stream(bench: Bench, unet: str, prompts: list[str], seeds: list[int], steps: int, cfg: float,
               seed_policy: str, progress: Callable[[str], None], fewer: list[str],
               configs: tuple[str, ...] = CONFIGS,
               shared_store: bool = False) -> tuple[dict[str, list[Sample]], dict[str, float], str]:
    """Every configuration of `configs` (with the plain-at-fewer-steps ones in `fewer` after plain) on every prompt;
    with `shared_store` the reuse modes of `SHARED_MODES` share one store (`_recorder`)."""
    names = _with_fewer_steps(configs, fewer)
    shared = [name for name in names if shared_store and name in SHARED_MODES]
    donor = donor_prompt_for(prompts)
    warm_base = graphs.base_graph(unet, WARMUP_PROMPT, seed=1, steps=WARMUP_STEPS, cfg=cfg)
    masks_borrowed = "any-donor-masks" in names
    if masks_borrowed:
        warm_donor = _mask_donor_graph(graphs.base_graph(unet, donor, seed=DONOR_SEED, steps=WARMUP_STEPS, cfg=cfg),
                                       _store_dir("any-donor-masks", "warmup"), donor)
        bench.run(graphs.with_save_latent(warm_donor, "bench/warmup"))
        bench.wait_for_entries(_store_dir("any-donor-masks", "warmup"), 1)
    for name in names:
        progress(f"warm-up: {name}")
        bench.sample(name, config_graph(name, warm_base, WARMUP_PROMPT, donor, "warmup"),
                     fewer_steps_count(name) or WARMUP_STEPS)
    if masks_borrowed:
        progress(f"recording the arbitrary donor's masks: {donor!r}")
        donor_graph = _mask_donor_graph(graphs.base_graph(unet, donor, seed=DONOR_SEED, steps=steps, cfg=cfg),
                                        _store_dir("any-donor-masks"), donor)
        bench.run(graphs.with_save_latent(donor_graph, "bench/donor"))
        bench.wait_for_entries(_store_dir("any-donor-masks"), 1)
    samples: dict[str, list[Sample]] = {name: [] for name in names}
    for i, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True)):
        base = graphs.base_graph(unet, prompt, seed=seed, steps=steps, cfg=cfg)
        for name in _recorder_last(_rotated(names, i), _recorder(shared, i)):
            records = name not in shared or name == _recorder(shared, i)
            graph = config_graph(name, base, prompt, donor, seed_policy=seed_policy, shared=name in shared,
                                 records=records)
            store = _store_dir(SHARED_STORE if name in shared else name) if name in RECORDING and records else None
            samples[name].append(bench.sample_recorded(name, graph, fewer_steps_count(name) or steps, store=store,
                                                       entries=i + 1))
        times = ", ".join(f"{n} {samples[n][-1].seconds:.1f}s" for n in names)
        progress(f"[{i + 1}/{len(prompts)}] {prompt!r}: {times}")
    store_bytes = {}
    for name in RECORDING & set(names):
        totals = bench.wait_for_entries(_store_dir(SHARED_STORE if name in shared else name), len(prompts))
        store_bytes[name] = totals["bytes"] / max(1, totals["entries"])
    return samples, store_bytes, donor


def run_two_expert_stream(bench: Bench, unet: str, prompts: list[str], seeds: list[int], steps: int, cfg: float,
                          seed_policy: str, progress: Callable[[str], None], fewer: list[str],
                          configs: tuple[str, ...] = TWO_EXPERT_CONFIGS,
                          shared_store: bool = False) -> dict[str, list[Sample]]:
    """The stream on the two-expert graph (the demo model as both experts, the boundary half-way), every
    configuration of `configs` (with the plain-at-fewer-steps ones in `fewer` after plain) per prompt in rotated
    order, as `run_stream` does, `shared_store` included."""
    names = _with_fewer_steps(configs, fewer)

    recording = [name for name in configs if name != "plain"]
    shared = [name for name in recording if shared_store and name in SHARED_MODES]

    def store_of(name: str, prefix: str = "stores") -> str:
        return _store_dir(f"two-expert-{SHARED_STORE if name in shared and prefix == 'stores' else name}", prefix)

    def graph(name: str, prompt: str, seed: int, run_steps: int, prefix: str = "stores", records: bool = True) -> dict:
        base = graphs.two_expert_graph(unet, prompt, seed=seed, steps=run_steps, boundary=expert_boundary(run_steps),
                                       cfg=cfg)
        if name not in recording:
            return base
        return graphs.with_expert_reuse(base, store_of(name, prefix), prompt, mode=name, seed_policy=seed_policy,
                                        **({} if records else {"record": False}))

    for name in names:
        progress(f"warm-up: two-expert {name}")
        run_steps = fewer_steps_count(name) or WARMUP_STEPS
        bench.sample(name, graph(name, WARMUP_PROMPT, 1, run_steps, "warmup"), run_steps, expert_boundary(run_steps))
    samples: dict[str, list[Sample]] = {name: [] for name in names}
    for i, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True)):
        for name in _recorder_last(_rotated(names, i), _recorder(shared, i)):
            run_steps = fewer_steps_count(name) or steps
            records = name not in shared or name == _recorder(shared, i)
            store = store_of(name) if name in recording and records else None
            samples[name].append(bench.sample_recorded(name, graph(name, prompt, seed, run_steps, records=records),
                                                       run_steps, expert_boundary(run_steps), store=store,
                                                       entries=i + 1))
        calls = ", ".join(f"{n} {samples[n][-1].model_calls} calls ({samples[n][-1].first_expert_calls} first expert)"
                          for n in names)
        progress(f"[{i + 1}/{len(prompts)}] {prompt!r}: {calls}")
    return samples


def _with_fewer_steps(configs: tuple[str, ...], fewer: list[str]) -> tuple[str, ...]:
    """`configs` with the plain-at-fewer-steps configurations right after plain, where a table reads them with it."""
    return ("plain", *fewer, *(name for name in configs if name != "plain"))


def _rotated(names: tuple[str, ...], i: int) -> tuple[str, ...]:
    """The configurations' order for the `i`th prompt: rotated by one per prompt, so that drift spreads over all."""
    return names[i % len(names):] + names[:i % len(names)]


def per_kind(kinds: list[str], samples: dict[str, list[Sample]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per configuration and kind of edit (`streams.edit_kinds`): how many resumed, at which depths, the kind's mean
    adherence, and PSNR against plain of the kind's clips and of its resumed clips alone (None without a resume)."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for name, runs in samples.items():
        table[name] = {}
        for kind in dict.fromkeys(kinds):
            of_kind = [s for s, k in zip(runs, kinds, strict=True) if k == kind]
            table[name][kind] = {"requests": len(of_kind), "resumed": sum(s.verdict.skips_steps for s in of_kind),
                                 "skipped_steps": [s.skipped_steps for s in of_kind],
                                 "adherence": _round(_mean([s.quality["adherence"] for s in of_kind]), 3),
                                 "psnr": _psnr(of_kind),
                                 "resumed_psnr": _psnr([s for s in of_kind if s.verdict.skips_steps])}
    return table


def attention_heavy(bench: Bench, unet: str, repeats: int = 2,
                    progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Plain vs own-mask sparse attention on the random-weight >= 4k-token model, ABBA-interleaved.

    Each repeat uses its own seed: ComfyUI would serve a repeated identical graph from its output cache.
    """
    frames, height, width = HEAVY_CLIP
    tokens = frames * (height // 2) * (width // 2)
    times: dict[str, list[float]] = {"plain": [], "own-masks": []}
    density = []
    for r in range(repeats):
        base = graphs.with_save_latent(graphs.base_graph(unet, "a timing run", seed=r, steps=HEAVY_STEPS,
                                                         clip=HEAVY_CLIP), "bench/heavy")
        for name in (("plain", "own-masks") if r % 2 == 0 else ("own-masks", "plain")):
            run, _ = bench.run(base if name == "plain" else graphs.with_sparse_attention(base, "own", **HEAVY_ATTENTION))
            times[name].append(run.seconds_except(graphs.SHARED_NODES))
            reports = run.reports
            if reports and reports[0].get("attention_density") is not None:
                density.append(float(reports[0]["attention_density"]))
            progress(f"attention-heavy {name}: {times[name][-1]:.1f} s")
    plain, sparse_time = _median(times["plain"]), _median(times["own-masks"])
    return {"model": {"dim": HEAVY_MODEL.dim, "ffn_dim": HEAVY_MODEL.ffn_dim, "layers": HEAVY_MODEL.num_layers,
                      "weights": "random"},
            "latent": list(HEAVY_CLIP), "video_tokens": tokens, "steps": HEAVY_STEPS, "settings": HEAVY_ATTENTION,
            "plain_s": round(plain, 2), "own_masks_s": round(sparse_time, 2), "speedup": round(plain / sparse_time, 3),
            "attention_density": round(_mean(density), 3) if density else None,
            "times": {k: [round(t, 2) for t in v] for k, v in times.items()}}


# ------------------------------------------------------------------------------------------------ output

def markdown(result: dict[str, Any], settings: dict[str, Any]) -> str:
    lines = [f"### Workload `{result['stream']}` ({len(result['prompts'])} prompts, {settings['steps']} steps, "
             f"seed {settings['seed']}, cfg {settings['cfg']}"
             f"{', one store shared by ' + ', '.join(SHARED_MODES) if settings.get('shared_store') else ''})", "",
             "| config | speedup | CPU speedup | equal-quality speedup | model calls | first-expert calls | hit rate | "
             "calls per hit | speedup per hit | masks-only rate | attention density | PSNR (dB) | SSIM | adherence | "
             "bytes/entry |",
             "|---" * 15 + "|"]
    for c in result["configs"]:
        lines.append(f"| {c['name']} | {c['speedup']:.2f}x | {_shown(c.get('cpu_speedup'), '{:.2f}x')} | "
                     f"{_equal_quality(c['equal_quality_speedup'])} | "
                     f"{c['model_calls']:.1f} | {_first_expert(c)} | {c['hit_rate']:.2f} | "
                     f"{_shown(c.get('hit_model_calls'), '{:.1f}')} | {_shown(c.get('hit_speedup'), '{:.2f}x')} | "
                     f"{c['masks_only_rate']:.2f} | {c['attention_density']:.3f} | {c['psnr']:.1f} | {c['ssim']:.3f} | "
                     f"{_shown(c['adherence'], '{:.3f}')} | {c['bytes_per_entry']:,} |")
    weighed = [c for c in result["configs"] if c["equal_quality_speedup"]]
    if weighed:
        curve = result.get("plain_steps_curve") or []
        lines += ["", "Equal quality (as adherent, as close to plain by PSNR and as detailed as the request's own "
                      "full-step render; 90 % interval over the requests):", ""]
        lines += [f"- {verdict_line(c['name'], c['equal_quality_speedup'])}" for c in weighed]
        lines += ["", "Plain-steps curve (bisected counts marked *): " + "; ".join(
            f"{row['steps']}{'*' if row['bisected'] else ''} steps {row['model_calls']:.1f} calls, "
            f"{row['psnr']:.1f} dB, detail {row['detail']:.3f}, adherence {_shown(row['adherence'], '{:.3f}')}"
            for row in curve)]
    if result.get("per_kind"):
        kinds = list(next(iter(result["per_kind"].values())))
        lines += ["", "Resumed per kind of edit (resumed/requests, skipped steps each, PSNR of the resumed clips):", "",
                  "| config | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
        for name, by_kind in result["per_kind"].items():
            cells = [f"{k['resumed']}/{k['requests']} {k['skipped_steps']}"
                     + (f" {k['resumed_psnr']:.1f} dB" if k["resumed_psnr"] is not None else "")
                     for k in by_kind.values()]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += _nesting_lines(result.get("nesting", {}))
    if result.get("targets"):
        lines += ["", "Targets: " + "; ".join(
            f"{t['config']} {t['measure'].replace('_', ' ')} {'>=' if t['measure'] in AT_LEAST else '<='} "
            f"{t['target']:g}: {_shown(t['measured'], '{:.3f}')} ({_verdict(t['met'])})" for t in result["targets"])]
    heavy = settings.get("attention_heavy")
    if heavy:
        lines += ["", f"Attention-heavy timing (random-weight Wan 2.1, {heavy['video_tokens']} video tokens, "
                      f"{heavy['steps']} steps, {heavy['model']['layers']} layers of dim {heavy['model']['dim']}): "
                      f"plain {heavy['plain_s']:.1f} s, own masks {heavy['own_masks_s']:.1f} s at density "
                      f"{heavy['attention_density']} -> {heavy['speedup']:.2f}x end to end."]
    lines += ["", "PSNR: of all the stream's clips together (mean squared error over prompts) against the same-seed "
                  f"plain clips, {PSNR_IDENTICAL:.0f} dB when identical; SSIM: mean over prompts; adherence over the prompts the oracle can score; bytes/entry 0: "
                  "the configuration records nothing. Equal-quality speedup: the model calls (and, for an interleaved "
                  "row, the median time) of the cheapest plain run as adherent, as close to plain and as detailed as "
                  "the configuration, else of plain, over the configuration's. Hits: requests that skipped steps; masks-only: requests that "
                  "sampled every step on a donor's attention masks. Dense attention: PyTorch SDPA (ComfyUI "
                  f"{' '.join(settings['comfyui_args'])}). Server torch threads: "
                  f"{settings.get('server_threads') or 'every core'}. Machine: {settings['machine']}"]
    return "\n".join(lines) + "\n"


def _equal_quality(speedup: dict[str, Any] | None) -> str:
    if speedup is None:
        return "n/a"
    low, high = speedup["interval"]
    time = "" if speedup["time"] is None else f", {speedup['time']:.2f}x time"
    return f"{speedup['calls']:.2f}x calls ({low:.2f}–{high:.2f}x){time} vs {speedup['against']}"


def verdict_line(name: str, speedup: dict[str, Any]) -> str:
    """A configuration's equal-quality verdict in words, with the steps plain needs and the measure that decided."""
    needed = f"plain needs {step_count(speedup['steps_needed'])}"
    if speedup["steps_short"] is not None:
        needed += f" ({speedup['steps_short']} fall short"
        needed += f" on {speedup['decided_by']})" if speedup["decided_by"] else ")"
    return f"{name}: {speedup['words']}; {needed}."


def _first_expert(config: dict[str, Any]) -> str:
    stages = config["stage_model_calls"]
    return f"{stages[0]:.1f}" if len(stages) > 1 else "n/a"


def _shown(value: float | None, form: str) -> str:
    return "n/a" if value is None else form.format(value)


def write_outputs(out: Path, result: dict[str, Any], settings: dict[str, Any], details: list[dict]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = "workload_" + re.sub("[^a-z0-9-]+", "_", result["stream"].lower()).strip("_")
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.png"]
    paths[0].write_text(json.dumps({**result, "settings": settings, "per_prompt": details}, indent=1))
    paths[1].write_text(markdown(result, settings))
    points = [{**c, "label": c["name"] + ("" if c["equal_quality_speedup"] is None else
                                          f": {c['equal_quality_speedup']['words']}")}
              for c in result["configs"] if c["name"] != "plain" and fewer_steps_count(c["name"]) is None]
    if plot.yardstick_panels(result["plain_steps_curve"], points, paths[2],
                             f"Carnator workload '{result['stream']}': the yardstick's measures vs model calls") is None:
        print(plot.plot_unavailable("quality plot"))
        return paths[:2]
    return paths


def _details(prompts: list[str], seeds: list[int], samples: dict[str, list[Sample]]) -> list[dict]:
    return [{"prompt": p, "seed": seed, "expected": world.parse_prompt(p), "configs": {
        name: {"time_s": round(s.seconds, 3),
               "cpu_s": None if s.cpu_seconds is None else round(s.cpu_seconds, 3), "model_calls": s.model_calls, "hit": s.hit,
               "verdict": s.verdict.value,
               "skipped_steps": s.skipped_steps, "attention_density": round(s.density, 3),
               "psnr": round(s.quality["psnr"], 2), "ssim": round(s.quality["ssim"], 4),
               "detail": round(s.quality["detail"], 4),
               "adherence": s.quality["adherence"], "observed": s.quality["observed"],
               "donor_prompt": (s.report or {}).get("donor_prompt"), "reason": (s.report or {}).get("reason"),
               "probes": [_probe_summary(probe) for probe in (s.report or {}).get("probes", [])]}
        for name, runs in samples.items() for s in runs[i:i + 1]}} for i, (p, seed) in enumerate(zip(prompts, seeds, strict=True))]


def _probe_summary(probe: dict) -> dict:
    """What decided a probe, rounded for reading: its donor, step, the verdict and the structure agreement it had."""
    structure = probe.get("structure_agreement")
    return {"donor_prompt": probe.get("donor_prompt"), "step": probe["step"], "passed": probe["passed"],
            "donor_given_up": probe.get("donor_given_up"),
            "structure_agreement": None if structure is None else round(structure, 3)}


def _config_list(text: str) -> set[str]:
    """`--configs`: names separated by commas, plain always among them."""
    return {"plain", *(name.strip() for name in text.split(",") if name.strip())}


def _machine() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return f"{os.cpu_count()} CPUs, load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at the end"


def main(argv: list[str]) -> int:
    staged = argparse.ArgumentParser(add_help=False)
    staged.add_argument("--graph")
    if staged.parse_known_args(argv)[0].graph in STAGED_GRAPHS:  # a shipped staged workflow on the user's server
        return stages.main(argv)
    parser = argparse.ArgumentParser(prog="python -m carnator_core.bench workload",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--stream", choices=STREAMS, default="near-dup")
    parser.add_argument("--graph", choices=("single", "two-expert", *STAGED_GRAPHS), default="single",
                        help="single: one model and KSampler (every configuration); two-expert: the Wan 2.2 14B "
                             "template's shape, the demo model as both experts in two KSamplerAdvanced with the "
                             "boundary half-way (plain and the reuse modes); ltx2-two-stage, hunyuan15-sr: the "
                             "shipped LTX-2 workflow, or HunyuanVideo 1.5's with its super-resolution group, on your "
                             "server (--server), measured per stage (`bench stages`)")
    parser.add_argument("--prompts", help=f"your own stream, run in order: a UTF-8 text file, {PROMPT_FILE_RULE}")
    parser.add_argument("--n", type=int, default=6, help="prompts in a generated stream")
    parser.add_argument("--seed", choices=("fixed", "random"), default="fixed",
                        help="fixed: one seed for every prompt (the editing loop); random: a seed per prompt, "
                             "and the reuse nodes take donors with any noise (seed_policy serving)")
    parser.add_argument("--steps", type=int, default=30,
                        help="sampling steps (plain also runs at 1/2, 1/3 and 1/4 of them: the plain-<n> rows)")
    parser.add_argument("--cfg", type=float, default=1.0)
    parser.add_argument("--weights", help="demo model .safetensors (default: $CARNATOR_DEMO_WEIGHTS, else shipped)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the benchmark's ComfyUI server (0: torch's default, every core)")
    parser.add_argument("--attention-heavy", action="store_true",
                        help="also time plain vs own-mask sparse attention on a random-weight >= 4k-token model")
    parser.add_argument("--configs", type=_config_list, default=None,
                        help="only these configurations, comma-separated (plain always runs: quality is measured "
                             "against it; plain-<n> rows only where named, e.g. plain-10); default: all")
    parser.add_argument("--shared-store", action="store_true",
                        help="safe, balanced and fast look up in one store, each prompt recorded there by one of "
                             "them in turn: every mode meets the same donors, recorded by requests in every mode")
    parser.add_argument("--json", action="store_true", help="print only the result object as JSON")
    parser.add_argument("--out", type=Path, default=Path("carnator-bench-output"))
    add_record_option(parser)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the ComfyUI server is stopped
    say = (lambda message: print(message, file=sys.stderr, flush=True)) if args.json else \
        (lambda message: print(message, flush=True))
    try:
        if args.steps < 2:
            raise DemoSetupError("--steps must be at least 2")
        if args.threads < 0:
            raise DemoSetupError("--threads must be 0 (every core) or more")
        prompts = read_prompt_file(args.prompts) if args.prompts else make_stream(args.stream, args.n)
        weights = demo_weights(args.weights)
        recording = Recording(args.record, "carnator_core.bench workload", argv)
        result, settings, details = _run(args, prompts, weights, say)
        comfyui = comfyui_version(find_comfyui())
    except (DemoSetupError, ComfyNotFound, ComfyError, OSError, ValueError) as error:
        print(f"carnator workload benchmark: {error}", file=sys.stderr)
        return 1
    paths = write_outputs(args.out, result, settings, details)
    stored = recording.store({**result, "settings": settings, "per_prompt": details}, comfyui=comfyui,
                             torch_threads=args.threads)
    paths += [stored] if stored is not None else []
    if args.json:
        print(json.dumps(result))
    else:
        print(markdown(result, settings))
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _run(args: argparse.Namespace, prompts: list[str], weights: Path,
         say: Callable[[str], None]) -> tuple[dict, dict, list]:
    seeds = [42] * len(prompts) if args.seed == "fixed" else \
        [int(s) for s in np.random.default_rng(0).integers(0, 2**31, len(prompts))]
    seed_policy = "same-noise" if args.seed == "fixed" else "serving"
    fewer, skipped = fewer_steps(args.steps)
    for line in skipped:
        say(line)
    available = TWO_EXPERT_CONFIGS if args.graph == "two-expert" else CONFIGS
    configs = available if args.configs is None else tuple(name for name in available if name in args.configs)
    if args.configs is not None:
        unknown = sorted(set(args.configs) - set(available) - set(fewer))
        if unknown:
            raise ValueError(f"--configs: no configuration {', '.join(unknown)} on this graph "
                             f"(have: {', '.join(available[1:] + tuple(fewer))})")
        fewer = [name for name in fewer if name in args.configs]
    base_dir = Path(tempfile.mkdtemp(prefix="carnator-bench-"))
    heavy_unet = "carnator_random_wan_heavy.safetensors"
    if args.attention_heavy:
        write_random_wan(base_dir / "models" / "diffusion_models" / heavy_unet, HEAVY_MODEL)
    say(f"starting ComfyUI headless (base directory {base_dir}) ...")
    try:
        threads = {"OMP_NUM_THREADS": str(args.threads)} if args.threads > 0 else None
        with demo_server(base_dir, weights, extra_args=DENSE_ATTENTION, env=threads) as (client, unet):
            bench = Bench(client, base_dir)
            if args.graph == "two-expert":
                donor = None
                samples = run_two_expert_stream(bench, unet, prompts, seeds, args.steps, args.cfg, seed_policy, say,
                                                fewer, configs, args.shared_store)
                store_bytes = {name: _bytes_per_entry(base_dir / _store_dir(
                    f"two-expert-{SHARED_STORE if args.shared_store and name in SHARED_MODES else name}"))
                               for name in configs if name != "plain"}

                def plain_at(i: int, steps: int) -> Sample:
                    graph = graphs.two_expert_graph(unet, prompts[i], seed=seeds[i], steps=steps,
                                                    boundary=expert_boundary(steps), cfg=args.cfg)
                    return bench.sample(f"plain-{steps}", graph, steps, expert_boundary(steps))
            else:
                samples, store_bytes, donor = run_stream(bench, unet, prompts, seeds, args.steps, args.cfg,
                                                         seed_policy, say, fewer, configs, args.shared_store)

                def plain_at(i: int, steps: int) -> Sample:
                    graph = graphs.base_graph(unet, prompts[i], seed=seeds[i], steps=steps, cfg=args.cfg)
                    return bench.sample(f"plain-{steps}", graph, steps)
            score_samples(prompts, samples)
            curve: dict[str, list[Sample]] = {}
            plain_steps_curve(samples, curve, args.steps, plain_at, prompts, say)
            heavy = attention_heavy(bench, heavy_unet, progress=say) if args.attention_heavy else None
    finally:
        if (base_dir / "comfyui.log").exists():
            args.out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(base_dir / "comfyui.log", args.out / "comfyui.log")
        shutil.rmtree(base_dir, ignore_errors=True)
    stream = f"file:{Path(args.prompts).name}" if args.prompts else args.stream
    if args.graph == "two-expert":
        stream += " (two-expert)"
    result = {"stream": stream, "prompts": prompts, "configs": summarise(samples, store_bytes, args.steps, curve),
              "plain_steps_curve": curve_table(samples, curve, args.steps), "nesting": nesting(prompts, samples)}
    if args.stream in KINDED_STREAMS and not args.prompts:
        result["per_kind"] = per_kind(edit_kinds(args.stream, len(prompts)), samples)
    if not args.prompts:
        result["targets"] = targets(args.stream, samples)
    settings = {"graph": args.graph, "shared_store": args.shared_store, "steps": args.steps, "seed": args.seed, "seeds": seeds, "cfg": args.cfg, "weights": str(weights),
                "donor_prompt": donor, "clip": list(world.CLIP), "attention_heavy": heavy, "machine": _machine(),
                "seed_policy": seed_policy, "comfyui_args": list(DENSE_ATTENTION), "server_threads": args.threads}
    return result, settings, _details(prompts, seeds, samples)

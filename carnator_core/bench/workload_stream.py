"""Running a prompt stream through the benchmark's server: one prompt at a time, every configuration on it in an
order rotated per prompt, each run timed from the server's own per-node times and scored by the demo oracle; the
single-sampler and two-expert streams and the attention-heavy timing."""

from __future__ import annotations

import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from carnator_core.bench.workload_configurations import (
    CONFIGS,
    DONOR_SEED,
    HEAVY_ATTENTION,
    HEAVY_CLIP,
    HEAVY_MODEL,
    HEAVY_STEPS,
    RECORDING,
    SHARED_MODES,
    SHARED_STORE,
    TWO_EXPERT_CONFIGS,
    config_graph,
    donor_prompt_for,
    expert_boundary,
    mask_donor_graph,
    store_dir,
)
from carnator_core.client import ComfyClient, PromptRun
from carnator_core.demo import graphs, world
from carnator_core.demo.oracle import score
from carnator_core.judging.fewer_steps import fewer_steps_count
from carnator_core.judging.quality import detail_ratio, mse, psnr_from_mse, ssim
from carnator_core.reuse.report import RunReport, Verdict
from carnator_core.store.reuse_store import ReuseStore
from carnator_core.workflow_graph import complete

WARMUP_PROMPT = "a green square resting on a white background"
WARMUP_STEPS = 2
EASYCACHE_LINE = re.compile(r"EasyCache - skipped (\d+)/(\d+) steps")


@dataclass
class Sample:
    """One configuration on one prompt."""

    seconds: float
    model_calls: int
    verdict: Verdict  # the strongest of its sampling runs' (two experts: two runs)
    skipped_steps: int
    density: float
    rgb: torch.Tensor
    latent: torch.Tensor  # what the sampler returned, as SaveLatent wrote it
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
        run = self.client.run(complete(graph, self.object_info))
        with self.log.open("rb") as handle:
            handle.seek(start)
            log = handle.read().decode(errors="replace")
        return run, log

    def sample(self, name: str, graph: dict, steps: int, boundary: int | None = None) -> Sample:
        """One request; with `boundary` (two-expert graph) the model calls add up over both experts' reports and the
        first expert's are kept apart."""
        self.counter += 1
        graph = graphs.with_save_latent(graph, f"bench/{store_dir(name, '')[1:]}_{self.counter:04d}")
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
                      rgb=world.decode(world.from_raw(latent[0].float())), latent=latent, report=report,
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


def bytes_per_entry(directory: Path) -> float:
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


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


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


def _recorder(shared: list[str], i: int) -> str | None:
    """Which of the modes sharing one store records the `i`th prompt there: each in turn."""
    return shared[i % len(shared)] if shared else None


def _recorder_last(names: tuple[str, ...], recorder: str | None) -> tuple[str, ...]:
    """`names` in their order with the recorder moved last: no mode meets the entry of its own prompt."""
    return tuple(name for name in names if name != recorder) + ((recorder,) if recorder in names else ())


def run_stream(bench: Bench, unet: str, prompts: list[str], seeds: list[int], steps: int, cfg: float,
               seed_policy: str, progress: Callable[[str], None], fewer: list[str],
               configs: tuple[str, ...] = CONFIGS, shared_store: bool = False,
               store_prefix: str = "stores") -> tuple[dict[str, list[Sample]], dict[str, float], str]:
    """Every configuration of `configs` (with the plain-at-fewer-steps ones in `fewer` after plain) on every prompt;
    with `shared_store` the reuse modes of `SHARED_MODES` share one store (`_recorder`); the stores lie under
    `store_prefix` (another prefix: stores of their own, as the modes at the knee have)."""
    names = _with_fewer_steps(configs, fewer)
    shared = [name for name in names if shared_store and name in SHARED_MODES]
    donor = donor_prompt_for(prompts)
    warm_base = graphs.base_graph(unet, WARMUP_PROMPT, seed=1, steps=WARMUP_STEPS, cfg=cfg)
    masks_borrowed = "any-donor-masks" in names
    if masks_borrowed:
        warm_donor = mask_donor_graph(graphs.base_graph(unet, donor, seed=DONOR_SEED, steps=WARMUP_STEPS, cfg=cfg),
                                       store_dir("any-donor-masks", "warmup"), donor)
        bench.run(graphs.with_save_latent(warm_donor, "bench/warmup"))
        bench.wait_for_entries(store_dir("any-donor-masks", "warmup"), 1)
    for name in names:
        progress(f"warm-up: {name}")
        bench.sample(name, config_graph(name, warm_base, WARMUP_PROMPT, donor, "warmup"),
                     fewer_steps_count(name) or WARMUP_STEPS)
    if masks_borrowed:
        progress(f"recording the arbitrary donor's masks: {donor!r}")
        donor_graph = mask_donor_graph(graphs.base_graph(unet, donor, seed=DONOR_SEED, steps=steps, cfg=cfg),
                                        store_dir("any-donor-masks"), donor)
        bench.run(graphs.with_save_latent(donor_graph, "bench/donor"))
        bench.wait_for_entries(store_dir("any-donor-masks"), 1)
    samples: dict[str, list[Sample]] = {name: [] for name in names}
    for i, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True)):
        base = graphs.base_graph(unet, prompt, seed=seed, steps=steps, cfg=cfg)
        for name in _recorder_last(_rotated(names, i), _recorder(shared, i)):
            records = name not in shared or name == _recorder(shared, i)
            graph = config_graph(name, base, prompt, donor, store_prefix, seed_policy=seed_policy,
                                 shared=name in shared, records=records)
            store = store_dir(SHARED_STORE if name in shared else name, store_prefix) \
                if name in RECORDING and records else None
            samples[name].append(bench.sample_recorded(name, graph, fewer_steps_count(name) or steps, store=store,
                                                       entries=i + 1))
        times = ", ".join(f"{n} {samples[n][-1].seconds:.1f}s" for n in names)
        progress(f"[{i + 1}/{len(prompts)}] {prompt!r}: {times}")
    store_bytes = {}
    for name in RECORDING & set(names):
        totals = bench.wait_for_entries(store_dir(SHARED_STORE if name in shared else name, store_prefix),
                                        len(prompts))
        store_bytes[name] = totals["bytes"] / max(1, totals["entries"])
    return samples, store_bytes, donor


def run_two_expert_stream(bench: Bench, unet: str, prompts: list[str], seeds: list[int], steps: int, cfg: float,
                          seed_policy: str, progress: Callable[[str], None], fewer: list[str],
                          configs: tuple[str, ...] = TWO_EXPERT_CONFIGS, shared_store: bool = False,
                          store_prefix: str = "stores") -> dict[str, list[Sample]]:
    """The stream on the two-expert graph (the demo model as both experts, the boundary half-way), every
    configuration of `configs` (with the plain-at-fewer-steps ones in `fewer` after plain) per prompt in rotated
    order, as `run_stream` does, `shared_store` and `store_prefix` included."""
    names = _with_fewer_steps(configs, fewer)

    recording = [name for name in configs if name != "plain"]
    shared = [name for name in recording if shared_store and name in SHARED_MODES]

    def store_of(name: str, prefix: str = store_prefix) -> str:
        return store_dir(f"two-expert-{SHARED_STORE if name in shared and prefix == store_prefix else name}", prefix)

    def graph(name: str, prompt: str, seed: int, run_steps: int, prefix: str = store_prefix,
              records: bool = True) -> dict:
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
    """`configs` with the plain-at-fewer-steps configurations right after plain, where a table reads them with it
    (`configs` without plain: the reuse modes alone, at the knee of the plain-steps curve)."""
    if "plain" not in configs:
        return configs
    return ("plain", *fewer, *(name for name in configs if name != "plain"))


def _rotated(names: tuple[str, ...], i: int) -> tuple[str, ...]:
    """The configurations' order for the `i`th prompt: rotated by one per prompt, so that drift spreads over all."""
    return names[i % len(names):] + names[:i % len(names)]


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
    plain, sparse_time = median(times["plain"]), median(times["own-masks"])
    return {"model": {"dim": HEAVY_MODEL.dim, "ffn_dim": HEAVY_MODEL.ffn_dim, "layers": HEAVY_MODEL.num_layers,
                      "weights": "random"},
            "latent": list(HEAVY_CLIP), "video_tokens": tokens, "steps": HEAVY_STEPS, "settings": HEAVY_ATTENTION,
            "plain_s": round(plain, 2), "own_masks_s": round(sparse_time, 2), "speedup": round(plain / sparse_time, 3),
            "attention_density": round(mean(density), 3) if density else None,
            "times": {k: [round(t, 2) for t in v] for k, v in times.items()}}

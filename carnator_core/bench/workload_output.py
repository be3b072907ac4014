"""The workload benchmark's output: the markdown summary with each verdict in words, and the files a run writes (the
result JSON, per-prompt details, the plot)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from carnator_core.bench.workload_configurations import SHARED_MODES
from carnator_core.bench.workload_stream import Sample
from carnator_core.bench.workload_weighing import AT_LEAST
from carnator_core.demo import world
from carnator_core.judging import plot
from carnator_core.judging.fewer_steps import fewer_steps_count, step_count
from carnator_core.judging.quality import PSNR_IDENTICAL


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
    if result.get("recommended"):
        knee = result.get("knee") or {}
        at_knee = "; ".join(f"{name} {row['model_calls']:.1f} calls, {_shown(row['psnr'], '{:.1f}')} dB, detail "
                            f"{row['detail']:.3f}" for name, row in (knee.get("modes") or {}).items())
        lines += ["", f"Knee of the plain-steps curve (fewest plain steps as good as full plain): {knee.get('steps')} "
                      f"steps{'; ' + at_knee if at_knee else ''}.", "",
                  f"**Recommended: {result['recommended']['words']}.**"]
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
    points = frontier_points(result)
    if plot.yardstick_panels(result["plain_steps_curve"], points, paths[2],
                             f"Carnator workload '{result['stream']}': the yardstick's measures vs model calls") is None:
        print(plot.plot_unavailable("quality plot"))
        return paths[:2]
    return paths


def frontier_points(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each weighed configuration at the workflow's steps and each mode at the knee, as the quality plot marks them
    beside plain's curve (the frontier of quality against model calls)."""
    steps = result.get("plain_steps_curve", [{}])[-1].get("steps")
    points = [{**c, "label": f"{c['name']} at {steps} steps" + ("" if c["equal_quality_speedup"] is None else
                                                              f": {c['equal_quality_speedup']['words']}")}
              for c in result["configs"] if c["name"] != "plain" and fewer_steps_count(c["name"]) is None]
    points += [{**row, "label": f"{name.replace('@', ' at ')} steps (the knee)"}
               for name, row in (result.get("knee") or {}).get("modes", {}).items()]
    return points


def details(prompts: list[str], seeds: list[int], samples: dict[str, list[Sample]]) -> list[dict]:
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


def machine() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return f"{os.cpu_count()} CPUs, load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at the end"

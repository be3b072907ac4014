"""The workload's stream tables: the README's short table, every stored stream run by configuration, what a hit
and a miss cost, the streams' targets and how the modes nest, each from the runs `bench workload --record` stored."""

from __future__ import annotations

import statistics
from functools import partial
from typing import Any

from carnator_core.bench.tables.agreement import AGREEMENT_CFGS, agreement_run
from carnator_core.bench.tables.cells import MODES, adherence, against, table, with_interval
from carnator_core.bench.tables.stored_runs import Link, StoredRun, StoredRuns
from carnator_core.judging.fewer_steps import fewer_steps_count
from carnator_core.judging.ratio_interval import median_ratio_interval, ratio_words

# The stored runs behind the stream tables, in table order: result name -> the stream as a row names it
# (`bench workload --configs balanced,fast,plain-15,plain-10,plain-7 --record NAME`).
STREAM_RUNS = {
    "edit-loop": "edit-loop (8)",
    "reword-and-edit": "reword-and-edit (16)",
    "reword-and-edit-cfg4": "reword-and-edit (16), cfg 4",
    "near-dup": "near-dup (8)",
    "mixed": "mixed (8)",
    "unrelated": "unrelated (8)",
    "two-expert-30-steps": "two experts, edit-loop (8), 30 steps",
    "two-expert-4-steps": "two experts, edit-loop (8), 4 steps",
}
# The stored runs of every configuration side by side (`bench workload --stream S --record configs-S`): each its own
# table; the unrelated one is also what a miss costs.
CONFIG_RUNS = ("configs-near-dup", "configs-unrelated", "configs-mixed", "configs-adversarial", "configs-adversarial-cfg4",
               "edit-loop-new-seed")
MISS_RUN = "configs-unrelated"
# The two docs/streams beside reword-and-edit, at cfg 1 and 4, balanced and fast (the agreement table's workload runs).
EDIT_STREAM_RUNS = tuple(agreement_run("agree", stream, cfg) for cfg in AGREEMENT_CFGS
                         for stream in ("blocks-and-balls", "navy-and-grey"))
REUSE_MODES = ("text-only", "safe", "balanced", "fast")
TARGET_WORDS = {
    "calls_speedup": "speedup by model calls at least {}",
    "adherence_gap": "adherence lost against plain at most {}",
    "extra_calls": "model calls beyond plain on any request at most {:.0f}",
    "time_speedup": "time against plain at least {}x",
}


def readme_table(runs: StoredRuns, link: Link) -> str:
    """The README's short table: per stream the modes' calls and quality, and plain at fewer steps beside them."""
    rows = []
    for name, label in STREAM_RUNS.items():
        run = runs[name]
        modes = [run.config(mode) for mode in MODES]
        time = run.conditions.why_no_time or " / ".join(run.time(c) for c in modes)
        quality = [f"{c['model_calls']:.1f}, {c['psnr']:.1f} dB, {adherence(c)}" for c in modes]
        rows.append([f"[{label}]({link(name)})", time, *quality, _equal_quality(modes), _fewer_steps(run)])
    return table(["stream", "time against plain (balanced / fast)", "balanced: calls, PSNR, adherence",
                  "fast: calls, PSNR, adherence", "equal quality, by calls (balanced / fast)",
                  "plain at fewer steps: PSNR, adherence"], rows)


def streams_table(runs: StoredRuns, link: Link) -> str:
    """Every stored stream run, each configuration it ran on a row of its own."""
    rows = [[f"[{label}]({link(name)})", c["name"], run.time(c), f"{c['model_calls']:.1f}", f"{c['psnr']:.1f}",
             f"{c['ssim']:.3f}", adherence(c), _equal_cell(run, c)]
            for name, label in STREAM_RUNS.items() for run in [runs[name]]
            for c in [run.config("plain"), *run.fewer_steps, *(run.config(mode) for mode in MODES)]]
    return table(["stream", "config", "time", "model calls", "PSNR (dB)", "SSIM", "adherence",
                  "equal-quality speedup (calls[, time]; against)"], rows)


def verdicts_table(runs: StoredRuns, link: Link) -> str:
    """Each mode's equal-quality verdict on each stored stream run, in words, against which plain run, and the measure
    on which the next cheaper plain run fell short."""
    rows = []
    for name, label in STREAM_RUNS.items():
        run = runs[name]
        for mode in MODES:
            equal = run.config(mode)["equal_quality_speedup"]
            short = equal.get("steps_short")
            decided = equal.get("decided_by") or "—"
            words = ratio_words(equal["calls"], tuple(equal["interval"]), equal["requests"])
            rows.append([f"[{label}]({link(name)})", mode, words, against(equal["against"]),
                         decided if short is None else f"{decided} (plain at {short} steps falls short)"])
    return table(["stream", "mode", "verdict by calls", "weighed against", "decided by"], rows)


def configs_table(name: str, runs: StoredRuns, link: Link) -> str:
    """One stored run with every configuration side by side: ComfyUI's EasyCache, reuse judged by the text alone,
    sparse attention on the request's own and on another prompt's masks, the three modes, a mode beside EasyCache."""
    run = runs[name]
    rows = [[c["name"], run.time(c), f"{c['model_calls']:.1f}", f"{c['hit_rate']:.2f}",
             f"{c.get('masks_only_rate', 0.0):.2f}", f"{c['attention_density']:.3f}", f"{c['psnr']:.1f}",
             f"{c['ssim']:.3f}", f"{c['detail']:.3f}", adherence(c), f"{c['bytes_per_entry']:,}", _equal_cell(run, c)]
            for c in run.result["configs"] if fewer_steps_count(c["name"]) is None]
    header = ["config", "time against plain", "model calls", "hit rate", "masks-only rate", "attention density",
              "PSNR (dB)", "SSIM", "detail", "adherence", "bytes/entry", "equal-quality speedup (calls[, time]; against)"]
    settings = run.result["settings"]
    return (f"[`{name}`]({link(name)}): {len(run.result['per_prompt'])} prompts, {settings['steps']} steps, cfg "
            f"{settings['cfg']:g}, seed {settings['seed']}; the donor of any-donor-masks: \"{settings['donor_prompt']}\".\n\n"
            + table(header, rows))


def misses_table(runs: StoredRuns, link: Link) -> str:
    """What a miss costs: on the unrelated stream's requests that sampled every step, each reuse configuration's
    time against plain on the same requests and the model calls beyond plain's."""
    run = runs[MISS_RUN]
    steps = run.result["settings"]["steps"]
    per_prompt = run.result["per_prompt"]
    rows = []
    for mode in REUSE_MODES:
        misses = [i for i, p in enumerate(per_prompt) if p["configs"][mode]["skipped_steps"] == 0]
        extra = [per_prompt[i]["configs"][mode]["model_calls"] - steps for i in misses]
        rows.append([mode, f"{len(misses)} of {len(per_prompt)}", _miss_time(run, mode, misses),
                     f"{steps + statistics.mean(extra):.2f}" if misses else "—",
                     f"{max(extra):+d}" if misses else "—", str(sum(e > 1 for e in extra))])
    header = ["configuration", "misses", "time against plain on the misses (90 % interval)",
              f"model calls per miss (plain {steps})", "most calls beyond plain on a miss", "misses above plain + 1"]
    return f"From [`{MISS_RUN}`]({link(MISS_RUN)}).\n\n" + table(header, rows)


def hits_table(runs: StoredRuns, link: Link) -> str:
    """What a hit costs: per stored stream run and mode, the requests that resumed, their calls and, from runs that
    had the machine to themselves, plain's median time over the hits' median time."""
    rows = []
    for name in [*STREAM_RUNS, *CONFIG_RUNS]:
        run = runs[name]
        for mode in MODES:
            c = run.config(mode)
            if not c["hit_rate"] or c.get("hit_model_calls") is None:
                continue
            per_hit = f"{c['hit_speedup']:.2f}x" if run.conditions.alone else "— (not measured alone)"
            rows.append([f"[{name}]({link(name)})", mode, f"{c['hit_rate']:.2f}", f"{c['hit_model_calls']:.1f}",
                         per_hit])
    return table(["run", "mode", "hit rate", "model calls per hit", "time per hit against plain"], rows)


def targets_table(runs: StoredRuns, link: Link) -> str:
    """Each stored stream run's targets (`STREAM_TARGETS` of the workload), what it measured and whether it met
    them; a time target only from a run that had the machine to itself."""
    rows = []
    for name in [*STREAM_RUNS, *CONFIG_RUNS]:
        run = runs[name]
        for target in run.result.get("targets", []):
            timed = target["measure"] == "time_speedup"
            if timed and not run.conditions.alone:
                measured, met = "— (not measured alone)", "—"
            else:
                measured, met = _measured(target), "yes" if target["met"] else "**no**"
            rows.append([f"[{name}]({link(name)})", target["config"],
                         TARGET_WORDS[target["measure"]].format(target["target"]), measured, met])
    return table(["run", "config", "target", "measured", "met"], rows)


def nesting_table(runs: StoredRuns, link: Link) -> str:
    """Fast contains balanced: per stored run, the prompts where fast took more model calls than balanced, by how
    many at most, where it resumed shallower, and where it took more than balanced's calls plus one."""
    rows = []
    for name in [*STREAM_RUNS, *CONFIG_RUNS, *EDIT_STREAM_RUNS]:
        run = runs[name]
        excess = [p["configs"]["fast"]["model_calls"] - p["configs"]["balanced"]["model_calls"]
                  for p in run.result["per_prompt"] if {"fast", "balanced"} <= p["configs"].keys()]
        nesting = run.result["nesting"]
        rows.append([f"[{name}]({link(name)})", f"{run.result['settings']['cfg']:g}", str(len(excess)),
                     str(sum(e > 0 for e in excess)), f"{max(excess, default=0):+d}",
                     str(len(nesting["fast_shallower_than_balanced"])), str(len(nesting["fast_over_balanced_plus_one"]))])
    return table(["run", "cfg", "prompts", "fast took more calls than balanced", "most calls more",
                  "fast resumed shallower", "fast above balanced + 1"], rows)


def _equal_cell(run: StoredRun, config: dict[str, Any]) -> str:
    equal = config.get("equal_quality_speedup")
    if equal is None:
        # plain is the reference and plain-<n> the curve; any other configuration the workload does not weigh (the step
        # caches: their leftover noise would read as detail) says so
        return "" if config["name"] == "plain" or fewer_steps_count(config["name"]) is not None else "not weighed"
    time = f", {equal['time']:.2f}x" if run.conditions.alone and equal.get("time") is not None else ""
    return with_interval(equal) + time + f"; {equal['against']}"


def _equal_quality(modes: list[dict[str, Any]]) -> str:
    """The modes' equal-quality speedups by calls, in bold where plain at fewer steps is as good and cheaper."""
    speedups = [c["equal_quality_speedup"] for c in modes]
    ratios = " / ".join(with_interval(s) for s in speedups)
    if any(round(s["calls"], 2) < 1 for s in speedups):
        ratios = f"**{ratios}**"
    kinds = {s["against"] for s in speedups}
    if len(kinds) == 1:
        return f"{ratios} ({against(kinds.pop())})"
    return f"{ratios} ({' / '.join(against(s['against']) for s in speedups)})"


def _fewer_steps(run: StoredRun) -> str:
    fewer = run.fewer_steps
    if not fewer:
        return "not run"
    adherences = {adherence(c) for c in fewer}
    if len(adherences) > 1:
        return " · ".join(f"{fewer_steps_count(c['name'])}: {c['psnr']:.1f} dB, {adherence(c)}" for c in fewer)
    cells = [f"{fewer_steps_count(c['name'])}: {c['psnr']:.1f}" for c in fewer]
    every = "all " if len(cells) > 1 else ""
    return f"{cells[0]} dB" + "".join(f" · {cell}" for cell in cells[1:]) + f"; {every}{adherences.pop()}"


def _miss_time(run: StoredRun, mode: str, misses: list[int]) -> str:
    if not run.conditions.alone:
        return "— (not measured alone)"
    if not misses:
        return "—"
    plain, other = run.request_times("plain", misses), run.request_times(mode, misses)
    low, high = median_ratio_interval(plain, other)
    return f"{statistics.median(plain) / statistics.median(other):.3f}x ({low:.3f}–{high:.3f}x)"


def _measured(target: dict[str, Any]) -> str:
    value = target["measured"]
    if value is None:
        return "n/a"
    return f"{value:.2f}x" if target["measure"] in ("calls_speedup", "time_speedup") else f"{value:g}"


TABLES = {"readme": readme_table, "streams": streams_table, "verdicts": verdicts_table, "misses": misses_table, "hits": hits_table,
          "targets": targets_table, "nesting": nesting_table,
          **{name: partial(configs_table, name) for name in CONFIG_RUNS}}

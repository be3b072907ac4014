"""`python -m carnator_core.bench report [--check]`: the results tables of the README and docs/measurements.md,
generated from the stored runs in docs/results/ (`bench workload --record NAME`).

Each table sits between `<!-- results:TABLE -->` and `<!-- /results:TABLE -->`, and all between is rewritten: a figure
typed there by hand does not survive the next report, and `--check` (run in CI) fails while a table differs from what
its JSON gives. A time ratio is shown only from a run that had the machine to itself (`RunConditions.alone`);
otherwise the time cell says why it is empty, and the calls and quality stand alone.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carnator_core.bench.results import REPO_DIR, RESULTS_DIR, RunConditions, read_result
from carnator_core.judging.fewer_steps import fewer_steps_count
from carnator_core.judging.probe_thresholds import ProbeThresholds
from carnator_core.judging.ratio_interval import median_ratio_interval, ratio_words

DOCUMENTS = (REPO_DIR / "README.md", REPO_DIR / "docs" / "measurements.md")
MARKED = re.compile(r"(?P<open><!-- results:(?P<table>[a-z0-9-]+) -->\n)(?P<body>.*?)(?P<close><!-- /results:(?P=table) -->)",
                    re.S)
# The stored runs behind the stream tables, in table order: result name -> the stream as a row names it.
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
# The stored runs of single-model streams behind the deep-first table, beside those of STREAM_RUNS; each run's
# guidance scale is read from its settings.
DEEP_FIRST_RUNS = ("edit-loop", "reword-and-edit", "near-dup", "mixed", "unrelated", "blocks-and-balls", "navy-and-grey",
                   "reword-and-edit-cfg4", "blocks-and-balls-cfg4", "navy-and-grey-cfg4")
MODES = ("balanced", "fast")
# The stored pairs of runs behind the agreement table, each stream at each guidance scale: the workload's record is
# agree-STREAM-cfgN (`bench workload --prompts docs/streams/STREAM.txt --configs balanced,fast --cfg N`), the stream
# calibration's calibrate-STREAM-cfgN (`calibrate --prompts` of the same file on the demo workflow at that scale).
AGREEMENT_STREAMS = ("blocks-and-balls", "navy-and-grey", "reword-and-edit")
AGREEMENT_CFGS = (1, 4)
AGREEMENT_RUNS = tuple(f"{tool}-{stream}-cfg{cfg}" for stream in AGREEMENT_STREAMS for cfg in AGREEMENT_CFGS
                       for tool in ("agree", "calibrate"))


@dataclass(frozen=True)
class StoredRun:
    """One stored benchmark run: the conditions it had and the benchmark's JSON."""

    name: str
    conditions: RunConditions
    result: dict[str, Any]

    def config(self, name: str) -> dict[str, Any]:
        for config in self.result["configs"]:
            if config["name"] == name:
                return config
        raise KeyError(f"{self.name}: the run has no configuration {name!r}")

    @property
    def fewer_steps(self) -> list[dict[str, Any]]:
        """Plain at fewer steps, most steps first."""
        runs = [c for c in self.result["configs"] if fewer_steps_count(c["name"]) is not None]
        return sorted(runs, key=lambda c: -(fewer_steps_count(c["name"]) or 0))

    def time(self, config: dict[str, Any]) -> str:
        """The configuration's median time against plain, where the run had the machine to itself, with its 90 %
        interval over the run's requests where the run stored them."""
        if not self.conditions.alone:
            return "— (not measured alone)"
        times = self._request_times("plain"), self._request_times(config["name"])
        if config["name"] == "plain" or not all(times) or len(times[0]) != len(times[1]):
            return f"{config['speedup']:.2f}x"
        low, high = median_ratio_interval(*times)
        return f"{config['speedup']:.2f}x ({low:.2f}–{high:.2f}x)"

    def _request_times(self, name: str) -> list[float]:
        """The configuration's time per request, in request order; empty where the run did not store them."""
        return [p["configs"][name]["time_s"] for p in self.result.get("per_prompt", [])
                if "time_s" in p["configs"].get(name, {})]


def load_runs(names: Iterable[str], results_dir: Path) -> dict[str, StoredRun]:
    runs = {}
    for name in names:
        conditions, result = read_result(name, results_dir)
        runs[name] = StoredRun(name, conditions, result)
    return runs


# ------------------------------------------------------------------------------------------------ tables

def readme_table(runs: dict[str, StoredRun], link: Callable[[str], str]) -> str:
    """The README's short table: per stream the modes' calls and quality, and plain at fewer steps beside them."""
    lines = ["| stream | time against plain (balanced / fast) | balanced: calls, PSNR, adherence | "
             "fast: calls, PSNR, adherence | equal quality, by calls (balanced / fast) | "
             "plain at fewer steps: PSNR, adherence |", "|---|---|---|---|---|---|"]
    for name, label in STREAM_RUNS.items():
        run = runs[name]
        modes = [run.config(mode) for mode in MODES]
        time = run.conditions.why_no_time or " / ".join(run.time(c) for c in modes)
        quality = [f"{c['model_calls']:.1f}, {c['psnr']:.1f} dB, {_adherence(c)}" for c in modes]
        lines.append(f"| [{label}]({link(name)}) | {time} | {quality[0]} | {quality[1]} | {_equal_quality(modes)} | "
                     f"{_fewer_steps(run)} |")
    return "\n".join(lines) + "\n"


def streams_table(runs: dict[str, StoredRun], link: Callable[[str], str]) -> str:
    """Every stored stream run, each configuration it ran on a row of its own."""
    lines = ["| stream | config | time | model calls | PSNR (dB) | SSIM | adherence | "
             "equal-quality speedup (calls[, time]; against) |", "|---|---|---|---|---|---|---|---|"]
    for name, label in STREAM_RUNS.items():
        run = runs[name]
        for c in [run.config("plain"), *run.fewer_steps, *(run.config(mode) for mode in MODES)]:
            equal = c["equal_quality_speedup"]
            against = "" if equal is None else (_with_interval(equal) + (
                f", {equal['time']:.2f}x" if run.conditions.alone and equal.get("time") is not None else "")
                + f"; {equal['against']}")
            lines.append(f"| [{label}]({link(name)}) | {c['name']} | {run.time(c)} | {c['model_calls']:.1f} | "
                         f"{c['psnr']:.1f} | {c['ssim']:.3f} | {_adherence(c)} | {against} |")
    return "\n".join(lines) + "\n"


def runs_list(runs: dict[str, StoredRun], link: Callable[[str], str]) -> str:
    """What each stored run was: its command, code, versions, machine and what else ran beside it."""
    lines = []
    for name in runs:
        run = runs[name].conditions
        code = run.commit[:10] + (" with uncommitted changes" if run.uncommitted_changes else "")
        lines.append(
            f"- [`{name}`]({link(name)}): `{run.command}`; commit {code}; ComfyUI {run.comfyui_version}, frontend "
            f"{run.frontend_version or 'none'}, torch {run.torch_version}; {run.cores} cores, "
            f"{_threads(run.torch_threads)}, GPU {run.gpu or 'none'}; "
            f"{run.wall_seconds:.0f} s, load average {run.load_before[0]:.1f} before and {run.load_after[0]:.1f} "
            f"after; {run.beside}: " + ("alone, times shown." if run.alone else "shared, times not shown."))
    return "\n".join(lines) + "\n"


def deep_first_table(runs: dict[str, StoredRun], link: Callable[[str], str]) -> str:
    """How often a deep probe of a screened donor passed, by how far the donor's step-0 screen cleared that state's bar:
    the evidence behind the deep-first margin (`ProbeThresholds.deep_first_margin`). Every probe at a later step of a
    donor the request's screen judged counts once per stored run and prompt, whichever mode asked it."""
    thresholds = ProbeThresholds()
    edges = (0.0, thresholds.deep_first_margin, thresholds.give_up_margin)
    labels = ["below the bar", f"0 to {edges[1]:.2f}", f"{edges[1]:.2f} to {edges[2]:.2f}", f"{edges[2]:.2f} and more"]
    counts: dict[float, list[list[int]]] = {}
    names: dict[float, list[str]] = {}
    for name in DEEP_FIRST_RUNS:
        cfg = float(runs[name].result["settings"]["cfg"])
        names.setdefault(cfg, []).append(f"[{name}]({link(name)})")
        cells = counts.setdefault(cfg, [[0, 0] for _ in labels])
        for clearance, passed in _deep_probes(runs[name], thresholds):
            cell = cells[sum(clearance >= edge for edge in edges)]
            cell[0] += passed
            cell[1] += 1
    lines = ["| guidance scale | runs | " + " | ".join(f"screen cleared the bar by {label}" for label in labels) + " |",
             "|---|---|" + "---|" * len(labels)]
    for cfg, cells in sorted(counts.items()):
        lines.append(f"| {cfg:g} | {', '.join(names[cfg])} | " + " | ".join(
            f"{passed} of {asked} passed" if asked else "none asked" for passed, asked in cells) + " |")
    return "\n".join(lines) + "\n"


def _deep_probes(run: StoredRun, thresholds: ProbeThresholds) -> Iterable[tuple[float, bool]]:
    """(screen clearance at the probe's depth, passed) for each distinct deep probe of a screened donor in the run."""
    steps = run.result["settings"]["steps"]
    seen = set()
    for prompt in run.result["per_prompt"]:
        for config in prompt["configs"].values():
            probes = config.get("probes") or []
            screen = {p["donor_prompt"]: p["structure_agreement"] for p in probes
                      if p["step"] == 0 and p["structure_agreement"] is not None}
            for probe in probes:
                key = (prompt["prompt"], probe["donor_prompt"], probe["step"])
                if probe["step"] == 0 or probe["donor_prompt"] not in screen or key in seen:
                    continue
                seen.add(key)
                yield screen[probe["donor_prompt"]] - thresholds.needed_structure(probe["step"] / steps), probe["passed"]


def agreement_table(runs: dict[str, StoredRun], link: Callable[[str], str]) -> str:
    """The workload's equal-quality ratio beside the stream calibration's verdict on the same stream, guidance and
    modes, both by the one yardstick: whether the workload's ratio lies in the calibration's 90 % interval."""
    lines = ["| stream | cfg | mode | workload: calls ratio (90 % interval), against | calibration: verdict, against | "
             "workload inside the calibration's interval |", "|---|---|---|---|---|---|"]
    for stream in AGREEMENT_STREAMS:
        for cfg in AGREEMENT_CFGS:
            workload, calibration = runs[f"agree-{stream}-cfg{cfg}"], runs[f"calibrate-{stream}-cfg{cfg}"]
            for mode in MODES:
                bench = workload.config(mode)["equal_quality_speedup"]
                verdict = calibration.result["profile"]["equal_quality"][mode]
                low, high = verdict["interval"]
                inside = "yes" if low - 5e-4 <= bench["calls"] <= high + 5e-4 else "**no**"
                lines.append(
                    f"| [{stream}]({link(workload.name)}) | {cfg} | {mode} | {_with_interval(bench)}, "
                    f"{_against(bench['against'])} | [{ratio_words(verdict['calls'], (low, high), verdict['pairs'])}]"
                    f"({link(calibration.name)}), {_against(verdict['against'])} | {inside} |")
    return "\n".join(lines) + "\n"


TABLES: dict[str, Callable[[dict[str, StoredRun], Callable[[str], str]], str]] = {
    "readme": readme_table, "streams": streams_table, "runs": runs_list, "deep-first": deep_first_table,
    "agreement": agreement_table}


def _threads(count: int) -> str:
    return "torch on every core" if count == 0 else f"{count} torch thread" + "s" * (count > 1)


def _adherence(config: dict[str, Any]) -> str:
    return "n/a" if config["adherence"] is None else f"{config['adherence']:.3f}"


def _against(name: str) -> str:
    steps = fewer_steps_count(name)
    return "against plain" if steps is None else f"plain at {steps} steps"


def _equal_quality(modes: list[dict[str, Any]]) -> str:
    """The modes' equal-quality speedups by calls, in bold where plain at fewer steps is as good and cheaper."""
    speedups = [c["equal_quality_speedup"] for c in modes]
    ratios = " / ".join(_with_interval(s) for s in speedups)
    if any(round(s["calls"], 2) < 1 for s in speedups):
        ratios = f"**{ratios}**"
    against = {s["against"] for s in speedups}
    if len(against) == 1:
        return f"{ratios} ({_against(against.pop())})"
    return f"{ratios} ({' / '.join(_against(s['against']) for s in speedups)})"


def _with_interval(speedup: dict[str, Any]) -> str:
    """An equal-quality ratio by calls, with its 90 % interval where the run measured one."""
    interval = speedup.get("interval")
    return f"{speedup['calls']:.2f}x" + ("" if interval is None else f" ({interval[0]:.2f}–{interval[1]:.2f}x)")


def _fewer_steps(run: StoredRun) -> str:
    fewer = run.fewer_steps
    if not fewer:
        return "not run"
    adherences = {_adherence(c) for c in fewer}
    if len(adherences) > 1:
        return " · ".join(f"{fewer_steps_count(c['name'])}: {c['psnr']:.1f} dB, {_adherence(c)}" for c in fewer)
    cells = [f"{fewer_steps_count(c['name'])}: {c['psnr']:.1f}" for c in fewer]
    every = "all " if len(cells) > 1 else ""
    return f"{cells[0]} dB" + "".join(f" · {cell}" for cell in cells[1:]) + f"; {every}{adherences.pop()}"


# ------------------------------------------------------------------------------------------------ documents

def render(document: Path, text: str, results_dir: Path) -> tuple[str, list[str]]:
    """`text` with every marked table regenerated, and the names of the tables that changed."""
    changed: list[str] = []
    runs = load_runs(dict.fromkeys([*STREAM_RUNS, *DEEP_FIRST_RUNS, *AGREEMENT_RUNS]), results_dir) \
        if MARKED.search(text) else {}

    def link(name: str) -> str:
        return Path(os.path.relpath(results_dir / f"{name}.json", document.parent)).as_posix()

    def table(match: re.Match[str]) -> str:
        name = match["table"]
        if name not in TABLES:
            raise ValueError(f"{document}: no results table {name!r} (have: {', '.join(TABLES)})")
        body = TABLES[name](runs, link)
        if body != match["body"]:
            changed.append(name)
        return match["open"] + body + match["close"]

    return MARKED.sub(table, text), changed


def update(documents: Iterable[Path], results_dir: Path, check: bool) -> list[str]:
    """Regenerate the documents' tables (with `check`, only compare); one line per table that differed."""
    differed = []
    for document in documents:
        text = document.read_text()
        rendered, changed = render(document, text, results_dir)
        differed += [f"{document.name}: table {name!r}" for name in changed]
        if changed and not check:
            document.write_text(rendered)
    return differed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m carnator_core.bench report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a table differs from what its JSON gives")
    args = parser.parse_args(argv)
    try:
        differed = update(DOCUMENTS, RESULTS_DIR, args.check)
    except (OSError, KeyError, ValueError) as error:
        print(f"carnator bench report: {error}", file=sys.stderr)
        return 1
    for line in differed:
        print(f"{line} differs from its stored runs" if args.check else f"rewrote {line}",
              file=sys.stderr if args.check else sys.stdout)
    if args.check and differed:
        print("run `python -m carnator_core.bench report` and commit the tables", file=sys.stderr)
        return 1
    return 0

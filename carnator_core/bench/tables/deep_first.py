"""The deep-first table: how often a deep probe of a screened donor passed, by how far the donor's step-0 screen
cleared that state's bar, over the stored single-model stream runs."""

from __future__ import annotations

from collections.abc import Iterable

from carnator_core.bench.tables.cells import table
from carnator_core.bench.tables.stored_runs import Link, StoredRun, StoredRuns
from carnator_core.bench.tables.streams import EDIT_STREAM_RUNS
from carnator_core.judging.probe_thresholds import ProbeThresholds

# Each run's guidance scale is read from its settings; no stream and scale appears twice, so no probe counts twice.
DEEP_FIRST_RUNS = ("edit-loop", "reword-and-edit", "near-dup", "mixed", "unrelated", "reword-and-edit-cfg4",
                   *EDIT_STREAM_RUNS)


def deep_first_table(runs: StoredRuns, link: Link) -> str:
    """The evidence behind the deep-first margin (`ProbeThresholds.deep_first_margin`): every probe at a later step
    of a donor the request's screen judged counts once per stored run and prompt, whichever mode asked it."""
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
    rows = [[f"{cfg:g}", ", ".join(names[cfg]),
             *(f"{passed} of {asked} passed" if asked else "none asked" for passed, asked in cells)]
            for cfg, cells in sorted(counts.items())]
    return table(["guidance scale", "runs", *(f"screen cleared the bar by {label}" for label in labels)], rows)


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


TABLES = {"deep-first": deep_first_table}

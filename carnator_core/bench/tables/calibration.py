"""The pair calibrations' table, from stored `calibrate --pairs ... --record NAME` runs on the demo workflow: what each
fitted, how its held-back pairs judged it, whether it went in force, and the modes' verdicts against fewer steps."""

from __future__ import annotations

from typing import Any

from carnator_core.bench.tables.cells import MODES, against, table
from carnator_core.bench.tables.stored_runs import Link, StoredRuns
from carnator_core.judging.ratio_interval import ratio_words

# The demo workflow on the shipped pairs file's first 12 pairs (the default `--max-pairs`).
PAIR_CALIBRATION_RUNS = ("calibrate-pairs-12",)


def pair_calibrations_table(runs: StoredRuns, link: Link) -> str:
    rows = []
    for name in PAIR_CALIBRATION_RUNS:
        summary = runs[name].result
        profile = summary["profile"]
        rule = profile["thresholds"]
        rows.append([f"[`{name}`]({link(name)})", f"{profile['cfg']:g}",
                     f"{profile['fit_pairs']} / {profile['held_back_pairs']}",
                     f"{rule['structure']:.3f} + {rule['structure_slope']:.2f} × depth; guidance {rule['guidance']:.2f}",
                     _score(profile["held_back"]), _score(profile.get("oracle")),
                     "yes" if profile["in_force"] else f"no: {profile['reason']}",
                     *(_verdict(profile["equal_quality"].get(mode)) for mode in MODES),
                     (profile["equal_quality"].get("recommended") or {}).get("words", "—")])
    return table(["run", "cfg", "pairs fitted / held back", "filed rule (structure; guidance)",
                  "held back, by PSNR/SSIM: accepted, precision, recall", "held back, by the demo oracle",
                  "in force", "balanced against fewer steps", "fast against fewer steps", "recommended"], rows)


def _score(score: dict[str, Any] | None) -> str:
    if score is None:
        return "—"
    def share(value: float | None) -> str:
        return "—" if value is None else f"{value:.2f}"
    return f"{score['accepted']}, {share(score['precision'])}, {share(score['recall'])}"


def _verdict(verdict: dict[str, Any] | None) -> str:
    if verdict is None or verdict.get("interval") is None:
        return "no verdict"
    return f"{ratio_words(verdict['calls'], tuple(verdict['interval']), verdict['pairs'])}, {against(verdict['against'])}"


TABLES = {"pair-calibrations": pair_calibrations_table}

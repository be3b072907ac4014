"""What to run, per stored stream run (`judging.recommendation`: the cheapest steps and mode as good as full plain,
weighed at the workflow's steps and at the knee of the plain-steps curve), and the draft-final stream's finals."""

from __future__ import annotations

from typing import Any

from carnator_core.bench.tables.agreement import AGREEMENT_CFGS, AGREEMENT_STREAMS, agreement_run
from carnator_core.bench.tables.cells import table
from carnator_core.bench.tables.stored_runs import Link, StoredRuns

# The workload runs that weigh the modes at the knee too, the label of each row, and the stream calibration of the
# same stream and scale (None: none ran it).
RECOMMENDING_RUNS = {**{agreement_run("agree", stream, cfg): (f"{stream} (16), cfg {cfg}",
                                                              agreement_run("calibrate", stream, cfg))
                        for stream in AGREEMENT_STREAMS for cfg in AGREEMENT_CFGS},
                     "edit-loop-16": ("edit-loop (16), cfg 1", None)}
DRAFT_FINAL_RUN = "draft-final"


def recommended_table(runs: StoredRuns, link: Link) -> str:
    """Per stored stream run: the knee, each mode's calls there, and what to run, in words, by the workload and by the
    stream calibration of the same stream."""
    rows = []
    for name, (label, calibration) in RECOMMENDING_RUNS.items():
        result = runs[name].result
        knee = result["knee"]
        at_knee = ", ".join(f"{mode.split('@')[0]} {row['model_calls']:.1f} calls, detail {row['detail']:.3f}"
                            for mode, row in knee["modes"].items()) or "—"
        rows.append([f"[{label}]({link(name)})", f"{knee['steps']} of {result['settings']['steps']}", at_knee,
                     result["recommended"]["words"], _calibration_words(runs, link, calibration)])
    return table(["stream", "knee (plain steps as good as full plain)", "modes at the knee", "workload recommends",
                  "stream calibration recommends"], rows)


def _calibration_words(runs: StoredRuns, link: Link, name: str | None) -> str:
    if name is None:
        return "—"
    recommended = runs[name].result["profile"]["equal_quality"].get("recommended")
    return "— (calibrated without the knee)" if recommended is None else f"[{recommended['words']}]({link(name)})"


def draft_final_table(runs: StoredRuns, link: Link) -> str:
    """The draft-final stream per mode: finals rendered and resumed, their calls, their measures against the plain
    full render and their closeness to their drafts beside the plain full render's, and the targets met."""
    run = runs[DRAFT_FINAL_RUN]
    settings = run.result["settings"]
    rows = []
    for mode, row in run.result["draft_final"].items():
        targets = row["targets"]
        met = [name.replace("_", " ") for name, target in targets.items() if target["met"]]
        missed = [f"{name.replace('_', ' ')} ({_value(target)})" for name, target in targets.items()
                  if not target["met"]]
        rows.append([f"[{mode}]({link(run.name)})", f"{row['finals']} of {row['drafts']}", str(row["resumed"]),
                     f"{row['mean_calls']:.1f}", f"{row['mean_psnr']:.1f} dB", f"{row['mean_ssim']:.3f}",
                     f"{row['mean_detail']:.3f}", f"{row['mean_adherence']:.3f}",
                     f"{row['mean_psnr_to_draft']:.1f} dB ({row['plain_mean_psnr_to_draft']:.1f} dB)",
                     f"{len(met)} of {len(targets)}" + (f"; missed: {', '.join(missed)}" if missed else "")])
    return (f"Drafts at {settings['draft_steps']} steps, finals at {settings['steps']}, cfg {settings['cfg']:g}.\n\n"
            + table(["mode", "finals (of drafts)", "resumed", "mean calls", "PSNR to plain", "SSIM", "detail",
                     "adherence", "PSNR to draft (plain full's)", "targets met"], rows))


def _value(target: dict[str, Any]) -> str:
    if "of" in target:
        return f"{target['value']} of {target['of']}"
    value = target["value"]
    return f"{value:.2f}" if isinstance(value, float) else str(value)


TABLES = {"recommended": recommended_table, "draft-final": draft_final_table}

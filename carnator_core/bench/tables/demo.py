"""The demo's tables: the one-command demo's run (`demo run --record demo-run`) and the shipped demo model's
evaluation (`demo.train --eval --weights FILE --record demo-model-cfgN`)."""

from __future__ import annotations

from carnator_core.bench.tables.cells import table
from carnator_core.bench.tables.stored_runs import Link, StoredRuns

DEMO_RUN = "demo-run"
MODEL_RUNS = ("demo-model-cfg4", "demo-model-cfg1")


def demo_table(runs: StoredRuns, link: Link) -> str:
    """The whole command's time, ComfyUI's start to its stop, and each prompt's verdict, calls and adherence."""
    run = runs[DEMO_RUN]
    result, conditions = run.result, run.conditions
    time = (f"{conditions.wall_seconds:.0f} s from the command's start to its end, ComfyUI ready after "
            f"{result['comfyui_ready_s']:.0f} s") if conditions.alone else f"time {conditions.why_no_time}"
    rows = [[str(i), r["prompt"], r["verdict"], f"{r['skipped_steps']}/{r['total_steps']}",
             str(r["carnator_report"].get("model_calls", "—")),
             f"{r['time_s']:.1f}" if conditions.alone else "—", str(r["adherence"])]
            for i, r in enumerate(result["runs"], 1)]
    return (f"[`{DEMO_RUN}`]({link(DEMO_RUN)}): {result['steps']} steps, seed {result['seed']}, cfg {result['cfg']:g}, "
            f"mode {result['mode']}; {time}.\n\n"
            + table(["#", "prompt", "verdict", "skipped steps", "model calls", "time (s)", "oracle adherence"], rows))


def demo_model_table(runs: StoredRuns, link: Link) -> str:
    """The shipped weights on canonical prompts with fixed noise, scored by the oracle: overall and per attribute."""
    rows = []
    attributes = [key.removeprefix("acc_") for key in runs[MODEL_RUNS[0]].result if key.startswith("acc_")]
    for name in MODEL_RUNS:
        r = runs[name].result
        rows.append([f"[`{name}`]({link(name)})", str(r["n"]), str(r["steps"]), f"{r['cfg']:g}",
                     f"{r['adherence']:.3f}", *(f"{r[f'acc_{a}']:.3f}" for a in attributes),
                     ", ".join(f"{m} ({count})" for m, count in r["mistakes"].items()) or "none"])
    return table(["run", "prompts", "steps", "cfg", "adherence", *attributes, "mistakes (attribute: asked -> read)"],
                 rows)


TABLES = {"demo": demo_table, "demo-model": demo_model_table}

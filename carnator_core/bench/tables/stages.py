"""The stages tables: per stage of a staged workflow, each configuration's model calls and its outputs' closeness to
plain, from stored `bench stages --record` runs (the LTX-2 twin and HunyuanVideo 1.5's super-resolution twin on the
test harness's tiny models)."""

from __future__ import annotations

from functools import partial
from typing import Any

from carnator_core.bench.tables.cells import table
from carnator_core.bench.tables.stored_runs import Link, StoredRuns

STAGES_RUNS = ("stages-ltx2", "stages-hunyuan15-sr")


def stages_markdown(result: dict[str, Any]) -> str:
    """Per configuration: its model calls, each stage's, the hit rate, and each stage's and part's PSNR / SSIM."""
    stages = len(result["stages"])
    parts = [(q["stage"], q["part"]) for q in result["configs"][0]["quality"]]
    header = ["config", "model calls", *(f"stage {i + 1} calls" for i in range(stages)), "hit rate",
              *(f"stage {s} {p} PSNR / SSIM" for s, p in parts)]
    rows = []
    for row in result["configs"]:
        quality = {(q["stage"], q["part"]): q for q in row["quality"]}
        rows.append([row["name"], f"{row['model_calls']:.2f}", *(f"{c:.2f}" for c in row["stage_model_calls"]),
                     f"{row['hit_rate']:.2f}", *(f"{quality[k]['psnr']:.1f} dB / {quality[k]['ssim']:.3f}" for k in parts)])
    return table(header, rows).rstrip("\n")


def stages_table(name: str, runs: StoredRuns, link: Link) -> str:
    run = runs[name]
    return (f"[`{name}`]({link(name)}): `{run.result['workflow']}`, requests {', '.join(run.result['requests'])}; "
            f"stages {', '.join(run.result['stages'])}.\n\n" + stages_markdown(run.result) + "\n")


TABLES = {name: partial(stages_table, name) for name in STAGES_RUNS}

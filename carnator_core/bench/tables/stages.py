"""The stages tables: per stage of a staged workflow, each configuration's model calls and its outputs' closeness to
plain, from stored `bench stages --record` runs (the LTX-2 twin and HunyuanVideo 1.5's super-resolution twin on the
test harness's tiny models)."""

from __future__ import annotations

from functools import partial

from carnator_core.bench.stages import markdown
from carnator_core.bench.tables.stored_runs import Link, StoredRuns

STAGES_RUNS = ("stages-ltx2", "stages-hunyuan15-sr")


def stages_table(name: str, runs: StoredRuns, link: Link) -> str:
    run = runs[name]
    return (f"[`{name}`]({link(name)}): `{run.result['workflow']}`, requests {', '.join(run.result['requests'])}; "
            f"stages {', '.join(run.result['stages'])}.\n\n" + markdown(run.result) + "\n")


TABLES = {name: partial(stages_table, name) for name in STAGES_RUNS}

"""The attention tables: block-sparse against dense SDPA per stored `bench attention --record` run, and the
kernel's targets read from them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from carnator_core.bench.tables.cells import table, threads
from carnator_core.bench.tables.stored_runs import Link, StoredRuns

ATTENTION_RUNS = ("attention-fp32", "attention-bf16", "attention-flex")
MASKS_RUN = "masks"
Row = dict[str, Any]


@dataclass(frozen=True)
class AttentionTarget:
    """One target of the CPU path at H=12, D=128: the rows of a stored run it covers, the figure it reads from each,
    and the bound. A time figure holds where its least value does, an error where its largest does."""

    what: str
    run: str
    covers: Callable[[Row], bool]
    figure: Callable[[Row], float]
    wanted: str
    holds: Callable[[float], bool]
    timed: bool = True


TARGETS = (
    AttentionTarget("speedup at N=8192, density 12.5 %, fp32", "attention-fp32",
                    lambda r: r["n"] == 8192 and abs(r["density"] - 0.125) < 0.01, lambda r: r["speedup"],
                    "at least 6x", lambda v: v >= 6.0),
    AttentionTarget("speedup × density at every density up to 0.25, fp32", "attention-fp32",
                    lambda r: r["density"] <= 0.25, lambda r: r["speedup"] * r["density"], "at least 0.6",
                    lambda v: v >= 0.6),
    AttentionTarget("speedup at density 0.5, fp32", "attention-fp32", lambda r: r["density"] == 0.5,
                    lambda r: r["speedup"], "at least 1x (no slower than dense)", lambda v: v >= 1.0),
    AttentionTarget("max abs error against dense under the same mask, fp32", "attention-fp32", lambda r: True,
                    lambda r: r["max_abs_err"], "at most 1e-5", lambda v: v <= 1e-5, timed=False),
    AttentionTarget("max abs error against dense under the same mask, bf16", "attention-bf16", lambda r: True,
                    lambda r: r["max_abs_err"], "at most 2e-2", lambda v: v <= 2e-2, timed=False),
)


def attention_table(name: str, runs: StoredRuns, link: Link) -> str:
    """One stored attention run: per sequence length and density, dense and block-sparse seconds, the speedup and
    its share of the ideal 1/density (times only from a run that had the machine to itself), and the error."""
    run = runs[name]
    config = run.result["config"]
    timed = run.conditions.alone
    rows = [[str(r["n"]), f"{r['density']:.4f}", *_times(r, timed), f"{r['max_abs_err']:.2e}"]
            for r in run.result["rows"]]
    header = ["N", "density", "dense (s)", "block-sparse (s)", "speedup", "speedup × density", "max abs error"]
    return (f"[`{name}`]({link(name)}): {config['device']}, backend `{config['backend']}`, {config['dtype']}, "
            f"{threads(config['threads'])}, {config['clock']} clock, block {config['block_size']}, medians of "
            f"{config['repeats']}" + ("" if timed else f"; times {run.conditions.why_no_time}") + ".\n\n"
            + table(header, rows))


def attention_targets_table(runs: StoredRuns, link: Link) -> str:
    """Each target with the worst figure of the rows it covers, and whether it held."""
    rows = []
    for target in TARGETS:
        run = runs[target.run]
        values = [target.figure(r) for r in run.result["rows"] if target.covers(r)]
        if not values:
            measured, met = "not measured", "—"
        elif target.timed and not run.conditions.alone:
            measured, met = "— (not measured alone)", "—"
        else:
            worst = min(values) if target.timed else max(values)
            measured = (f"{worst:.2f}" + (" (least)" if len(values) > 1 else "")) if target.timed else f"{worst:.2e}"
            met = "yes" if target.holds(worst) else "**no**"
        rows.append([target.what, f"[{target.run}]({link(target.run)})", target.wanted, measured, met])
    return table(["target", "run", "wanted", "measured", "met"], rows)


def masks_table(runs: StoredRuns, link: Link) -> str:
    """Do borrowed masks carry over: the share of a request's attention mass a mask from each source keeps."""
    result = runs[MASKS_RUN].result
    return (f"From [`{MASKS_RUN}`]({link(MASKS_RUN)}): {result['requests']} requests, {result['steps']} steps, "
            f"{result['block_tokens']}-token key blocks.\n\n" + masks_markdown(result) + "\n")


def masks_markdown(result: dict) -> str:
    """Per noise level and density, the recall of a mask from each source (`bench masks`), in the run's order."""
    sources = [key for key in result["rows"][0] if key not in ("sigma", "density")]
    rows = [[str(row["sigma"]), str(row["density"]), *(f"{row[s]:.3f}" for s in sources)] for row in result["rows"]]
    return table(["sigma", "density", *sources], rows).rstrip("\n")


def _times(row: dict[str, Any], timed: bool) -> list[str]:
    if not timed:
        return ["—"] * 4
    return [f"{row['dense_s']:.3f}", f"{row['sparse_s']:.3f}", f"{row['speedup']:.2f}x",
            f"{row['speedup'] * row['density']:.2f}"]


TABLES = {"attention-targets": attention_targets_table, "masks": masks_table,
          **{name: partial(attention_table, name) for name in ATTENTION_RUNS}}



"""The exact-repeat table, from a stored `bench exact-repeats` run: what the same request queued again costs against
sampling it plain, whether it is the first run bit for bit, and what an entry weighs with the output that serves it."""

from __future__ import annotations

from carnator_core.bench.tables.cells import table
from carnator_core.bench.tables.stored_runs import Link, StoredRuns

EXACT_REPEATS_RUN = "exact-repeats"
KIB = 1024


def exact_repeats_markdown(result: dict, time_cell: str | None = None) -> str:
    """One row: repeats served exactly, bit-identical, model calls against plain's, the time ratio (or `time_cell`,
    why there is none), the entry and its output blob."""
    summary, settings = result["summary"], result["settings"]
    low, high = summary["time_ratio_range"]
    time = time_cell or f"{summary['time_ratio']:.1f}x ({low:.1f}–{high:.1f}x)"
    row = [f"{summary['exact']} of {summary['repeats']}", f"{summary['identical']} of {summary['repeats']}",
           f"{summary['median_calls']:g} (plain {summary['plain_median_calls']:g})", f"{summary['calls_ratio']:.1f}x",
           time, f"{summary['bytes_per_entry'] / KIB:,.0f} KiB", f"{summary['final_bytes_per_entry'] / KIB:,.0f} KiB"]
    return (f"{settings['steps']} steps, {settings['sampler']} {settings['scheduler']}, cfg {settings['cfg']:g}, "
            f"shift {settings['shift']:g}.\n\n"
            + table(["served as exact repeats", "the first run bit for bit", "model calls, median",
                     "fewer calls than plain", "faster than plain (sampler time, median of interleaved pairs)",
                     "entry", "of it, the output"], [row]))


def exact_repeats_table(runs: StoredRuns, link: Link) -> str:
    run = runs[EXACT_REPEATS_RUN]
    time_cell = None if run.conditions.alone else f"— ({run.conditions.why_no_time})"
    return f"From [`{EXACT_REPEATS_RUN}`]({link(EXACT_REPEATS_RUN)}): " + exact_repeats_markdown(run.result, time_cell)


TABLES = {"exact-repeats": exact_repeats_table}

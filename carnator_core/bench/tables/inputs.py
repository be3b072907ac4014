"""The input distance bound's tables, from stored `bench inputs --record` runs: per input distance, the resumes the
model accepted and how many of those were good and borrowed from the donor."""

from __future__ import annotations

from functools import partial

from carnator_core.bench.tables.cells import table
from carnator_core.bench.tables.stored_runs import Link, StoredRuns

INPUT_RUNS = ("inputs-cfg1", "inputs-cfg5")


def inputs_table(name: str, runs: StoredRuns, link: Link) -> str:
    summary = runs[name].result["summary"]
    rows = [[distance, str(cell["pairs"]), str(cell["resumes"]), str(cell["accepted"]), str(cell["accepted_good"]),
             str(cell["accepted_borrowed"]), str(cell["good"]),
             "—" if cell["psnr_accepted_median"] is None else f"{cell['psnr_accepted_median']:.1f} dB"]
            for distance, cell in summary["bins"].items()]
    bound = summary["safe_bound"]
    largest = summary["largest_good_accepted"]
    return (f"[`{name}`]({link(name)}): {summary['rows']} resumes; every accepted resume was good"
            + ("" if bound is None else f" below input distance {bound:.3f}")
            + ("" if largest is None else f"; the largest good accepted lay at {largest:.3f}")
            + f"; the shipped bound is {summary['shipped_bound']}.\n\n"
            + table(["input distance", "pairs", "resumes", "accepted", "accepted and good", "of those borrowed",
                     "good", "median PSNR accepted"], rows))


TABLES = {name: partial(inputs_table, name) for name in INPUT_RUNS}

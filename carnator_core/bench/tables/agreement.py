"""The agreement table: the workload's equal-quality ratio beside the stream calibration's verdict, on the same
streams, guidance scales and modes, both weighed by the one yardstick."""

from __future__ import annotations

from carnator_core.bench.tables.cells import MODES, against, table, with_interval
from carnator_core.bench.tables.stored_runs import Link, StoredRuns
from carnator_core.judging.ratio_interval import ratio_words

# Each stream at each guidance scale: the workload's record is agree-STREAM-cfgN (`bench workload --prompts
# docs/streams/STREAM.txt --configs balanced,fast --cfg N`), the stream calibration's calibrate-STREAM-cfgN
# (`calibrate --prompts` of the same file on the demo workflow at that scale).
AGREEMENT_STREAMS = ("blocks-and-balls", "navy-and-grey", "reword-and-edit")
AGREEMENT_CFGS = (1, 4)


def agreement_run(tool: str, stream: str, cfg: int) -> str:
    """The stored run of `tool` ("agree": the workload, "calibrate": the calibration) on a stream at a scale."""
    return f"{tool}-{stream}-cfg{cfg}"


AGREEMENT_RUNS = tuple(agreement_run(tool, stream, cfg) for stream in AGREEMENT_STREAMS for cfg in AGREEMENT_CFGS
                       for tool in ("agree", "calibrate"))


def agreement_table(runs: StoredRuns, link: Link) -> str:
    """Whether the workload's ratio lies in the calibration's 90 % interval, per stream, scale and mode."""
    rows = []
    for stream in AGREEMENT_STREAMS:
        for cfg in AGREEMENT_CFGS:
            workload = runs[agreement_run("agree", stream, cfg)]
            calibration = runs[agreement_run("calibrate", stream, cfg)]
            for mode in MODES:
                bench = workload.config(mode)["equal_quality_speedup"]
                verdict = calibration.result["profile"]["equal_quality"][mode]
                low, high = verdict["interval"]
                inside = "yes" if low - 5e-4 <= bench["calls"] <= high + 5e-4 else "**no**"
                words = ratio_words(verdict["calls"], (low, high), verdict["pairs"])
                rows.append([f"[{stream}]({link(workload.name)})", str(cfg), mode,
                             f"{with_interval(bench)}, {against(bench['against'])}",
                             f"[{words}]({link(calibration.name)}), {against(verdict['against'])}", inside])
    return table(["stream", "cfg", "mode", "workload: calls ratio (90 % interval), against",
                  "calibration: verdict, against", "workload inside the calibration's interval"], rows)


TABLES = {"agreement": agreement_table}

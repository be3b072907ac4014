"""The probe calibration's tables, from stored `bench probe --record` runs: which signal predicts a good resume, how
the shipped rule does at each depth, the step-0 screen per relation, what a donor adds over the request's own
shortcut, the depth table of one stream's pairs, and the screen across guidance scales."""

from __future__ import annotations

from functools import partial
from typing import Any

from carnator_core.bench.tables.cells import table
from carnator_core.bench.tables.stored_runs import Link, StoredRuns
from carnator_core.judging.probe_thresholds import ProbeThresholds

# Pairs of every relation on the demo model (`bench probe --pairs N --steps 20 --cfg C --shortcuts --record probe-cfgC`)
PROBE_RUNS = ("probe-cfg1", "probe-cfg5", "probe-cfg6")
# The reword-and-edit stream's prompts against their scene's first one (`bench probe --pairs-file
# docs/streams/reword-and-edit-pairs.txt --shortcuts --seed 42 --cfg C --record probe-reword-and-edit-cfgC`)
DEPTH_RUN = "probe-reword-and-edit-cfg1"
GUIDED_DEPTH_RUN = "probe-reword-and-edit-cfg4"
# Where a `--shortcuts` row resumed from (`bench probe`'s RESUMES), in words.
RESUME_WORDS = {"donor": "donor state", "corrected": "corrected donor state", "own_shortcut": "own shortcut (no donor)"}


def probe_tables(name: str, runs: StoredRuns, link: Link) -> str:
    """One probe run's summary as tables: AUC per depth, the shipped rule per depth, the step-0 screen per relation,
    the resumes that kept plain's adherence per relation and depth, and (with shortcuts) what each start borrowed."""
    run = runs[name]
    summary, rows = run.result["summary"], run.result["rows"]
    settings = run.result["settings"]
    signals = list(summary["auc"])
    relations = list(summary["start_screen_by_relation"])  # in the benchmark's order of relations
    parts = [f"[`{name}`]({link(name)}): {summary['rows']} probes ({len(_pairs(rows))} pairs × "
             f"{len(summary['auc_by_depth'])} depths), {settings['steps']} steps, cfg {settings['cfg']:g}; resumed as "
             f"adherent as plain in {summary['outcome_rate']:.0%}.\n"]
    auc = [["all", *(_number(summary["auc"][s]) for s in signals)]]
    auc += [[depth, *(_number(values[s]) for s in signals)] for depth, values in summary["auc_by_depth"].items()]
    parts.append("**AUC for predicting \"resuming keeps adherence\"**\n\n" + table(["depth", *signals], auc))
    rule = [["all", *_rule_cells(summary["default_rule"]), "—"]]
    rule += [[depth, *_rule_cells(cell), "{threshold:.3f} ({recall})".format(
        threshold=summary["safe_structure_threshold_by_depth"][depth]["threshold"],
        recall=_number(summary["safe_structure_threshold_by_depth"][depth]["recall"]))]
        for depth, cell in summary["default_rule_by_depth"].items()]
    after = summary["default_rule_after_start_screen"]
    rule.append(["all, after the step-0 screen", *_rule_cells(after), "—"])
    parts.append("**The shipped rule (`ProbeThresholds`) against the outcomes**\n\n" + table(
        ["depth", "accepted", "would keep adherence", "precision", "recall",
         "lowest safe structure threshold (its recall)"], rule))
    screen = [[relation, f"{cell['passed']}/{cell['pairs']}", f"{cell['structure_min']:.2f} to {cell['structure_max']:.2f}",
               f"{cell['conditional_min']:.2f} to {cell['conditional_max']:.2f}" if "conditional_min" in cell else "—"]
              for relation, cell in summary["start_screen_by_relation"].items()]
    parts.append("**The step-0 screen per relation**\n\n" + table(
        ["relation", "pairs passed", "output's structure agreement", "conditional branches' agreement"], screen))
    depths = sorted({row["depth"] for row in rows})
    kept = [[relation, *(_kept(rows, relation, depth) for depth in depths)] for relation in relations]
    parts.append("**Resumes from the donor state that kept plain's adherence**\n\n" + table(
        ["relation", *(f"depth {depth:.2f}" for depth in depths)], kept))
    if summary["shortcuts_by_relation"]:
        starts = list(RESUME_WORDS)
        shortcuts = [[relation, *(f"{cell[start]['kept']}/{cell[start]['rows']}, {cell[start]['psnr_median']:.1f} dB"
                                  for start in starts)]
                     for relation, cell in summary["shortcuts_by_relation"].items()]
        parts.append("**Where a resume starts: kept plain's adherence / resumes, median PSNR against plain**\n\n"
                     + table(["relation", *RESUME_WORDS.values()], shortcuts))
    corrected = summary.get("corrected_rule")
    if corrected:
        raw = corrected["donor_state"]
        by_relation = ", ".join(f"{count} {relation}" for relation, count in corrected["accepted_by_relation"].items())
        parts.append("**The rule on the rows whose pair passes the step-0 screen**\n\n" + table(
            ["resumed at", "accepted", "precision", "recall", "closer to plain than the own shortcut"],
            [["donor state, verified against the donor's prediction", str(raw["accepted"]), _number(raw["precision"]),
              _number(raw["recall"]), "—"],
             [f"corrected state, verified against the corrected prediction ({by_relation or 'none'})",
              str(corrected["accepted"]), _number(corrected["precision"]), _number(corrected["recall"]),
              str(corrected["borrowed"])]]))
    return "\n".join(parts)


def depth_table(runs: StoredRuns, link: Link) -> str:
    """Per pair of the stream (its relation and step-0 screen) and depth: the corrected state's structure agreement,
    the corrected resume's adherence (plain's in brackets) and its PSNR against the request's own plain clip."""
    run = runs[DEPTH_RUN]
    rows = run.result["rows"]
    depths = sorted({row["depth"] for row in rows})
    thresholds = ProbeThresholds()
    body = []
    for (relation, screen), pair in _pairs(rows).items():
        at = {row["depth"]: row for row in pair}
        body.append([f"{relation}, {screen:.3f}", *(
            f"{at[d]['corrected_structure_agreement']:.3f} · {at[d]['corrected'][0]:.2f} "
            f"({at[d]['adherence_plain']:.2f}) · {at[d]['corrected'][1]:.1f} dB" for d in depths)])
    header = ["pair (relation, step-0 screen)", *(f"{d:.0%} (bar {thresholds.needed_structure(d):.3f})" for d in depths)]
    return f"From [`{DEPTH_RUN}`]({link(DEPTH_RUN)}).\n\n" + table(header, body)


def screen_across_guidance_table(runs: StoredRuns, link: Link) -> str:
    """Per relation, the range over its pairs of the step-0 structure agreement: the output's at cfg 1 (the
    conditional branch's there), and at the guided run's scale the output's and the conditional branches'."""
    plain, guided = runs[DEPTH_RUN], runs[GUIDED_DEPTH_RUN]
    cfg = guided.result["settings"]["cfg"]
    screens = plain.result["summary"]["start_screen_by_relation"], guided.result["summary"]["start_screen_by_relation"]
    body = []
    for relation, cell in screens[0].items():
        other = screens[1][relation]
        body.append([f"{relation} ({cell['pairs']})", _range(cell["structure_min"], cell["structure_max"]),
                     _range(other["structure_min"], other["structure_max"]),
                     _range(other["conditional_min"], other["conditional_max"]) if "conditional_min" in other else "—"])
    header = ["relation (pairs)", f"cfg {plain.result['settings']['cfg']:g}, output", f"cfg {cfg:g}, output",
              f"cfg {cfg:g}, conditional branch"]
    return (f"From [`{DEPTH_RUN}`]({link(DEPTH_RUN)}) and [`{GUIDED_DEPTH_RUN}`]({link(GUIDED_DEPTH_RUN)}).\n\n"
            + table(header, body))


def _pairs(rows: list[dict[str, Any]]) -> dict[tuple[str, float], list[dict[str, Any]]]:
    """The rows of each pair, in the order the run made them: a pair's rows share its relation and step-0 screen."""
    pairs: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for row in rows:
        pairs.setdefault((row["relation"], row["start_structure_agreement"]), []).append(row)
    return pairs


def _kept(rows: list[dict[str, Any]], relation: str, depth: float) -> str:
    at = [row for row in rows if row["relation"] == relation and row["depth"] == depth]
    return f"{sum(row['adherence_resumed'] >= row['adherence_plain'] - 1e-9 for row in at)}/{len(at)}"


def _rule_cells(cell: dict[str, Any]) -> list[str]:
    return [str(cell["accepted"]), str(cell["good"]), _number(cell["precision"]), _number(cell["recall"])]


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _range(low: float, high: float) -> str:
    return f"{low:.2f}" if round(low, 2) == round(high, 2) else f"{low:.2f} to {high:.2f}"



TABLES = {"depth-table": depth_table, "screen-across-guidance": screen_across_guidance_table,
          **{name: partial(probe_tables, name) for name in PROBE_RUNS}}

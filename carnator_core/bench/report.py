"""`python -m carnator_core.bench report [--check]`: the results tables of the README and the docs,
generated from the stored runs in docs/results/ (each benchmark's `--record NAME`), and the frontier plots of
docs/measurements.md (docs/images/frontier-RUN.png, where matplotlib is installed).

Each table sits between `<!-- results:TABLE -->` and `<!-- /results:TABLE -->`, and all between is rewritten: a figure
typed there by hand does not survive the next report, and `--check` (run in CI) fails while a table differs from what
its JSON gives. A time ratio is shown only from a run that had the machine to itself (`RunConditions.alone`);
otherwise the time cell says why it is empty, and the calls and quality stand alone. The tables themselves are
written by `carnator_core.bench.tables`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from carnator_core.bench.tables import TABLES
from carnator_core.bench.tables.cells import threads
from carnator_core.bench.tables.stored_runs import Link, StoredRuns
from carnator_core.recorded_runs import NO_COMFYUI, REPO_DIR, RESULTS_DIR

DOCUMENTS = (REPO_DIR / "README.md", *sorted((REPO_DIR / "docs").glob("*.md")))
MARKED = re.compile(r"(?P<open><!-- results:(?P<table>[a-z0-9-]+) -->\n)(?P<body>.*?)(?P<close><!-- /results:(?P=table) -->)",
                    re.S)


def runs_list(runs: StoredRuns, link: Link) -> str:
    """What each stored run was: its command, code, versions, machine and what else ran beside it."""
    lines = []
    for name in runs.names():
        run = runs[name].conditions
        code = run.commit[:10] + (" with uncommitted changes" if run.uncommitted_changes else "")
        host = "no ComfyUI" if run.comfyui_version == NO_COMFYUI else \
            f"ComfyUI {run.comfyui_version}, frontend {run.frontend_version or 'none'}"
        if not run.timed:
            times = "calls and quality only, no times."
        else:
            times = "alone, times shown." if run.alone else "shared, times not shown."
        lines.append(
            f"- [`{name}`]({link(name)}): `{run.command}`; commit {code}; {host}, torch {run.torch_version}; "
            f"{run.cores} cores, {threads(run.torch_threads)}, GPU {run.gpu or 'none'}; "
            f"{run.wall_seconds:.0f} s, load average {run.load_before[0]:.1f} before and {run.load_after[0]:.1f} "
            f"after; {run.beside}: {times}")
    return "\n".join(lines) + "\n"


PUBLISHED = {**TABLES, "runs": runs_list}


# ------------------------------------------------------------------------------------------------ documents

def render(document: Path, text: str, results_dir: Path) -> tuple[str, list[str]]:
    """`text` with every marked table regenerated, and the names of the tables that changed."""
    changed: list[str] = []
    runs = StoredRuns(results_dir)

    def link(name: str) -> str:
        return Path(os.path.relpath(results_dir / f"{name}.json", document.parent)).as_posix()

    def table(match: re.Match[str]) -> str:
        name = match["table"]
        if name not in PUBLISHED:
            raise ValueError(f"{document}: no results table {name!r} (have: {', '.join(PUBLISHED)})")
        body = PUBLISHED[name](runs, link)
        if body != match["body"]:
            changed.append(name)
        return match["open"] + body + match["close"]

    return MARKED.sub(table, text), changed


FRONTIER_RUNS = ("agree-reword-and-edit-cfg4", "edit-loop-16")  # the runs docs/measurements.md plots


def frontier_plots(results_dir: Path) -> list[str]:
    """The frontier plot of each stored run of FRONTIER_RUNS that weighed the knee (quality against model calls:
    plain's curve, each mode at the workflow's steps and at the knee), written beside the results as
    images/frontier-RUN.png; the notes of those not written. (Its imports are here: `--check` runs where the
    benchmark's own dependencies are not installed.)"""
    from carnator_core.bench.workload_output import frontier_points
    from carnator_core.judging.plot import plot_unavailable, yardstick_panels

    runs, notes = StoredRuns(results_dir), []
    images_dir = results_dir.parent / "images"
    for name in FRONTIER_RUNS:
        if name not in runs.names() or "recommended" not in runs[name].result:
            continue
        result = runs[name].result
        title = f"{name}: the yardstick's measures against model calls; {result['recommended']['words']}"
        if yardstick_panels(result["plain_steps_curve"], frontier_points(result), images_dir / f"frontier-{name}.png",
                            title) is None:
            notes.append(plot_unavailable(f"frontier plot of {name}"))
    return notes


def update(documents: Iterable[Path], results_dir: Path, check: bool) -> list[str]:
    """Regenerate the documents' tables (with `check`, only compare); one line per table that differed."""
    differed = []
    for document in documents:
        text = document.read_text()
        rendered, changed = render(document, text, results_dir)
        differed += [f"{document.name}: table {name!r}" for name in changed]
        if changed and not check:
            document.write_text(rendered)
    return differed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m carnator_core.bench report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a table differs from what its JSON gives")
    args = parser.parse_args(argv)
    try:
        differed = update(DOCUMENTS, RESULTS_DIR, args.check)
    except (OSError, KeyError, ValueError) as error:
        print(f"carnator bench report: {error}", file=sys.stderr)
        return 1
    for line in differed:
        print(f"{line} differs from its stored runs" if args.check else f"rewrote {line}",
              file=sys.stderr if args.check else sys.stdout)
    if not args.check:
        for note in frontier_plots(RESULTS_DIR):
            print(note)
    if args.check and differed:
        print("run `python -m carnator_core.bench report` and commit the tables", file=sys.stderr)
        return 1
    return 0

"""Calibrate Carnator's probe thresholds on your own model, through ComfyUI's queue.

    python -m carnator_core.calibrate --server http://127.0.0.1:8188 --workflow API.json \\
        (--pairs FILE | --from-store) --out DIR [--psnr 30] [--ssim 0.95] [--precision 0.95]

The workflow (API format, one sampler) runs as it is, with the model it loads and its own sampler settings. For
each pair (earlier prompt, new prompt; the workflow's seed) calibration samples both plain, then resumes the new
prompt from the earlier run at each depth (`--depths`), forced whatever the rule says, and records the signals the
engine judged each resume on and how close its clip came to the new prompt's plain clip (PSNR and SSIM on decoded
frames where the workflow decodes, on latents otherwise; with the demo model, the demo world's oracle too).

It then fits the thresholds that accept the most resumes whose clip meets the target (`--psnr`, `--ssim`) while
keeping at least `--precision` of accepted resumes on target, scores them on held-back pairs, writes
`DIR/profile.json`, `DIR/summary.json` and a plot per signal, and files the profile in the store the workflow's reuse
node reads: from then on that node, with its thresholds left at their defaults (auto), judges this model and
schedule by it, and its report says so.

`--pairs FILE`: one pair per line, the two prompts separated by a tab. `--from-store`: pairs drawn from the store's
own history (successive prompts of one model, schedule and seed). Run again with the same arguments to resume an
interrupted calibration. Exit status: 0 done; 1 interrupted or nothing measured; 2 bad arguments or workflow.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
from pathlib import Path

from carnator_core.bench.plot import scatter
from carnator_core.calibration.fit import accepts, fit
from carnator_core.calibration.pairs import Pair, pairs_from_history, read_pairs
from carnator_core.calibration.profile import THRESHOLD_RANGES, Profile, QualityTarget
from carnator_core.calibration.session import CalibrationInterrupted, Measured, Session
from carnator_core.calibration.workflow import CalibrationWorkflow
from carnator_core.client import ComfyClient, ComfyError
from carnator_core.prompt_file import PromptFileError
from carnator_core.queue import Workflow, WorkflowError
from carnator_core.reuse.settings import FORCED_DEPTHS

HISTORY_PAGE = 100


def _depths(text: str) -> list[float]:
    depths = sorted({float(value) for value in text.split(",") if value.strip()})
    unknown = [d for d in depths if not any(abs(d - f) < 1e-9 for f in FORCED_DEPTHS)]
    if not depths or unknown:
        raise argparse.ArgumentTypeError(f"depths must be among {', '.join(map(str, FORCED_DEPTHS))}")
    return depths


def history_pairs(client: ComfyClient, session_workflow: CalibrationWorkflow, limit: int) -> tuple[list[Pair], str]:
    """Pairs from the history of the store the workflow's reuse node reads."""
    location = Session.store_location(client, session_workflow)
    entries, offset = [], 0
    while True:
        query = urllib.parse.urlencode({"store": location, "offset": offset, "limit": HISTORY_PAGE})
        page = client.api(f"/carnator/store/entries?{query}")
        entries += page.get("entries", [])
        offset += HISTORY_PAGE
        if offset >= int(page.get("total") or 0):
            return pairs_from_history(entries, limit)


def plots(measured: list[Measured], profile: Profile, out: Path) -> list[Path]:
    """One scatter per signal: each resume's signal against its PSNR to plain, one colour per depth, with the target
    PSNR (horizontal) and the fitted threshold at each depth (vertical) as guides."""
    written = []
    for signal in ("structure", "guidance"):
        ordered = sorted((m for m in measured if getattr(m.resume, signal) is not None), key=lambda m: m.resume.depth)
        points = [(f"{m.resume.depth:.0%}", getattr(m.resume, signal), m.resume.psnr_db) for m in ordered]
        if points:
            threshold, slope = profile.thresholds[signal], profile.thresholds[signal + "_slope"]
            bars = tuple(sorted({round(min(1.0, threshold + slope * m.resume.depth), 4) for m in ordered}))
            title = (f"{signal} agreement vs PSNR to plain, coloured by resume depth; fitted threshold "
                     f"{threshold:.3f} + {slope:.2f} x depth (vertical), target {profile.target.psnr_db:.0f} dB "
                     f"(horizontal)")
            written.append(scatter(points, out / f"plot-{signal}.png", title, f"{signal} agreement at the resume",
                                   "PSNR to plain (dB)", x_lines=bars, y_lines=(profile.target.psnr_db,),
                                   colour_by_label=True))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m carnator_core.calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True, help="ComfyUI's URL, e.g. http://127.0.0.1:8188")
    parser.add_argument("--workflow", required=True, type=Path, help="API-format workflow with one sampler")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--pairs", type=Path, help="pairs file: earlier and new prompt per line, tab-separated")
    source.add_argument("--from-store", action="store_true", help="pairs from the store's own history")
    parser.add_argument("--out", required=True, type=Path, help="where profile.json, the rows and plots go")
    parser.add_argument("--depths", type=_depths, default=list(FORCED_DEPTHS),
                        help="resume depths, fractions of the steps (default: every checkpoint depth)")
    parser.add_argument("--max-pairs", type=int, default=12, help="most pairs taken from the file or the store")
    parser.add_argument("--psnr", type=float, default=QualityTarget.psnr_db, help="dB to plain a good resume keeps")
    parser.add_argument("--ssim", type=float, default=QualityTarget.ssim, help="SSIM to plain a good resume keeps")
    parser.add_argument("--precision", type=float, default=QualityTarget.precision,
                        help="share of accepted resumes that must be good")
    parser.add_argument("--name", default=None, help="the profile's name (default: the workflow file's name)")
    parser.add_argument("--text-node", default=None, help="node id holding the prompt text, where it is ambiguous")
    parser.add_argument("--no-install", action="store_true", help="write profile.json only; do not file it")
    args = parser.parse_args(argv)
    target = QualityTarget(psnr_db=args.psnr, ssim=args.ssim, precision=args.precision)
    started = time.monotonic()
    try:
        workflow = Workflow.load(args.workflow, args.text_node)
        pairs = read_pairs(args.pairs)[:args.max_pairs] if args.pairs else []
    except (WorkflowError, PromptFileError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    with ComfyClient(args.server) as client:
        if not client.alive():
            print(f"error: cannot reach ComfyUI at {args.server}: is it running, and is --server right?",
                  file=sys.stderr)
            return 2
        try:
            prepared = CalibrationWorkflow.prepare(workflow, client.object_info())
            if args.from_store:
                pairs, note = history_pairs(client, prepared, args.max_pairs)
                print(note)
            if not pairs:
                print("error: no pairs to calibrate on", file=sys.stderr)
                return 2
            session = Session(client, prepared, pairs, args.depths, args.out)
            print(f"calibrating on {len(pairs)} pairs x {len(args.depths)} depths "
                  f"({'decoded frames' if prepared.decoder else 'latents'}"
                  f"{', demo oracle' if prepared.runs_demo else ''}); results in {args.out}")
            measured = session.run()
        except WorkflowError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        except CalibrationInterrupted as error:
            print(f"interrupted: {error}\nwhat finished is kept in {args.out}; run the same command to resume",
                  file=sys.stderr)
            return 1
        except ComfyError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        if not measured or not session.fingerprints:
            print("error: no resume could be measured (see above)", file=sys.stderr)
            return 1
        result = fit([m.resume for m in measured], target)
        profile = Profile(model=session.fingerprints["model"], schedule=session.fingerprints["schedule"],
                          name=args.name or args.workflow.stem,
                          thresholds={name: getattr(result.thresholds, name) for name in THRESHOLD_RANGES},
                          target=target, fit_pairs=result.fit_pairs, held_back_pairs=result.held_back_pairs,
                          held_back=result.held_back, oracle=result.oracle,
                          cfg=float(session.fingerprints.get("cfg", 1.0)))
        (args.out / "profile.json").write_text(profile.to_json())
        summary = {"profile": profile.as_dict(), "fitted": result.fitted.__dict__, "resumes": len(measured),
                   "skipped_pairs": session.skipped, "plots": [str(p) for p in plots(measured, profile, args.out)]}
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"{len(measured)} resumes measured in {(time.monotonic() - started) / 60:.1f} min")
        print("depth  resumes  good  accepted by the fitted rule (of them good)")
        for depth in sorted({m.resume.depth for m in measured}):
            at = [m.resume for m in measured if m.resume.depth == depth]
            good = [target.good(r.psnr_db, r.ssim) for r in at]
            taken = [accepts(result.thresholds, r) for r in at]
            print(f"{depth:5.0%}  {len(at):7}  {sum(good):4}  {sum(taken):8} ({sum(t and g for t, g in zip(taken, good, strict=True))})")
        print(f"fitted: structure {result.thresholds.structure:.3f}, guidance {result.thresholds.guidance:.2f}, "
              f"slope {result.thresholds.structure_slope:.2f}")
        print(f"held back ({result.held_back_pairs} pairs): precision {_share(result.held_back.precision)}, recall "
              f"{_share(result.held_back.recall)}" + (f"; by the demo oracle: precision "
                                                       f"{_share(result.oracle.precision)}, recall "
                                                       f"{_share(result.oracle.recall)}" if result.oracle else ""))
        if not args.no_install:
            try:
                location = session.install(profile.as_dict())
            except ComfyError as error:
                print(f"error: the profile could not be filed in the store: {error}", file=sys.stderr)
                return 1
            print(f"filed as {profile.describe()} in the store at {location}")
    return 0


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())

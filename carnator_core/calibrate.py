"""Calibrate Carnator's probe thresholds on your own model, through ComfyUI's queue.

    python -m carnator_core.calibrate --server http://127.0.0.1:8188 --workflow API.json \\
        [--prompts FILE] [--pairs FILE | --from-store] --out DIR [--psnr 30] [--ssim 0.95] [--precision 0.95]

The workflow (API format, one sampler, or stages one after another: then the first stage is calibrated) runs as it
is, with the model it loads and its own sampler settings. For each pair (earlier prompt, new prompt; the workflow's
seed) calibration samples both plain, then resumes the new prompt from the earlier run at each depth (`--depths`),
forced whatever the rule says, and records the signals the engine judged each resume on and how close its clip
came to the new prompt's plain clip (PSNR and SSIM on decoded frames where the workflow decodes, on latents
otherwise; with the demo model, the demo world's oracle too).

It then fits the thresholds that accept the most resumes whose clip meets the target (`--psnr`, `--ssim`) while
keeping at least `--precision` of accepted resumes on target, scores them on held-back pairs, writes
`DIR/profile.json`, `DIR/summary.json` and a plot per signal (with matplotlib, the `plot` extra), and files the
profile in the store the workflow's reuse node reads. It is put in force only where its precision on the held-back
pairs meets the target and is not below the shipped rule's on them (`--force` puts it in force anyway): from then on
that node, with its thresholds left at their defaults (auto), judges this model and schedule by it, and its report
says so. The first line printed says whether it is in force and why.

Is reuse worth it here at all? `--prompts FILE` answers it on your own stream, in your order: each prompt sampled
plain, then in balanced and in fast exactly as the engine runs each (its own store, every earlier prompt a donor, its
real screen, anchor and probe calls), then plain at the step counts that bracket each mode's quality (bisected; at
most four plain runs per prompt in all). Each mode is weighed by one yardstick (as adherent where the demo oracle
scores, as close to plain by PSNR, as detailed) against the cheapest plain run as good: the last lines say, per mode,
"saves 1.30x (1.10–1.50x)", "lower the steps instead (...)" or "not settled (...)" with the 90 % interval over the
prompts (the profile's `equal_quality`; docs/calibration.md). `--from-store` weighs the store's own history as the
stream. With pairs alone, each pair is weighed as a two-prompt stream (plain also at bisected step counts, then
balanced and fast at the knee; `--no-fewer-steps` leaves that out). A stream alone fits no thresholds: its profile is not in force, and where the
store already holds one for this model and schedule, that one keeps its thresholds and takes the verdict.

`--pairs FILE`: one pair per line, the two prompts separated by a tab. `--from-store`: pairs and the stream drawn from
the store's own history (successive prompts of one model, schedule and seed). Run again with the same arguments to resume an
interrupted calibration. Exit status: 0 done; 1 interrupted or nothing measured; 2 bad arguments or workflow.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from carnator_core.calibration.job import CalibrationPlan, NoPairs, NothingToCalibrate, calibrate
from carnator_core.calibration.server_runs import CalibrationInterrupted
from carnator_core.calibration.workflow import CalibrationWorkflow
from carnator_core.client import ComfyClient, ComfyError
from carnator_core.demo.clip_oracle import register_demo_oracle
from carnator_core.judging.quality_target import QualityTarget
from carnator_core.prompt_file import RULE as PROMPT_FILE_RULE
from carnator_core.prompt_file import PromptFileError, read_prompt_file
from carnator_core.prompt_pairs import read_pairs
from carnator_core.queue import Workflow, WorkflowError
from carnator_core.recorded_runs import Recording, add_record_option
from carnator_core.reuse.settings import FORCED_DEPTHS


def _depths(text: str) -> tuple[float, ...]:
    depths = sorted({float(value) for value in text.split(",") if value.strip()})
    unknown = [d for d in depths if not any(abs(d - f) < 1e-9 for f in FORCED_DEPTHS)]
    if not depths or unknown:
        raise argparse.ArgumentTypeError(f"depths must be among {', '.join(map(str, FORCED_DEPTHS))}")
    return tuple(depths)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m carnator_core.calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True, help="ComfyUI's URL, e.g. http://127.0.0.1:8188")
    parser.add_argument("--workflow", required=True, type=Path, help="API-format workflow with one sampler (or stages)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--pairs", type=Path, help="pairs file: earlier and new prompt per line, tab-separated")
    source.add_argument("--from-store", action="store_true",
                        help="pairs, and the stream of prompts, from the store's own history")
    parser.add_argument("--prompts", type=Path,
                        help=f"your stream of prompts, in your order, to weigh reuse on: a UTF-8 text file, "
                             f"{PROMPT_FILE_RULE}")
    parser.add_argument("--out", required=True, type=Path, help="where profile.json, the rows and plots go")
    parser.add_argument("--depths", type=_depths, default=FORCED_DEPTHS,
                        help="resume depths, fractions of the steps (default: every checkpoint depth)")
    parser.add_argument("--max-pairs", type=int, default=CalibrationPlan.max_pairs,
                        help="most pairs taken from the file or the store")
    parser.add_argument("--psnr", type=float, default=QualityTarget.psnr_db, help="dB to plain a good resume keeps")
    parser.add_argument("--ssim", type=float, default=QualityTarget.ssim, help="SSIM to plain a good resume keeps")
    parser.add_argument("--precision", type=float, default=QualityTarget.precision,
                        help="share of accepted resumes that must be good")
    parser.add_argument("--name", default=None, help="the profile's name (default: the workflow file's name)")
    parser.add_argument("--text-node", default=None, help="node id holding the prompt text, where it is ambiguous")
    parser.add_argument("--no-install", action="store_true", help="write profile.json only; do not file it")
    parser.add_argument("--force", action="store_true",
                        help="put the profile in force even where its held-back pairs do not support it; every report "
                             "it judges then says so")
    add_record_option(parser, "the run's summary (its torch threads: this process's OMP_NUM_THREADS, 0 where unset)")
    parser.add_argument("--no-fewer-steps", action="store_true",
                        help="do not sample plain at fewer steps, so no mode is weighed against lowering the steps")
    args = parser.parse_args(argv)
    register_demo_oracle()  # the demo model's clips are judged by its world's oracle
    if not (args.pairs or args.from_store or args.prompts):
        parser.error("give --prompts FILE (a stream), --pairs FILE, or --from-store")
    if args.prompts and args.from_store:
        parser.error("--from-store draws the stream from the store's history: give --prompts with --pairs, or alone")
    try:
        workflow = Workflow.load(args.workflow, args.text_node)
        pairs = read_pairs(args.pairs) if args.pairs else None if args.from_store else []
        prompts = read_prompt_file(args.prompts) if args.prompts else None
    except (WorkflowError, PromptFileError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    with ComfyClient(args.server) as client:
        if not client.alive():
            print(f"error: cannot reach ComfyUI at {args.server}: is it running, and is --server right?",
                  file=sys.stderr)
            return 2
        try:
            plan = CalibrationPlan(workflow=CalibrationWorkflow.prepare(workflow, client.object_info()), pairs=pairs,
                                   out=args.out, name=args.name or args.workflow.stem, depths=args.depths,
                                   target=QualityTarget(psnr_db=args.psnr, ssim=args.ssim, precision=args.precision),
                                   max_pairs=args.max_pairs, install=not args.no_install, force=args.force,
                                   fewer_steps=not args.no_fewer_steps, prompts=prompts)
            recording = Recording(args.record, "carnator_core.calibrate", argv or sys.argv[1:])
            calibrated = calibrate(client, plan)
            if args.record:  # a verdict of calls and quality: the server's CPU is another process's, and no time
                summary = json.loads((args.out / "summary.json").read_text())
                stored = recording.store({"kind": "calibration", **summary}, comfyui=client.comfyui_version(),
                                         torch_threads=int(os.environ.get("OMP_NUM_THREADS", "0")), timed=False)
                print(f"recorded {stored}")
        except (WorkflowError, NothingToCalibrate) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2 if isinstance(error, (WorkflowError, NoPairs)) else 1
        except CalibrationInterrupted as error:
            print(f"interrupted: {error}\nwhat finished is kept in {args.out}; run the same command to resume",
                  file=sys.stderr)
            return 1
        except ComfyError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    print("\n".join(calibrated.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

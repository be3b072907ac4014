"""Workload benchmark: a prompt stream through a real headless ComfyUI, every configuration side by side.

    python -m carnator_core.bench workload --stream {near-dup,unrelated,mixed,adversarial,edit-loop,draft-final}
        [--prompts FILE] [--graph single|two-expert] [--n 6] [--seed fixed|random] [--steps 30] [--cfg 1.0]
        [--draft-steps 8]
        [--weights FILE] [--threads 1] [--attention-heavy] [--shared-store] [--json] [--out DIR] [--record NAME]

Configurations (each with its own store directory, all in one server so they share the loaded model):
plain · easycache (ComfyUI's EasyCache) · text-only (CarnatorReuse verification=text-only: skip depth from
prompt similarity, no probe, NIRVANA/Chorus style) · own-masks (CarnatorSparseAttention, online masks) ·
any-donor-masks (CarnatorSparseAttention borrowed+own, masks of an unrelated donor prompt via a
CarnatorCompatibilityLookup fed that prompt's conditioning) · safe · balanced · fast (CarnatorReuse modes,
node defaults) · balanced+easycache · plain-<n>: plain at n = steps // 2, steps // 3 and steps // 4 steps (same seed,
sampler and scheduler), named by their step count (plain-15, plain-10, plain-7 at 30 steps). A fraction whose step
count is 0 or one a larger fraction already runs has no configuration (a progress line says so): `--steps 2` runs
plain-1 alone, `--steps 4` plain-2 and plain-1.

Every other configuration's `equal_quality_speedup`, but for the step caches (EasyCache), whose leftover noise the
detail measure would count as detail, weighs it by the one yardstick the calibration also uses
(`judging.yardstick`: as adherent, as close to plain by PSNR, as detailed) against the cheapest plain run as good: of
those fewer-steps runs and of the plain-steps curve, plain sampled after the stream at the step counts that bracket
each configuration's quality and the knee (`judging.plain_steps_curve`, at most four more counts), else full plain. It gives that
run's mean model calls over the configuration's with a 90 % bootstrap interval over the requests, the words ("saves
1.61x (...)", "lower the steps instead", "not settled"), the steps plain needs and the measure that decided; and the
median time ratio where that run is one of the interleaved rows (the curve's runs are not timed against the stream).
A hit is a request that skipped steps (resumed, or a stage skipped);
`masks_only_rate` is the share that borrowed a donor's attention masks and sampled every step.

Method: one prompt at a time, every configuration on it, the order rotated per prompt so that machine drift
(other processes on a shared CPU) spreads over all configurations. A configuration's time is the wall time
of the nodes it adds plus the sampler's (per-node times from ComfyUI's websocket, never past the prompt's end as the
server stamped it: `PromptRun`); text encoding, model loading and file saving are the same everywhere and left out.
The server's torch runs on `--threads` threads (1 by default): on a CPU the sampler then takes one core and the rest
serve ComfyUI's own threads and Carnator's background work, as a GPU server's CPU does beside its sampling, and
identical runs spread less than with every core shared between them. Every configuration first runs once on a
throwaway prompt (2 steps, plain-<n> its n; separate stores) so that no timed run pays for loading a model or a
kernel. After a run that records, the benchmark waits until the server's background writer has stored the entry,
so the write neither overlaps the next timed run nor is missed by the next lookup. Quality: PSNR/SSIM of the
decoded clip against the same prompt's plain clip (same seed), and the demo oracle's adherence (share of
shape, colour, motion and background that match the prompt; prompts it cannot parse are left out).

`--graph two-expert` runs the stream on the Wan 2.2 14B template's shape instead: the demo model as both experts,
each loader -> ModelSamplingSD3 -> (CarnatorReuse) -> KSamplerAdvanced, the first sampling to the half-way boundary
with leftover noise and the second continuing; configurations plain, its plain-<n> (the boundary at n // 2, at
least 1), safe, balanced and fast, and the first expert's calls per request reported apart. Every table also gives
the calls and the speedup of the requests that resumed; `edit-loop` adds which kinds of edit resumed and how deep.

`--shared-store` has safe, balanced and fast look up in one store, each prompt recorded there by one of them in turn,
which runs it after the others: every mode meets the same donors, recorded by requests in every mode, and none meets
its own prompt's; the nesting check (`nesting`) then
compares the modes on the same store: per prompt, steps skipped beside model calls. Such a run samples no
plain-steps curve and weighs no mode at the knee: each mode's calls and quality owe something to the donors the
other modes recorded, so a ratio against plain at fewer steps would not be the mode's own.

`--stream draft-final` drafts every prompt at `--draft-steps` and renders the final at `--steps` where the demo
oracle finds the draft adherent, in balanced and fast (`--configs`), each final resuming from its draft
(`carnator_core.bench.draft_final`); a generated stream is the unrelated one (a new scene per prompt).

`--attention-heavy` adds a timing-only configuration: a random-weight Wan 2.1 model on >= 4k video tokens,
where attention dominates a step as in full-size models, plain versus CarnatorSparseAttention with own masks.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from carnator_core.bench import stages
from carnator_core.bench.draft_final import (
    DRAFT_FINAL,
    MODES,
    draft_final_markdown,
    run_draft_final,
    summarise_draft_final,
)
from carnator_core.bench.random_wan import write_random_wan
from carnator_core.bench.stages import STAGED_GRAPHS
from carnator_core.bench.streams import KINDED_STREAMS, STREAMS, edit_kinds, make_stream
from carnator_core.bench.workload_configurations import (
    CONFIGS,
    DENSE_ATTENTION,
    HEAVY_MODEL,
    SHARED_MODES,
    SHARED_STORE,
    TWO_EXPERT_CONFIGS,
    expert_boundary,
    store_dir,
)
from carnator_core.bench.workload_output import details, machine, markdown, write_outputs
from carnator_core.bench.workload_stream import (
    Bench,
    Sample,
    attention_heavy,
    bytes_per_entry,
    run_stream,
    run_two_expert_stream,
    score_samples,
)
from carnator_core.bench.workload_weighing import (
    KNEE_MODES,
    curve_table,
    knee_steps,
    nesting,
    per_kind,
    plain_steps_curve,
    recommended,
    summarise,
    targets,
)
from carnator_core.client import ComfyError
from carnator_core.comfyui_location import ComfyNotFound, find_comfyui
from carnator_core.demo import graphs, world
from carnator_core.demo.server import DemoSetupError, demo_server, demo_weights
from carnator_core.judging.fewer_steps import fewer_steps
from carnator_core.prompt_file import RULE as PROMPT_FILE_RULE
from carnator_core.prompt_file import read_prompt_file
from carnator_core.recorded_runs import Recording, add_record_option, comfyui_version


def _config_list(text: str) -> set[str]:
    """`--configs`: names separated by commas, plain always among them."""
    return {"plain", *(name.strip() for name in text.split(",") if name.strip())}


def main(argv: list[str]) -> int:
    staged = argparse.ArgumentParser(add_help=False)
    staged.add_argument("--graph")
    if staged.parse_known_args(argv)[0].graph in STAGED_GRAPHS:  # a shipped staged workflow on the user's server
        return stages.main(argv)
    parser = argparse.ArgumentParser(prog="python -m carnator_core.bench workload",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--stream", choices=(*STREAMS, DRAFT_FINAL), default="near-dup")
    parser.add_argument("--graph", choices=("single", "two-expert", *STAGED_GRAPHS), default="single",
                        help="single: one model and KSampler (every configuration); two-expert: the Wan 2.2 14B "
                             "template's shape, the demo model as both experts in two KSamplerAdvanced with the "
                             "boundary half-way (plain and the reuse modes); ltx2-two-stage, hunyuan15-sr: the "
                             "shipped LTX-2 workflow, or HunyuanVideo 1.5's with its super-resolution group, on your "
                             "server (--server), measured per stage (`bench stages`)")
    parser.add_argument("--prompts", help=f"your own stream, run in order: a UTF-8 text file, {PROMPT_FILE_RULE}")
    parser.add_argument("--n", type=int, default=6, help="prompts in a generated stream")
    parser.add_argument("--seed", choices=("fixed", "random"), default="fixed",
                        help="fixed: one seed for every prompt (the editing loop); random: a seed per prompt, "
                             "and the reuse nodes take donors with any noise (seed_policy serving)")
    parser.add_argument("--steps", type=int, default=30,
                        help="sampling steps (plain also runs at 1/2, 1/3 and 1/4 of them: the plain-<n> rows)")
    parser.add_argument("--cfg", type=float, default=1.0)
    parser.add_argument("--draft-steps", type=int, default=8,
                        help="draft-final stream: the drafts' steps (the finals run --steps)")
    parser.add_argument("--weights", help="demo model .safetensors (default: $CARNATOR_DEMO_WEIGHTS, else shipped)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the benchmark's ComfyUI server (0: torch's default, every core)")
    parser.add_argument("--attention-heavy", action="store_true",
                        help="also time plain vs own-mask sparse attention on a random-weight >= 4k-token model")
    parser.add_argument("--configs", type=_config_list, default=None,
                        help="only these configurations, comma-separated (plain always runs: quality is measured "
                             "against it; plain-<n> rows only where named, e.g. plain-10); default: all")
    parser.add_argument("--shared-store", action="store_true",
                        help="safe, balanced and fast look up in one store, each prompt recorded there by one of "
                             "them in turn: every mode meets the same donors, recorded by requests in every mode "
                             "(no plain-steps curve: the modes' ratios would not be their own)")
    parser.add_argument("--json", action="store_true", help="print only the result object as JSON")
    parser.add_argument("--out", type=Path, default=Path("carnator-bench-output"))
    add_record_option(parser)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the ComfyUI server is stopped
    say = (lambda message: print(message, file=sys.stderr, flush=True)) if args.json else \
        (lambda message: print(message, flush=True))
    try:
        if args.steps < 2:
            raise DemoSetupError("--steps must be at least 2")
        if args.threads < 0:
            raise DemoSetupError("--threads must be 0 (every core) or more")
        drafting = args.stream == DRAFT_FINAL
        if drafting and not 1 <= args.draft_steps < args.steps:
            raise DemoSetupError("--draft-steps must be at least 1 and fewer than --steps")
        prompts = read_prompt_file(args.prompts) if args.prompts else \
            make_stream("unrelated" if drafting else args.stream, args.n)
        weights = demo_weights(args.weights)
        recording = Recording(args.record, "carnator_core.bench workload", argv)
        result, settings, details = (_run_draft_final if drafting else _run)(args, prompts, weights, say)
        comfyui = comfyui_version(find_comfyui())
    except (DemoSetupError, ComfyNotFound, ComfyError, OSError, ValueError) as error:
        print(f"carnator workload benchmark: {error}", file=sys.stderr)
        return 1
    if drafting:
        return _draft_final_outputs(args, recording, result, settings, details, comfyui)
    paths = write_outputs(args.out, result, settings, details)
    stored = recording.store({**result, "settings": settings, "per_prompt": details}, comfyui=comfyui,
                             torch_threads=args.threads)
    paths += [stored] if stored is not None else []
    if args.json:
        print(json.dumps(result))
    else:
        print(markdown(result, settings))
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _run_draft_final(args: argparse.Namespace, prompts: list[str], weights: Path,
                     say: Callable[[str], None]) -> tuple[dict, dict, list]:
    """The draft-final stream on one server: per prompt the plain full render, the drafts and the finals."""
    modes = MODES if args.configs is None else tuple(mode for mode in MODES if mode in args.configs)
    if args.configs is not None and set(args.configs) - {"plain", *MODES}:
        raise ValueError(f"--configs: the draft-final stream runs {', '.join(MODES)}")
    seeds = [42] * len(prompts) if args.seed == "fixed" else \
        [int(s) for s in np.random.default_rng(0).integers(0, 2**31, len(prompts))]
    base_dir = Path(tempfile.mkdtemp(prefix="carnator-bench-"))
    say(f"starting ComfyUI headless (base directory {base_dir}) ...")
    try:
        threads = {"OMP_NUM_THREADS": str(args.threads)} if args.threads > 0 else None
        with demo_server(base_dir, weights, extra_args=DENSE_ATTENTION, env=threads) as (client, unet):
            rows = run_draft_final(Bench(client, base_dir), unet, prompts, seeds, args.steps, args.draft_steps,
                                   args.cfg, modes, say)
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)
    stream = f"file:{Path(args.prompts).name}" if args.prompts else DRAFT_FINAL
    settings = {"graph": "single", "steps": args.steps, "draft_steps": args.draft_steps, "seed": args.seed,
                "seeds": seeds, "cfg": args.cfg, "weights": str(weights), "machine": machine(),
                "comfyui_args": list(DENSE_ATTENTION), "server_threads": args.threads}
    result = {"stream": f"{stream} ({DRAFT_FINAL})", "prompts": prompts,
              "draft_final": summarise_draft_final(rows, modes, args.steps)}
    return result, settings, rows


def _draft_final_outputs(args: argparse.Namespace, recording: Recording, result: dict, settings: dict,
                         rows: list, comfyui: str) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "workload_draft_final.json"
    path.write_text(json.dumps({**result, "settings": settings, "per_prompt": rows}, indent=1))
    stored = recording.store({**result, "settings": settings, "per_prompt": rows}, comfyui=comfyui,
                             torch_threads=args.threads)
    if args.json:
        print(json.dumps(result))
    else:
        print(draft_final_markdown(result["draft_final"], settings))
        print("wrote " + ", ".join(str(p) for p in [path] + ([stored] if stored is not None else [])))
    return 0


def _plain_steps_curve(args: argparse.Namespace, samples: dict[str, list[Sample]],
                       plain_at: Callable[[int, int], Sample], prompts: list[str],
                       say: Callable[[str], None]) -> dict[str, list[Sample]]:
    """The plain runs the bisection adds (`plain_steps_curve`); none with `--shared-store`, whose modes' ratios would
    owe something to each other's donors."""
    curve: dict[str, list[Sample]] = {}
    if args.shared_store:
        say("--shared-store: the modes met each other's donors, so no plain-steps curve is sampled and each mode is "
            "weighed against the plain runs of the stream alone")
    else:
        plain_steps_curve(samples, curve, args.steps, plain_at, prompts, say)
    return curve


def _modes_at_knee(args: argparse.Namespace, bench: Bench, unet: str, prompts: list[str], seeds: list[int],
                   seed_policy: str, samples: dict[str, list[Sample]], curve: dict[str, list[Sample]],
                   configs: tuple[str, ...], say: Callable[[str], None]) -> dict[str, list[Sample]]:
    """Balanced and fast (those among `configs`) run again at the knee of the plain-steps curve (the fewest plain
    steps as good as full plain, `judging.recommendation`), in stores of their own, scored against full plain: at
    most two more mode runs per prompt. Empty where the knee is the full steps, and with `--shared-store` (whose modes
    meet each other's donors: the knee's own stores would not compare with them)."""
    count = knee_steps(samples, curve, args.steps)
    modes = tuple(mode for mode in KNEE_MODES if mode in configs)
    if count >= args.steps or not modes or args.shared_store:
        return {}
    say(f"knee of the plain-steps curve: plain at {count} steps is as good as plain at {args.steps}; "
        f"{', '.join(modes)} at {count} steps on every prompt")
    if args.graph == "two-expert":
        runs = run_two_expert_stream(bench, unet, prompts, seeds, count, args.cfg, seed_policy, say, [], modes,
                                     store_prefix="knee")
    else:
        runs = run_stream(bench, unet, prompts, seeds, count, args.cfg, seed_policy, say, [], modes,
                          store_prefix="knee")[0]
    at_knee = {f"{mode}@{count}": runs[mode] for mode in modes}
    score_samples(prompts, {"plain": samples["plain"], **at_knee})
    return at_knee


def _run(args: argparse.Namespace, prompts: list[str], weights: Path,
         say: Callable[[str], None]) -> tuple[dict, dict, list]:
    seeds = [42] * len(prompts) if args.seed == "fixed" else \
        [int(s) for s in np.random.default_rng(0).integers(0, 2**31, len(prompts))]
    seed_policy = "same-noise" if args.seed == "fixed" else "serving"
    fewer, skipped = fewer_steps(args.steps)
    for line in skipped:
        say(line)
    available = TWO_EXPERT_CONFIGS if args.graph == "two-expert" else CONFIGS
    configs = available if args.configs is None else tuple(name for name in available if name in args.configs)
    if args.configs is not None:
        unknown = sorted(set(args.configs) - set(available) - set(fewer))
        if unknown:
            raise ValueError(f"--configs: no configuration {', '.join(unknown)} on this graph "
                             f"(have: {', '.join(available[1:] + tuple(fewer))})")
        fewer = [name for name in fewer if name in args.configs]
    base_dir = Path(tempfile.mkdtemp(prefix="carnator-bench-"))
    heavy_unet = "carnator_random_wan_heavy.safetensors"
    if args.attention_heavy:
        write_random_wan(base_dir / "models" / "diffusion_models" / heavy_unet, HEAVY_MODEL)
    say(f"starting ComfyUI headless (base directory {base_dir}) ...")
    try:
        threads = {"OMP_NUM_THREADS": str(args.threads)} if args.threads > 0 else None
        with demo_server(base_dir, weights, extra_args=DENSE_ATTENTION, env=threads) as (client, unet):
            bench = Bench(client, base_dir)
            if args.graph == "two-expert":
                donor = None
                samples = run_two_expert_stream(bench, unet, prompts, seeds, args.steps, args.cfg, seed_policy, say,
                                                fewer, configs, args.shared_store)
                store_bytes = {name: bytes_per_entry(base_dir / store_dir(
                    f"two-expert-{SHARED_STORE if args.shared_store and name in SHARED_MODES else name}"))
                               for name in configs if name != "plain"}

                def plain_at(i: int, steps: int) -> Sample:
                    graph = graphs.two_expert_graph(unet, prompts[i], seed=seeds[i], steps=steps,
                                                    boundary=expert_boundary(steps), cfg=args.cfg)
                    return bench.sample(f"plain-{steps}", graph, steps, expert_boundary(steps))
            else:
                samples, store_bytes, donor = run_stream(bench, unet, prompts, seeds, args.steps, args.cfg,
                                                         seed_policy, say, fewer, configs, args.shared_store)

                def plain_at(i: int, steps: int) -> Sample:
                    graph = graphs.base_graph(unet, prompts[i], seed=seeds[i], steps=steps, cfg=args.cfg)
                    return bench.sample(f"plain-{steps}", graph, steps)
            score_samples(prompts, samples)
            curve = _plain_steps_curve(args, samples, plain_at, prompts, say)
            at_knee = _modes_at_knee(args, bench, unet, prompts, seeds, seed_policy, samples, curve, configs, say)
            heavy = attention_heavy(bench, heavy_unet, progress=say) if args.attention_heavy else None
    finally:
        if (base_dir / "comfyui.log").exists():
            args.out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(base_dir / "comfyui.log", args.out / "comfyui.log")
        shutil.rmtree(base_dir, ignore_errors=True)
    stream = f"file:{Path(args.prompts).name}" if args.prompts else args.stream
    if args.graph == "two-expert":
        stream += " (two-expert)"
    result = {"stream": stream, "prompts": prompts, "configs": summarise(samples, store_bytes, args.steps, curve),
              "plain_steps_curve": curve_table(samples, curve, args.steps), "nesting": nesting(prompts, samples),
              **recommended(samples, curve, at_knee, args.steps)}
    if args.stream in KINDED_STREAMS and not args.prompts:
        result["per_kind"] = per_kind(edit_kinds(args.stream, len(prompts)), samples)
    if not args.prompts:
        result["targets"] = targets(args.stream, samples)
    settings = {"graph": args.graph, "shared_store": args.shared_store, "steps": args.steps, "seed": args.seed, "seeds": seeds, "cfg": args.cfg, "weights": str(weights),
                "donor_prompt": donor, "clip": list(world.CLIP), "attention_heavy": heavy, "machine": machine(),
                "seed_policy": seed_policy, "comfyui_args": list(DENSE_ATTENTION), "server_threads": args.threads}
    return result, settings, details(prompts, seeds, samples)

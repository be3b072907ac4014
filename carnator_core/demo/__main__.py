"""`python -m carnator_core.demo run`: the main job end to end, under a minute on a 2-core CPU.

Starts ComfyUI headless with this pack ($COMFYUI_PATH), queues a short prompt stream through the HTTP API (a
scene, two one-word edits of it, a paraphrase, an unrelated scene) with CarnatorReuse in front of the stock
KSampler, saves each clip as an animated WEBP (stock SaveAnimatedWEBP) plus a JSON report into the output
folder, prints progress while it runs and a summary table at the end, and stops the server.

Every prompt samples from the same seed (42) for 30 steps at cfg 4 with CarnatorReuse in balanced mode: at these
settings each built-in prompt's plain clip shows what its prompt asks for (tests/server/test_demo_run.py checks it),
so the hits and misses are the only thing the stream shows.

    python -m carnator_core.demo run [--out DIR] [--prompts FILE] [--steps N] [--seed N] [--cfg X] [--mode M]
                                     [--weights FILE] [--port N]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

from carnator_core.client import ComfyError, PromptRun
from carnator_core.comfyui_location import ComfyNotFound, find_comfyui
from carnator_core.demo import graphs, world
from carnator_core.demo.oracle import score
from carnator_core.demo.server import DemoSetupError, demo_server, demo_weights, pick_port
from carnator_core.prompt_file import RULE as PROMPT_FILE_RULE
from carnator_core.prompt_file import PromptFileError, read_prompt_file
from carnator_core.recorded_runs import Recording, add_record_option, comfyui_version
from carnator_core.reuse.report import RunReport, Verdict
from carnator_core.workflow_graph import complete

DEFAULT_PROMPTS = (
    "a red circle moving left on a black background",
    "a red circle moving left on a gray background",  # edit: background
    "a blue circle moving left on a black background",  # edit: object colour
    "a small red ball drifting leftwards over black",  # paraphrase of the first
    "a green triangle rising on a white background",  # unrelated
)
STORE = "carnator_store"  # inside the (throwaway) ComfyUI base directory


def demo_graph(unet_name: str, prompt: str, index: int, steps: int, seed: int, cfg: float, mode: str) -> dict:
    """Plain demo chain with CarnatorReuse, the clip as WEBP, the latent (for the oracle) and the report."""
    graph = graphs.base_graph(unet_name, prompt, seed=seed, steps=steps, cfg=cfg)
    graph = graphs.with_reuse(graph, STORE, prompt, mode=mode)
    graph = graphs.with_webp(graph, f"carnator_demo/{index:02d}")
    return graphs.with_save_latent(graph, f"carnator_demo/{index:02d}")


def _saved(run: PromptRun, node: str, key: str, base_dir: Path) -> Path:
    item = run.history["outputs"][node][key][0]
    return base_dir / item.get("type", "output") / item["subfolder"] / item["filename"]


def _progress(index: int, total: int, prompt: str):
    label = f"[{index + 1}/{total}] {prompt[:48]}"
    interactive = sys.stdout.isatty()
    last = [-1]

    def show(node: str, step: int, steps: int) -> None:
        if node != graphs.SAMPLER or steps <= 0:
            return
        if interactive:
            print(f"\r{label}  step {step}/{steps}", end="", flush=True)
        elif step * 4 // steps != last[0]:  # a line per quarter when not on a terminal
            last[0] = step * 4 // steps
            print(f"{label}  step {step}/{steps}", flush=True)

    return show


def _row(prompt: str, report: dict, adherence: float | None, seconds: float) -> dict:
    run = RunReport.from_dict(report)
    return {"prompt": prompt, "hit": run.hit, "verdict": run.verdict.value, "skipped_steps": run.skipped_steps,
            "total_steps": run.total_steps, "time_s": round(seconds, 2),
            "adherence": "unscorable" if adherence is None else round(adherence, 2)}


def summary_table(rows: list[dict]) -> str:
    lines = ["| # | prompt | hit/miss | skipped steps | time (s) | oracle adherence |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i} | {r['prompt']} | {Verdict(r['verdict']).label} | {r['skipped_steps']}/"
                     f"{r['total_steps']} | {r['time_s']:.1f} | {r['adherence']} |")
    return "\n".join(lines)


def run_demo(prompts: list[str], out: Path, steps: int, weights: Path, port: int | None, seed: int, cfg: float,
             mode: str) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    base_dir = Path(tempfile.mkdtemp(prefix="carnator-demo-"))
    port, note = pick_port(port)
    if note:
        print(note, flush=True)
    print(f"starting ComfyUI headless on 127.0.0.1:{port} (base directory {base_dir}) ...", flush=True)
    started = time.perf_counter()
    rows, records, ready_s = [], [], None
    try:
        with demo_server(base_dir, weights, port) as (client, unet_name):
            ready_s = round(time.perf_counter() - started, 1)
            print(f"ComfyUI ready in {ready_s:.0f} s; model {unet_name}, {steps} steps, "
                  f"clip {world.CLIP} latent, CarnatorReuse mode {mode}", flush=True)
            object_info = client.object_info()
            for i, prompt in enumerate(prompts):
                graph = complete(demo_graph(unet_name, prompt, i, steps, seed, cfg, mode), object_info)
                run = client.run(graph, on_progress=_progress(i, len(prompts), prompt))
                report = (run.reports or [{}])[0]
                latent = load_file(str(_saved(run, graphs.SAVE_LATENT, "latents", base_dir)))["latent_tensor"]
                oracle = score(prompt, world.decode(world.from_raw(latent[0].float())))
                clip = out / f"{i + 1:02d}_{re.sub('[^a-z0-9]+', '_', prompt.lower()).strip('_')[:48]}.webp"
                shutil.copyfile(_saved(run, "save_webp", "images", base_dir), clip)
                seconds = float(report.get("time_s", run.seconds))
                rows.append(_row(prompt, report, oracle.adherence, seconds))
                records.append({**rows[-1], "clip": clip.name, "observed": oracle.observed,
                                "expected": oracle.expected, "prompt_seconds": round(run.seconds, 2),
                                "carnator_report": report})
                print(("\r" if sys.stdout.isatty() else "") + f"[{i + 1}/{len(prompts)}] {prompt[:48]}  "
                      f"{Verdict(rows[-1]['verdict']).label}, skipped {rows[-1]['skipped_steps']} steps, "
                      f"{seconds:.1f} s, adherence {rows[-1]['adherence']}", flush=True)
    finally:
        if (base_dir / "comfyui.log").exists():
            shutil.copyfile(base_dir / "comfyui.log", out / "comfyui.log")
        shutil.rmtree(base_dir, ignore_errors=True)
    (out / "report.json").write_text(json.dumps({"steps": steps, "seed": seed, "cfg": cfg, "mode": mode,
                                                 "weights": str(weights), "comfyui_ready_s": ready_s,
                                                 "runs": records}, indent=1, default=str))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m carnator_core.demo", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a short prompt stream through a headless ComfyUI with Carnator")
    run.add_argument("--out", type=Path, default=Path("carnator-demo-output"), help="output folder (clips, report)")
    run.add_argument("--prompts", help=f"UTF-8 text file, {PROMPT_FILE_RULE} (default: a built-in stream of five)")
    run.add_argument("--steps", type=int, default=30)
    run.add_argument("--weights", help="demo model .safetensors (default: $CARNATOR_DEMO_WEIGHTS, else the "
                                       "weights shipped in carnator_core/demo/weights)")
    run.add_argument("--port", type=int, default=8188, help="preferred port; another free one if it is taken")
    run.add_argument("--seed", type=int, default=42, help="one seed for every prompt (the prompt-editing loop)")
    run.add_argument("--cfg", type=float, default=4.0, help="classifier-free guidance scale (negative prompt: empty)")
    run.add_argument("--mode", choices=("safe", "balanced", "fast"), default="balanced")
    add_record_option(run, "report.json (the whole command's time: ComfyUI's start to its stop)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the ComfyUI server is stopped
    try:
        if args.steps < 1:
            raise DemoSetupError("--steps must be at least 1")
        prompts = list(DEFAULT_PROMPTS)
        if args.prompts:
            prompts = read_prompt_file(args.prompts)
        comfy = find_comfyui()
        weights = demo_weights(args.weights)
        recording = Recording(args.record, "carnator_core.demo", list(argv if argv is not None else sys.argv[1:]))
        rows = run_demo(prompts, args.out, args.steps, weights, args.port, args.seed, args.cfg, args.mode)
        recording.store(json.loads((args.out / "report.json").read_text()), comfyui=comfyui_version(comfy))
    except (DemoSetupError, PromptFileError, ComfyNotFound, ComfyError, OSError) as error:
        print(f"carnator demo: {error}", file=sys.stderr)
        return 1
    print()
    print(summary_table(rows))
    print(f"\nclips and report.json in {args.out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Staged workflows benchmark: a request stream through a workflow whose samplers run one after another (LTX-2's
generation and refinement, Wan 2.2 14B's two experts, HunyuanVideo 1.5's super-resolution), on a running ComfyUI,
measured per stage.

    python -m carnator_core.bench stages --server URL (--graph ltx2-two-stage | hunyuan15-sr | --workflow API.json)
        [--vary prompt|cfg] [--prompts FILE] [--text-node ID] [--n 4] [--json] [--out DIR] [--record NAME]
    python -m carnator_core.bench workload --graph ltx2-two-stage|hunyuan15-sr --server URL ...      (the same)

`--graph ltx2-two-stage` is the shipped `workflows/api/carnator_ltx2_t2v.json`; `--graph hunyuan15-sr` is
`workflows/api/carnator_hunyuan_video15_720p_t2v_sr.json`, the HunyuanVideo 1.5 workflow with its 1080p
super-resolution group enabled (720p stage, then the SR model's two samplers). The server must have the models the
workflow loads. Every request runs in three configurations, the order rotated per request:

- plain: the workflow's Carnator reuse nodes in mode safe with an empty store, recording nothing and with sparse
  attention off, which samples exactly as the stock samplers do;
- balanced and fast: every reuse node in that mode, recording, with a store of the configuration's own.

Per configuration it reports the mean model calls per request of each stage in stage order (`stage_model_calls`),
the sampler's seconds per stage, the hit rate, and per stage and part (the video and audio of a packed LTX-2 latent
apart) the PSNR and SSIM of the stage's output against the same request's plain run.

Streams (`--vary`): `prompt` writes each prompt of `--prompts FILE` (else the edit-loop stream) where the workflow's
prompt goes; `cfg` keeps the workflow's prompt and steps the first stage's guidance scale (+0, +0.25, -0.25, +0.5,
...). A random-weight test model cannot tell a rewording from an edit, but a changed guidance scale changes its
output as it changes a real model's: the `cfg` stream shows the mechanics and the calls on such a model, not how
well the model judges prompts.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from carnator_core.bench.streams import make_stream
from carnator_core.bench.tables.stages import stages_markdown
from carnator_core.client import ComfyClient, ComfyError, PromptRun
from carnator_core.judging.quality import latent_quality
from carnator_core.lookup.prompt_text import is_link
from carnator_core.prompt_file import RULE as PROMPT_FILE_RULE
from carnator_core.prompt_file import read_prompt_file
from carnator_core.queue import Workflow, WorkflowError
from carnator_core.recorded_runs import Recording, add_record_option
from carnator_core.workflow_graph import AV_SEPARATOR, REUSE_NODES, SAMPLERS, feeds, links_to, stage_chain

WORKFLOWS_DIR = Path(__file__).resolve().parents[2] / "workflows" / "api"
STAGED_GRAPHS = {"ltx2-two-stage": "carnator_ltx2_t2v.json", "hunyuan15-sr": "carnator_hunyuan_video15_720p_t2v_sr.json"}
CONFIGS = ("plain", "balanced", "fast")
CFG_STEPS = (0.0, 0.25, -0.25, 0.5, -0.5, 0.75, -0.75, 1.0)
STORE_NODE = "carnator_bench_store"


@dataclass(frozen=True)
class Request:
    label: str
    text: str | None = None  # the prompt written into the workflow (None: its own)
    cfg: float | None = None  # the first stage's guidance scale (None: the workflow's)


@dataclass
class StagedWorkflow:
    """The workflow's stages and where the benchmark changes it: prompt, first-stage cfg, reuse nodes, saved
    outputs."""

    workflow: Workflow
    stages: list[str]  # sampler node ids in the order they run
    reuse_nodes: list[str]
    outputs: dict[str, list[tuple[str, list]]]  # sampler -> (part, link to the latent saved for it)

    @classmethod
    def prepare(cls, workflow: Workflow, object_info: dict) -> StagedWorkflow:
        graph = copy.deepcopy(workflow.graph)
        samplers = [node_id for node_id, node in graph.items() if node["class_type"] in SAMPLERS]
        stages = stage_chain(graph, samplers) if samplers else None
        if not stages:
            raise WorkflowError("the workflow has no samplers that run one after another: nothing to measure per "
                                "stage (the workload benchmark measures one-sampler graphs)")
        reuse_nodes = [node_id for node_id, node in graph.items() if node["class_type"] in REUSE_NODES]
        for earlier, sampler in zip([None, *stages], stages, strict=False):  # each stage's own, not an earlier one's
            if not any(node_id == sampler or feeds(graph, sampler, node_id) and not (
                    earlier is not None and (node_id == earlier or feeds(graph, earlier, node_id)))
                    for node_id in reuse_nodes):
                raise WorkflowError(f"stage {sampler} ({graph[sampler]['class_type']}) has no Carnator reuse node of "
                                    "its own: put a Carnator Reuse node in front of each stage's sampler")
        for node_id in [n for n, node in graph.items() if object_info.get(node["class_type"], {}).get("output_node")]:
            del graph[node_id]  # the workflow's own outputs: the benchmark saves the latents it compares
        outputs = {}
        for sampler in stages:
            separators = [node_id for node_id, node in graph.items() if node["class_type"] == AV_SEPARATOR
                          and links_to(node["inputs"].get("av_latent"), sampler)]
            outputs[sampler] = ([("video", [separators[0], 0]), ("audio", [separators[0], 1])] if separators
                                else [("latent", [sampler, 0])])
        return cls(Workflow(graph, workflow.text_target[0] if workflow.text_target else None), stages, reuse_nodes,
                   outputs)

    def cfg_inputs(self, graph: dict) -> dict:
        """The inputs of `graph` (a copy of this workflow's) that hold the first stage's guidance scale: its
        sampler's, or its guider's."""
        inputs = graph[self.stages[0]]["inputs"]
        guider = inputs.get("guider")
        if "cfg" not in inputs and is_link(guider):
            inputs = graph[str(guider[0])]["inputs"]
        if not isinstance(inputs.get("cfg"), int | float):
            raise WorkflowError(f"the first stage ({self.stages[0]}) has no cfg value to vary; use --vary prompt")
        return inputs

    def graph_for(self, request: Request, config: str, store_path: str, prefix: str) -> dict:
        """The graph of one request in one configuration, its stages' latents saved under `prefix`."""
        graph = self.workflow.for_prompt(request.text, "fixed", random.Random(0)) if request.text is not None \
            else copy.deepcopy(self.workflow.graph)
        if request.cfg is not None:
            self.cfg_inputs(graph)["cfg"] = request.cfg
        plain = config == "plain"
        for node_id in self.reuse_nodes:
            graph[node_id]["inputs"].update(mode="safe" if plain else config, record=not plain,
                                            store=[STORE_NODE, 0], verification="model",
                                            **({"sparse_attention": "off"} if plain else {}))
        graph[STORE_NODE] = {"class_type": "CarnatorStore", "inputs": {"path": store_path, "size_limit_gb": 4.0}}
        for index, sampler in enumerate(self.stages):
            for part, link in self.outputs[sampler]:
                graph[f"carnator_bench_save_{index}_{part}"] = {
                    "class_type": "SaveLatent", "inputs": {"samples": link, "filename_prefix": f"{prefix}-{index}-{part}"}}
        return graph


@dataclass
class StageRun:
    """What one configuration's run of one request did, per stage."""

    calls: list[int]
    seconds: list[float]
    hit: bool
    latents: dict[tuple[int, str], torch.Tensor] = field(repr=False)


def requests_for(vary: str, staged: StagedWorkflow, prompts: list[str] | None, n: int) -> list[Request]:
    if vary == "cfg":
        base = float(staged.cfg_inputs(staged.workflow.graph)["cfg"])
        return [Request(f"cfg {base + step:g}", cfg=base + step) for step in CFG_STEPS[:n]]
    return [Request(text, text=text) for text in (prompts or make_stream("edit-loop", n))]


def run_request(client: ComfyClient, staged: StagedWorkflow, request: Request, config: str, store_path: str,
                prefix: str) -> StageRun:
    run: PromptRun = client.run(staged.graph_for(request, config, store_path, prefix))
    reports = {report.get("node"): report for report in run.statuses}
    calls, seconds, hit = [], [], False
    for sampler in staged.stages:
        report = reports.get(sampler) or {}
        steps = int(report.get("total_steps") or 0)
        calls.append(int(report.get("model_calls", steps)))
        seconds.append(round(run.node_seconds.get(sampler, 0.0), 3))
        hit = hit or bool(report.get("skipped_steps"))
    latents = {}
    outputs = run.history.get("outputs") or {}
    for index, sampler in enumerate(staged.stages):
        for part, _ in staged.outputs[sampler]:
            saved = outputs[f"carnator_bench_save_{index}_{part}"]["latents"][0]
            data = client.view(saved["filename"], saved.get("subfolder", ""), saved.get("type", "output"))
            latents[(index, part)] = load_safetensors(data)["latent_tensor"].float()
    return StageRun(calls, seconds, hit, latents)


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 2) if values else float("nan")


def summarise(staged: StagedWorkflow, runs: dict[str, list[StageRun]]) -> list[dict[str, Any]]:
    rows = []
    for config, done in runs.items():
        quality = []
        for (index, part) in done[0].latents:
            scores = [latent_quality(run.latents[(index, part)], plain.latents[(index, part)])
                      for run, plain in zip(done, runs["plain"], strict=True)]
            quality.append({"stage": index + 1, "part": part, "psnr": _mean([s[0] for s in scores]),
                            "ssim": round(sum(s[1] for s in scores) / len(scores), 4)})
        stage_calls = [_mean([run.calls[i] for run in done]) for i in range(len(staged.stages))]
        rows.append({"name": config, "model_calls": round(sum(stage_calls), 2), "stage_model_calls": stage_calls,
                     "stage_seconds": [_mean([run.seconds[i] for run in done]) for i in range(len(staged.stages))],
                     "hit_rate": round(sum(run.hit for run in done) / len(done), 3), "quality": quality})
    return rows


def benchmark(client: ComfyClient, workflow: Workflow, vary: str, prompts: list[str] | None, n: int, tag: str,
              say: Callable[[str], None]) -> dict[str, Any]:
    """Run the stream through every configuration, the order rotated per request; the result object."""
    staged = StagedWorkflow.prepare(workflow, client.object_info())
    requests = requests_for(vary, staged, prompts, n)
    runs: dict[str, list[StageRun]] = {config: [] for config in CONFIGS}
    for number, request in enumerate(requests):
        for shift in range(len(CONFIGS)):
            config = CONFIGS[(number + shift) % len(CONFIGS)]
            run = run_request(client, staged, request, config, f"carnator-bench-stages/{tag}/{config}",
                              f"carnator_bench_stages/{tag}/{config}-{number:03d}")
            runs[config].append(run)
            say(f"[{number + 1}/{len(requests)}] {config:<8} {request.label[:48]:<48} calls {run.calls} "
                f"{'hit' if run.hit else 'miss'}")
    graph = workflow.graph
    return {"stages": [f"{sampler} ({graph[sampler]['class_type']})" for sampler in staged.stages],
            "vary": vary, "requests": [request.label for request in requests],
            "configs": summarise(staged, runs)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m carnator_core.bench stages", description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="the ComfyUI server, e.g. http://127.0.0.1:8188")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--graph", choices=list(STAGED_GRAPHS), help="a shipped staged workflow")
    source.add_argument("--workflow", type=Path, help="your own staged workflow, API format")
    parser.add_argument("--vary", choices=("prompt", "cfg"), default="prompt")
    parser.add_argument("--prompts", help=f"--vary prompt: the prompts, a UTF-8 text file, {PROMPT_FILE_RULE}")
    parser.add_argument("--text-node", help="the node holding the prompt text, where the workflow does not say")
    parser.add_argument("--n", type=int, default=4, help="requests in a generated stream")
    parser.add_argument("--json", action="store_true", help="print only the result object as JSON")
    parser.add_argument("--out", type=Path, default=Path("carnator-bench-output"))
    add_record_option(parser)
    args = parser.parse_args(argv)
    say = (lambda message: print(message, file=sys.stderr, flush=True)) if args.json else print
    path = args.workflow or WORKFLOWS_DIR / STAGED_GRAPHS[args.graph]
    try:
        if args.n < 1:
            raise WorkflowError("--n must be at least 1")
        workflow = Workflow.load(path, args.text_node)
        prompts = read_prompt_file(args.prompts) if args.prompts else None
        with ComfyClient(args.server) as client:
            tag = f"{path.stem}-{args.vary}-{time.strftime('%Y%m%d-%H%M%S')}"  # stores of this run alone
            recording = Recording(args.record, "carnator_core.bench stages", argv)
            result = {"workflow": path.name, **benchmark(client, workflow, args.vary, prompts, args.n, tag, say)}
            comfyui = client.comfyui_version()
    except (ComfyError, OSError, ValueError) as error:
        print(f"carnator stages benchmark: {error}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stages.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    (args.out / "stages.md").write_text(stages_markdown(result) + "\n", encoding="utf-8")
    # calls and quality only: the server's CPU is another process's, and no time is published
    if (stored := recording.store(result, comfyui=comfyui, timed=False)) is not None:
        say(f"recorded {stored}")
    print(json.dumps(result) if args.json else stages_markdown(result))
    return 0

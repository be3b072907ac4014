"""Batch runner: queue one API-format workflow once per prompt through ComfyUI's HTTP API and report reuse.

    python -m carnator_core.queue --server http://127.0.0.1:8188 --workflow workflows/api/carnator_demo_cpu.json \\
        --prompts prompts.txt [--seed fixed|random] [--json report.json] [--text-node ID] [--timeout S]

Each prompt (one per line; blank lines and lines starting with # are skipped) goes into the workflow's
text node, which is found by following the sampler's positive conditioning back to the node holding its
text (or named with --text-node); Carnator nodes with a literal `prompt` input get it too, so the store
lists the text. Each run is followed on the websocket to its end, its `carnator.status` events are
collected, and a table (prompt, hit/miss, skipped steps, time) with totals is printed.

Seeds: every prompt queued over the API carries its own seeds. `--seed fixed` (the default) keeps the workflow's,
which is what reuse under the reuse nodes' default seed policy `same-noise` needs: an edited prompt reuses only a run
made with the same seed. `--seed random` gives every prompt new seeds, so only seed policy `serving` reuses across
them (a variation of an earlier clip); with a `same-noise` reuse node in the workflow a line says so first.

Exit status: 0 when every prompt ran; 1 when some failed (validation error, node error, interrupted,
timeout, server lost) — the rest of the batch still runs and is reported; 2 when nothing could run
(server unreachable, malformed workflow or prompts file).

Only ComfyUI's public API is used (HTTP and its websocket, through carnator_core.client): no ComfyUI
import, so it runs from any machine that reaches the server.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from carnator_core.client import ComfyClient, ComfyError, ServerLost
from carnator_core.lookup.prompt_text import find_text_inputs, text_node_inputs
from carnator_core.prompt_file import RULE as PROMPT_FILE_RULE
from carnator_core.prompt_file import PromptFileError, read_prompt_file
from carnator_core.reuse.report import RunReport, Verdict
from carnator_core.reuse.settings import SEED_POLICIES
from carnator_core.workflow_graph import REUSE_NODES

CARNATOR_PROMPT_NODES = (*REUSE_NODES, "CarnatorCompatibilityLookup")
SEED_INPUTS = ("seed", "noise_seed")
SAME_NOISE, _ = SEED_POLICIES  # the reuse nodes' default seed policy, and `serving`
MAX_SEED = 2**50


class WorkflowError(ValueError):
    """The workflow or prompts file cannot be used; the message says what is wrong and how to fix it."""


@dataclass
class PromptResult:
    """One prompt of the batch. `hit` and `verdict` (the strongest of its sampling runs') are None when no Carnator
    sampling ran (no Carnator node, or ComfyUI served the whole prompt from its cache); `error` is None when the
    prompt ran to the end."""

    prompt: str
    prompt_id: str | None = None
    hit: bool | None = None
    verdict: str | None = None
    skipped_steps: int = 0
    total_steps: int = 0
    time_s: float | None = None
    time_saved_s: float = 0.0
    error: str | None = None
    cached: bool = False
    reports: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def outcome(self) -> str:
        if self.error:
            return "ERROR"
        if self.verdict is None:
            return "cached" if self.cached else "-"
        return Verdict(self.verdict).label

    def as_json(self) -> dict[str, Any]:
        record = asdict(self)
        record.pop("reports")
        record["reasons"] = [r.get("reason") for r in self.reports if not r.get("hit")]
        return record


# ------------------------------------------------------------------ workflow
class Workflow:
    """An API-format workflow and where each prompt goes into it."""

    def __init__(self, graph: dict[str, dict], text_node: str | None = None) -> None:
        self.graph = graph
        self.text_target = self._find_text_target(text_node)
        self.prompt_targets = [(node_id, "prompt") for node_id, node in graph.items()
                               if node["class_type"] in CARNATOR_PROMPT_NODES
                               and isinstance(node["inputs"].get("prompt", ""), str)]

    @classmethod
    def load(cls, path: Path, text_node: str | None = None) -> Workflow:
        try:
            graph = json.loads(path.read_text(encoding="utf-8"))
        except OSError as error:
            raise WorkflowError(f"cannot read workflow {path}: {error.strerror or error}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise WorkflowError(f"workflow {path} is not valid JSON: {error}") from None
        if isinstance(graph, dict) and "nodes" in graph and "links" in graph:
            raise WorkflowError(f"{path} is a UI-format workflow; the queue runner needs the API format "
                                "(workflows/api/ has API twins; in ComfyUI use Workflow > Export (API))")
        if isinstance(graph, dict) and isinstance(graph.get("prompt"), dict):
            graph = graph["prompt"]  # a saved /prompt request body
        if not isinstance(graph, dict) or not graph:
            raise WorkflowError(f"workflow {path} is not an API-format workflow (a JSON object of nodes)")
        for node_id, node in graph.items():
            if not isinstance(node, dict) or not isinstance(node.get("class_type"), str) \
                    or not isinstance(node.get("inputs"), dict):
                raise WorkflowError(f"workflow {path}: node {node_id!r} lacks a class_type or an inputs object")
        return cls(graph, text_node)

    def _find_text_target(self, text_node: str | None) -> tuple[str, str]:
        """Where each prompt is written: the literal the positive prompt is read from, as the reuse nodes read it."""
        if text_node is not None:
            if text_node not in self.graph:
                raise WorkflowError(f"--text-node {text_node}: no such node in the workflow")
            targets = text_node_inputs(self.graph, text_node)
            if len(targets) > 1:
                raise WorkflowError(f"--text-node {text_node} ({self.graph[text_node]['class_type']}) takes its text "
                                    f"from several inputs ({_places(targets)}); name the node of one")
            if not targets:
                raise WorkflowError(f"--text-node {text_node} ({self.graph[text_node]['class_type']}) has no "
                                    f"text input")
            return targets[0]
        targets = find_text_inputs(self.graph)
        if len(targets) == 1:
            return targets[0]
        literal = [(node_id, "text") for node_id, node in self.graph.items()
                   if isinstance(node["inputs"].get("text"), str)]
        if len(literal) == 1:
            return literal[0]
        reason = (f"the positive prompt is read from several text inputs: {_places(targets)}" if targets else
                  "no sampler's positive conditioning leads to a text input")
        raise WorkflowError(f"cannot tell which node holds the prompt text ({reason}); name it with --text-node ID")

    def same_noise_nodes(self) -> list[str]:
        """The Carnator reuse nodes that reuse only runs with the same initial noise (seed policy `same-noise`, their
        default)."""
        return [node_id for node_id, node in self.graph.items() if node["class_type"] in REUSE_NODES
                and node["inputs"].get("seed_policy", SAME_NOISE) == SAME_NOISE]

    def for_prompt(self, text: str, seed: str, rng: random.Random) -> dict[str, dict]:
        """A copy of the graph with `text` in place (and fresh seeds with seed='random')."""
        graph = json.loads(json.dumps(self.graph))
        node_id, name = self.text_target
        graph[node_id]["inputs"][name] = text
        for node_id, name in self.prompt_targets:
            graph[node_id]["inputs"][name] = text
        if seed == "random":
            for node in graph.values():
                for name in SEED_INPUTS:
                    if isinstance(node["inputs"].get(name), int):
                        node["inputs"][name] = rng.randrange(MAX_SEED)
        return graph


def _places(targets: list[tuple[str, str]]) -> str:
    return ", ".join(f"{node_id}.{name}" for node_id, name in targets)


# ------------------------------------------------------------------ running
def _run_one(client: ComfyClient, graph: dict, result: PromptResult, timeout: float) -> None:
    """Queue one graph and follow its events to the end, filling `result`; ServerLost when the server is gone."""
    started = time.perf_counter()
    try:
        result.prompt_id = client.queue(graph)
    except ComfyError as error:
        if not client.alive():
            raise ServerLost(str(error)) from None
        result.error = str(error)
        return
    try:
        run = client.follow(result.prompt_id, timeout)
    except ServerLost:
        raise
    except ComfyError as error:  # ran past the timeout
        result.error = str(error)
        return
    result.time_s = time.perf_counter() - started
    result.error = run.error
    result.reports = run.statuses
    if result.reports:
        verdict = Verdict.strongest(RunReport.from_dict(r).verdict for r in result.reports)
        result.verdict, result.hit = verdict.value, verdict is not Verdict.MISS
        result.skipped_steps = sum(int(r.get("skipped_steps") or 0) for r in result.reports)
        result.total_steps = sum(int(r.get("total_steps") or 0) for r in result.reports)
        result.time_saved_s = sum(float(r.get("time_saved_s") or 0.0) for r in result.reports)
    result.cached = not run.executed and result.error is None


def run_batch(server: str, workflow: Workflow, prompts: list[str], seed: str = "fixed",
              timeout: float = 3600.0, echo=print) -> list[PromptResult]:
    """Run every prompt in order; raises ComfyError only when the server cannot be reached at the start."""
    rng = random.Random()
    results = [PromptResult(prompt) for prompt in prompts]
    with ComfyClient(server) as client:
        if not client.alive():
            raise ComfyError(f"cannot reach ComfyUI at {client.url}: is the server running (python main.py "
                             "--listen ...) and is --server right?")
        client.listen()
        for number, result in enumerate(results, 1):
            try:
                _run_one(client, workflow.for_prompt(result.prompt, seed, rng), result, timeout)
            except ServerLost as error:
                for rest in results[number - 1:]:
                    rest.error = rest.error or f"not run: lost the server ({error})"
                echo(f"[{number}/{len(results)}] lost the server: {error}")
                break
            echo(f"[{number}/{len(results)}] {result.outcome:6} {_short(result.prompt, 60)}"
                 + (f"  ({result.error})" if result.error else ""))
    return results


# ------------------------------------------------------------------ reporting
def totals(results: list[PromptResult]) -> dict[str, Any]:
    done = [r for r in results if r.error is None]
    carnator = [r for r in done if r.hit is not None]
    hits = sum(1 for r in carnator if r.hit)
    return {
        "prompts": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "hits": hits,
        "misses": len(carnator) - hits,
        "hit_rate": hits / len(carnator) if carnator else None,
        "skipped_steps": sum(r.skipped_steps for r in done),
        "total_steps": sum(r.total_steps for r in done),
        "time_s": sum(r.time_s or 0.0 for r in results),
        "time_saved_s": sum(r.time_saved_s for r in done),
    }


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def table(results: list[PromptResult]) -> str:
    width = min(60, max([len("prompt")] + [len(r.prompt) for r in results]))
    result_width = max([len("result")] + [len(r.outcome) for r in results])
    rule = "-" * (width + result_width + 27)
    lines = [f"{'#':>3}  {'prompt':<{width}}  {'result':<{result_width}}  {'skipped':>8}  {'time s':>7}", rule]
    for number, r in enumerate(results, 1):
        skipped = f"{r.skipped_steps}/{r.total_steps}" if r.total_steps else "-"
        seconds = f"{r.time_s:7.1f}" if r.time_s is not None else f"{'-':>7}"
        lines.append(f"{number:>3}  {_short(r.prompt, width):<{width}}  {r.outcome:<{result_width}}  {skipped:>8}  "
                     f"{seconds}")
    for number, r in enumerate(results, 1):
        if r.error:
            lines.append(f"  #{number}: {r.error}")
    t = totals(results)
    rate = f"{t['hit_rate']:.0%}" if t["hit_rate"] is not None else "-"
    lines.append(rule)
    lines.append(f"{t['prompts']} prompts, {t['completed']} completed, {t['failed']} failed; hits {t['hits']}, "
                 f"misses {t['misses']} (hit rate {rate}); skipped {t['skipped_steps']}/{t['total_steps']} steps; "
                 f"{t['time_s']:.1f} s total, ~{t['time_saved_s']:.1f} s saved")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m carnator_core.queue", description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default="http://127.0.0.1:8188", help="ComfyUI URL (default %(default)s)")
    parser.add_argument("--workflow", type=Path, required=True, help="API-format workflow JSON (workflows/api/)")
    parser.add_argument("--prompts", type=Path, required=True, help=f"UTF-8 text file, {PROMPT_FILE_RULE}")
    parser.add_argument("--seed", choices=("fixed", "random"), default="fixed",
                        help="fixed: keep the workflow's seeds, as reuse under seed policy same-noise needs (the "
                             "prompt-editing loop); random: new seeds per prompt, reused only under seed policy serving")
    parser.add_argument("--json", type=Path, help="also write the results and totals to this JSON file")
    parser.add_argument("--text-node", help="id of the node that holds the prompt text (default: found by tracing "
                                            "the sampler's positive conditioning)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per prompt")
    args = parser.parse_args(argv)
    try:
        workflow = Workflow.load(args.workflow, args.text_node)
        prompts = read_prompt_file(args.prompts)
    except (WorkflowError, PromptFileError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    node_id, name = workflow.text_target
    print(f"{len(prompts)} prompts -> node {node_id} ({workflow.graph[node_id]['class_type']}.{name}), "
          f"seed {args.seed}, server {args.server}")
    if args.seed == "random" and (same_noise := workflow.same_noise_nodes()):
        print(f"note: --seed random gives every prompt new seeds, and node {', '.join(same_noise)} (seed policy "
              f"{SAME_NOISE}) reuses only runs with the same seed: keep --seed fixed to reuse, or set seed_policy "
              f"serving")
    try:
        results = run_batch(args.server, workflow, prompts, args.seed, args.timeout)
    except ComfyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(table(results))
    if args.json:
        report = {"server": args.server, "workflow": str(args.workflow), "seed": args.seed,
                  "results": [r.as_json() for r in results], "totals": totals(results)}
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

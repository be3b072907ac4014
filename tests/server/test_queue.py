"""The API-queue batch runner (`python -m carnator_core.queue`) against a real headless server, tiny Wan model.

The workflow is the shipped CPU demo's API twin on the tiny Wan model (tests/support/tiny_workflows.py). A
random-weight model has no semantics, so its probe thresholds are lowered for near-duplicate prompts to pass.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.comfy_host import REPO_ROOT, ComfyServer, free_port
from support.tiny_workflows import FAMILY, api_workflow, on_tiny_models

from carnator_core.lookup.prompt_text import is_link
from carnator_core.queue import Workflow, WorkflowError, main

pytestmark = [pytest.mark.server, pytest.mark.shared_server]  # see tests/conftest.py: comfy_server

NEAR_DUPLICATES = ["a red circle moving left on a black background",
                   "a red ball moving left on a black background",
                   "a red circle drifting left on a black background"]
TINY_MODEL_THRESHOLDS = {"structure_threshold": 0.5, "guidance_threshold": 0.5, "depth_slope": 0.0}


def _write(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _workflow(tmp_path: Path, tiny_models, steps: int = 8, **changes) -> Path:
    graph = on_tiny_models(api_workflow("carnator_demo_cpu"), "wan", tiny_models["wan"].name, steps=steps,
                           reuse=TINY_MODEL_THRESHOLDS)
    for node in graph.values():
        node["inputs"].update(changes.get(node["class_type"], {}))
    return _write(tmp_path / "workflow.json", graph)


def _prompts(tmp_path: Path, prompts: list[str]) -> Path:
    return _write(tmp_path / "prompts.txt", "# near-duplicates\n\n" + "\n".join(prompts) + "\n")


def test_batch_reports_hits_on_near_duplicate_prompts(comfy_server: ComfyServer, tiny_models, tmp_path):
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "carnator_core.queue", "--server", comfy_server.url,
               "--workflow", str(_workflow(tmp_path, tiny_models)), "--prompts", str(_prompts(tmp_path, NEAR_DUPLICATES)),
               "--seed", "fixed", "--json", str(report)]
    run = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(report.read_text())["results"]
    assert [r["prompt"] for r in results] == NEAR_DUPLICATES
    assert [r["hit"] for r in results] == [False, True, True], json.dumps(results, indent=1)
    assert [r["verdict"] for r in results] == ["miss", "resumed", "resumed"]
    assert all(r["error"] is None and r["prompt_id"] and r["time_s"] > 0 for r in results)
    assert results[0]["skipped_steps"] == 0 and all(r["skipped_steps"] > 0 for r in results[1:])
    totals = json.loads(report.read_text())["totals"]
    assert totals["prompts"] == 3 and totals["hits"] == 2 and totals["failed"] == 0
    assert "HIT (resumed)" in run.stdout and "MISS" in run.stdout and "hit rate 67%" in run.stdout


def test_server_down_is_a_clear_message_and_exit_2(tiny_models, tmp_path, capsys):
    code = main(["--server", f"http://127.0.0.1:{free_port()}", "--workflow", str(_workflow(tmp_path, tiny_models)),
                  "--prompts", str(_prompts(tmp_path, NEAR_DUPLICATES))])
    assert code == 2
    assert "cannot reach ComfyUI at http://127.0.0.1:" in capsys.readouterr().err


def test_random_seeds_with_a_same_noise_reuse_node_say_how_to_keep_seeds_for_reuse(tiny_models, tmp_path, capsys):
    down = ["--server", f"http://127.0.0.1:{free_port()}", "--prompts", str(_prompts(tmp_path, NEAR_DUPLICATES))]
    assert main([*down, "--workflow", str(_workflow(tmp_path, tiny_models)), "--seed", "random"]) == 2
    assert "keep --seed fixed to reuse" in capsys.readouterr().out
    assert main([*down, "--workflow", str(_workflow(tmp_path, tiny_models))]) == 2
    assert "keep --seed fixed" not in capsys.readouterr().out
    serving = _workflow(tmp_path, tiny_models, CarnatorReuse={"seed_policy": "serving"})
    assert main([*down, "--workflow", str(serving), "--seed", "random"]) == 2
    assert "keep --seed fixed" not in capsys.readouterr().out


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not valid JSON"),
    (json.loads((REPO_ROOT / "workflows" / "carnator_demo_cpu.json").read_text()), "UI-format workflow"),
    ([1, 2], "not an API-format workflow"),
    ({"1": {"inputs": {}}}, "lacks a class_type"),
    ({"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "x", "weight_dtype": "default"}}},
     "cannot tell which node holds the prompt"),
])
def test_malformed_workflow_is_a_clear_message_and_exit_2(tmp_path, capsys, content, message):
    workflow = _write(tmp_path / "bad.json", content)
    assert main(["--workflow", str(workflow), "--prompts", str(_prompts(tmp_path, ["a"]))]) == 2
    assert message in capsys.readouterr().err


def test_missing_or_empty_inputs_are_clear_messages(tmp_path, capsys):
    workflow = _write(tmp_path / "w.json", api_workflow("carnator_wan21_t2v"))
    assert main(["--workflow", str(tmp_path / "absent.json"), "--prompts", str(_prompts(tmp_path, ["a"]))]) == 2
    assert "cannot read workflow" in capsys.readouterr().err
    assert main(["--workflow", str(workflow), "--prompts", str(_write(tmp_path / "p.txt", "# only\n\n"))]) == 2
    assert "holds no prompts" in capsys.readouterr().err
    assert main(["--workflow", str(workflow), "--prompts", str(_prompts(tmp_path, ["a"])), "--text-node", "999"]) == 2
    assert "no such node" in capsys.readouterr().err


def _upstream_of(graph: dict, *input_names: str) -> set[str]:
    """Every node some node's `input_names` inputs link to, directly or through other nodes. A node that takes both
    a positive and a negative conditioning (LTXVConditioning) passes them on as outputs 0 and 1, so its output 0
    is followed up its positive input only, output 1 up its negative input only."""
    pending = [tuple(value) for node in graph.values() for name, value in node["inputs"].items()
               if name in input_names and is_link(value)]
    seen: set[str] = set()
    while pending:
        node_id, output = pending.pop()
        if node_id not in graph or node_id in seen:
            continue
        seen.add(node_id)
        inputs = graph[node_id]["inputs"]
        links = {name: value for name, value in inputs.items()
                 if is_link(value)}
        if {"positive", "negative"} <= set(links) and output in (0, 1):
            links = {name: value for name, value in links.items() if name == ("positive", "negative")[output]}
            seen.discard(node_id)  # its other output may be reached later
        pending += [tuple(value) for value in links.values()]
    return seen


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_prompt_goes_to_the_positive_text_of_every_shipped_workflow(name):
    graph = api_workflow(name)
    workflow = Workflow(graph)
    node_id, field = workflow.text_target
    node = graph[node_id]
    if node["class_type"] == "CLIPTextEncode":  # upstream of some positive input, of no negative one
        # (a guidance-distilled graph's BasicGuider takes one `conditioning`)
        positive = _upstream_of(graph, "positive", "conditioning")
        assert node_id in positive - _upstream_of(graph, "negative") and field == "text"
    else:  # the demo workflows feed one prompt primitive to the text encoder and the Carnator nodes
        assert node["class_type"] == "PrimitiveStringMultiline" and field == "value"
    first = workflow.for_prompt("a blue box", "fixed", random.Random(1))
    assert first[node_id]["inputs"][field] == "a blue box"
    for carnator_node, _ in workflow.prompt_targets:
        assert first[carnator_node]["inputs"]["prompt"] == "a blue box"
    seeds = [(i, f) for i, n in graph.items() for f in ("seed", "noise_seed") if isinstance(n["inputs"].get(f), int)]
    assert seeds and all(first[i]["inputs"][f] == graph[i]["inputs"][f] for i, f in seeds)
    second = workflow.for_prompt("a blue box", "random", random.Random(2))
    assert all(second[i]["inputs"][f] != graph[i]["inputs"][f] for i, f in seeds)


def test_text_node_option_and_its_errors():
    graph = api_workflow("carnator_wan21_t2v")
    negative = next(i for i, n in graph.items() if "Negative" in n.get("_meta", {}).get("title", ""))
    assert Workflow(graph, negative).text_target == (negative, "text")
    sampler = next(i for i, n in graph.items() if n["class_type"] == "KSampler")
    with pytest.raises(WorkflowError, match="has no text input"):
        Workflow(graph, sampler)


def test_validation_errors_are_reported_per_prompt_and_exit_1(comfy_server, tiny_models, tmp_path, capsys):
    workflow = _workflow(tmp_path, tiny_models, UNETLoader={"unet_name": "no_such_model.safetensors"})
    report = tmp_path / "report.json"
    code = main(["--server", comfy_server.url, "--workflow", str(workflow), "--prompts",
                  str(_prompts(tmp_path, NEAR_DUPLICATES[:2])), "--json", str(report)])
    assert code == 1
    results = json.loads(report.read_text())["results"]
    assert len(results) == 2 and all("no_such_model.safetensors" in r["error"] for r in results)
    out = capsys.readouterr().out
    assert out.count("ERROR") >= 2 and "2 failed" in out


def test_an_interrupted_prompt_is_reported_and_the_batch_goes_on(comfy_server, tiny_models, tmp_path):
    """The second prompt is interrupted through ComfyUI's /interrupt while it samples (many steps)."""
    prompts = ["a red circle moving left", "a green box rising", "a blue ball sinking"]
    workflow = _workflow(tmp_path, tiny_models, steps=80)
    report = tmp_path / "report.json"
    outcome: dict[str, int] = {}
    args = ["--server", comfy_server.url, "--workflow", str(workflow), "--prompts", str(_prompts(tmp_path, prompts)),
            "--seed", "random", "--json", str(report)]
    runner = threading.Thread(target=lambda: outcome.update(code=main(args)))
    runner.start()
    deadline = time.monotonic() + 300
    interrupted = False
    while runner.is_alive() and not interrupted and time.monotonic() < deadline:
        for item in comfy_server.get("/queue").json()["queue_running"]:
            prompt_id, graph = item[1], item[2]
            if any(node["inputs"].get("value") == prompts[1] for node in graph.values()):
                comfy_server.post("/interrupt", json={"prompt_id": prompt_id})
                interrupted = True
        time.sleep(0.05)
    runner.join(300)
    assert interrupted and outcome["code"] == 1
    results = json.loads(report.read_text())["results"]
    assert [r["error"] is None for r in results] == [True, False, True], json.dumps(results, indent=1)
    assert "interrupted" in results[1]["error"]

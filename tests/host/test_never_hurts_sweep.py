"""Never hurts, enumerated: every sampler, scheduler, guider and CFG-changing model patch the host lists, inside real
ComfyUI (in-process) on the demo model, with one Carnator Reuse node inserted as users insert it.

The lists are read from the host at test time, so a host that adds a sampler or a patch is covered the day it is
packed. For each entry:

- a first request records a donor;
- a same-seed one-attribute edit, which the model refuses at the step-0 screen, samples bit for bit what the plain
  graph samples (the screen's evaluation handed to the sampler goes through the host's whole CFG path);
- a rewording of the first prompt completes without an error (it resumes where the model agrees).

Each category prints its table (entry x case) and writes it to artifacts/never-hurts-<host>.md.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from carnator_core.demo.graphs import (
    LATENT,
    MODEL_CHAIN,
    NEGATIVE,
    POSITIVE,
    REPORT,
    SAMPLER,
    base_graph,
    with_report,
    with_reuse,
)
from carnator_core.reuse.recording import entry_writer

DEMO_WEIGHTS = "carnator_demo_wan21_t2v.safetensors"
PROMPT = "a red circle moving left on a black background"
EDIT = "a red circle moving left on a white background"  # one attribute: the model refuses the donor at step 0
REWORDED = "a red ball moving to the left on a black background"
# the Wan 2.1 text-to-video template's guidance and shift, over a short schedule
STEPS, CFG, SHIFT, SEED = 4, 6.0, 8.0, 5
CLIP = (1, 16, 16)  # one latent frame: what is swept (the sampler's path, bit for bit) does not scale with the clip
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
_stores = itertools.count()


def _sample(comfy, graph: dict) -> tuple[torch.Tensor, dict | None]:
    run = comfy.run_prompt(comfy.complete(graph))
    entry_writer().flush()
    reports = json.loads(run.output(REPORT, 1)) if REPORT in graph else []
    return run.output(SAMPLER)["samples"], (reports[0] if reports else None)


def _cases(comfy, graph_for) -> dict[str, str]:
    """Run the three cases on `graph_for(prompt, store)` (store None: the plain graph); each case's outcome in a word
    or the error."""
    store = f"stores/sweep-{next(_stores)}"
    outcome: dict[str, str] = {}
    try:
        _sample(comfy, graph_for(PROMPT, store))
        outcome["first"] = "ok"
    except Exception as error:  # the table names every failure; the test fails on any
        try:
            _sample(comfy, graph_for(PROMPT, None))
        except Exception as plain_error:
            return {"first": f"fails without Carnator too: {_line(plain_error)}"}
        return {"first": f"FAILED: {_line(error)}"}
    try:
        edited, report = _sample(comfy, graph_for(EDIT, store))
        plain, _ = _sample(comfy, graph_for(EDIT, None))
        if report["hit"]:
            outcome["edit refused"] = f"FAILED: resumed at step {report['skipped_steps']}"
        elif not torch.equal(edited, plain):
            outcome["edit refused"] = "FAILED: not bit-identical to plain"
        else:
            outcome["edit refused"] = "bit-identical"
    except Exception as error:
        outcome["edit refused"] = f"FAILED: {_line(error)}"
    try:
        reworded, report = _sample(comfy, graph_for(REWORDED, store))
        fine = torch.isfinite(reworded).all() and tuple(reworded.shape) == tuple(edited.shape)
        resumed = f"resumed at {report['skipped_steps']}" if report["hit"] else f"miss ({report['reason']})"
        outcome["rewording"] = ("ok, " + resumed) if fine else "FAILED: output not finite or wrong shape"
    except Exception as error:
        outcome["rewording"] = f"FAILED: {_line(error)}"
    return outcome


def _line(error: Exception) -> str:
    """An error's first line, for a table cell."""
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200].replace("|", "/")


def _table(comfy, title: str, results: dict[str, dict[str, str]]) -> list[str]:
    """Print and keep the table; return the failed cells."""
    cases = ["first", "edit refused", "rewording"]
    lines = [f"### {title} (ComfyUI {_host_version(comfy)})", "", f"| entry | {' | '.join(cases)} |",
             "|---|---|---|---|"]
    lines += [f"| {entry} | {' | '.join(row.get(case, '-') for case in cases)} |" for entry, row in results.items()]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    ARTIFACTS.mkdir(exist_ok=True)
    with (ARTIFACTS / f"never-hurts-{_host_version(comfy)}.md").open("a", encoding="utf-8") as out:
        out.write(text + "\n")
    return [f"{entry}: {case}: {cell}" for entry, row in results.items() for case, cell in row.items()
            if cell.startswith("FAILED")]


def _host_version(comfy) -> str:
    import comfyui_version

    return comfyui_version.__version__


def _ksampler_graph(sampler_name: str = "euler", scheduler: str = "simple", patch: str | None = None):
    def graph_for(prompt: str, store: str | None) -> dict:
        graph = base_graph(DEMO_WEIGHTS, prompt, seed=SEED, steps=STEPS, cfg=CFG, clip=CLIP, sampler_name=sampler_name,
                           scheduler=scheduler)
        graph[MODEL_CHAIN]["inputs"]["shift"] = SHIFT
        if patch is not None:  # chained before the Carnator node, with its defaults
            graph["patch"] = {"class_type": patch, "inputs": {"model": [MODEL_CHAIN, 0]}}
            graph[SAMPLER]["inputs"]["model"] = ["patch", 0]
        if store is None:
            return with_report(graph)
        return with_reuse(graph, store, "", sparse_attention="off")
    return graph_for


@pytest.mark.slow
def test_every_sampler(comfy):
    from comfy.samplers import KSampler

    results = {name: _cases(comfy, _ksampler_graph(sampler_name=name)) for name in KSampler.SAMPLERS}
    assert not _table(comfy, "KSampler: every sampler (scheduler simple)", results)


def test_every_scheduler(comfy):
    from comfy.samplers import KSampler

    results = {name: _cases(comfy, _ksampler_graph(scheduler=name)) for name in KSampler.SCHEDULERS}
    assert not _table(comfy, "KSampler: every scheduler (sampler euler)", results)


# inputs of a guider node, by name, that take the request's conditioning; every other CONDITIONING input takes the
# negative (empty) prompt's
_POSITIVE_INPUTS = ("positive", "conditioning", "cond1", "cond2")


def _guider_nodes(comfy) -> dict[str, dict]:
    """Every node the host itself lists whose output is a GUIDER, with its inputs (required and optional: an optional
    model or negative is wired too, as the ordinary use of the guider has it)."""
    info = comfy.object_info(*comfy.node_classes)
    return {name: {**node["input"].get("required", {}), **node["input"].get("optional", {})}
            for name, node in info.items() if "GUIDER" in node.get("output", [])
            and node.get("python_module", "").split(".")[0] in ("nodes", "comfy_extras")}


def _guider_graph(guider: str, inputs_of_guider: dict):
    def graph_for(prompt: str, store: str | None) -> dict:
        graph = base_graph(DEMO_WEIGHTS, prompt, seed=SEED, steps=STEPS, cfg=CFG, clip=CLIP)
        graph[MODEL_CHAIN]["inputs"]["shift"] = SHIFT
        del graph[SAMPLER]
        inputs: dict = {}
        for name, spec in inputs_of_guider.items():
            kind = spec[0] if isinstance(spec, (list, tuple)) and spec else None
            if kind == "MODEL":
                inputs[name] = [MODEL_CHAIN, 0]
            elif kind == "CONDITIONING":
                inputs[name] = [POSITIVE if name in _POSITIVE_INPUTS else NEGATIVE, 0]
            elif name == "cfg":
                inputs[name] = CFG
        graph["guider"] = {"class_type": guider, "inputs": inputs}
        graph["noise"] = {"class_type": "RandomNoise", "inputs": {"noise_seed": SEED}}
        graph["sampler_select"] = {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}}
        graph["sigmas"] = {"class_type": "BasicScheduler", "inputs": {"model": [MODEL_CHAIN, 0], "scheduler": "simple",
                                                                       "steps": STEPS, "denoise": 1.0}}
        graph[SAMPLER] = {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": ["noise", 0], "guider": ["guider", 0], "sampler": ["sampler_select", 0],
            "sigmas": ["sigmas", 0], "latent_image": [LATENT, 0]}}
        if store is None:
            return with_report(graph)
        return with_reuse(graph, store, "", consumer="guider", sparse_attention="off")
    return graph_for


def test_every_guider(comfy):
    guiders = _guider_nodes(comfy)
    assert {"CFGGuider", "DualCFGGuider", "PerpNegGuider", "BasicGuider"} <= set(guiders), sorted(guiders)
    results = {name: _cases(comfy, _guider_graph(name, required)) for name, required in sorted(guiders.items())}
    assert not _table(comfy, "SamplerCustomAdvanced: every guider (sampler euler)", results)


CFG_PATH_OPTIONS = ("sampler_cfg_function", "sampler_pre_cfg_function", "sampler_post_cfg_function",
                    "sampler_calc_cond_batch_function")
_WIDGET_TYPES = ("INT", "FLOAT", "BOOLEAN", "STRING")


def _cfg_patch_nodes(comfy) -> list[str]:
    """Every node of the host that takes a MODEL alone (other inputs widgets), returns one, and changes the CFG path
    of the model it returns: found by calling each with its defaults on the demo model."""
    model = comfy.call_node("UNETLoader", unet_name=DEMO_WEIGHTS, weight_dtype="default")[0]
    info = comfy.object_info(*comfy.node_classes)
    found = []
    for name, node in sorted(info.items()):
        required = node["input"].get("required", {})
        models = [key for key, spec in required.items() if spec and spec[0] == "MODEL"]
        if models != ["model"] or "MODEL" not in node.get("output", []):
            continue
        inputs = {"model": model}
        for key, spec in required.items():
            if key == "model":
                continue
            if isinstance(spec[0], list) and spec[0]:
                inputs[key] = spec[0][0]
            elif spec[0] in _WIDGET_TYPES and len(spec) > 1 and "default" in spec[1]:
                inputs[key] = spec[1]["default"]
            elif spec[0] == "COMBO" and len(spec) > 1 and spec[1].get("options"):
                inputs[key] = spec[1].get("default", spec[1]["options"][0])
            else:
                break
        else:
            try:
                patched = comfy.call_node(name, **inputs)[node["output"].index("MODEL")]
            except Exception:  # a node that cannot run on its defaults alone is not a patch chained as is
                continue
            options = getattr(patched, "model_options", {})
            if any(options.get(key) != model.model_options.get(key) for key in CFG_PATH_OPTIONS):
                found.append(name)
    return found


@pytest.mark.slow
def test_every_cfg_patch(comfy):
    patches = _cfg_patch_nodes(comfy)
    assert {"RescaleCFG", "CFGZeroStar"} <= set(patches), patches
    results = {patch: _cases(comfy, _ksampler_graph(sampler_name="uni_pc", patch=patch)) for patch in patches}
    assert not _table(comfy, "KSampler (uni_pc): every model patch that changes the CFG path, before the Carnator node",
                      results)


@pytest.fixture(scope="module", autouse=True)
def _fresh_artifacts(comfy):
    (ARTIFACTS / f"never-hurts-{_host_version(comfy)}.md").unlink(missing_ok=True)

"""The shipped workflows (workflows/*.json, UI format, and their API twins in workflows/api/) against a live server.

- every UI workflow's node types, widget values (mapped to inputs in the frontend's order) and link types
  validate against the server's /object_info, with the official model file names present as placeholder
  files so that the loaders' combo lists hold them (a workflow for a model the host lacks is skipped);
- every API twin is the same graph as its UI workflow (same active nodes, links through bypassed nodes and reroutes
  resolved as the frontend does, same values); the HunyuanVideo 1.5 workflow has a second twin, queued with its
  1080p super-resolution group enabled;
- every API twin executes through /prompt on the tiny test models (substitutions: tests/support/tiny_workflows.py),
  with one `carnator.status` event from each of its samplers;
- the Wan 2.2 and HunyuanVideo 1.5 twins, queued again with a one-word edit of the shipped prompt and the same seed,
  reuse the first run (the 14B's second request skips the high-noise stage); the LTX-2 twin's first stage resumes
  its packed audio+video latent; twins of models the host lacks (Wan 2.2 5B, HunyuanVideo 1.5, LTX-2 on
  older hosts) are skipped;
- the super-resolution twin, on tiny HunyuanVideo 1.5, SR and latent upsampler models, is measured per stage by
  `bench stages`, and queued again with the other upsampler file samples its SR stage plain, bit for bit;
- ComfyUI's template browser lists them, with their thumbnails; a workflow naming a node this Carnator
  does not have gets ComfyUI's normal validation error.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.comfy_host import ComfyServer, ServerFactory
from support.t2v_graphs import LTX2_AUDIO_LATENT, ltx2_audio_latent_shape
from support.tiny_models import (
    CURRENT_SPECS,
    HUNYUAN_VIDEO15_UPSAMPLERS,
    LTX2_UPSAMPLERS,
    LTXAV,
    host_lacks,
    write_ltx2_stage_models,
    write_tiny_model,
)
from support.tiny_workflows import (
    DEMO_WEIGHTS,
    FAMILY,
    GROUP_ENABLED,
    SAMPLERS,
    WORKFLOWS,
    api_workflow,
    on_demo_model,
    on_tiny_models,
    twin_families,
)

from carnator_core import recorded_runs
from carnator_core.bench.__main__ import main as bench_main
from carnator_core.bench.tables import stages as stages_tables
from carnator_core.bench.tables.stages import stages_markdown
from carnator_core.bench.tables.stored_runs import StoredRuns
from carnator_core.client import RequestRefused
from carnator_core.demo import world
from carnator_core.demo.graphs import latent_size
from carnator_core.demo.oracle import score
from carnator_core.judging.quality import latent_quality
from carnator_core.lookup.prompt_text import is_link
from carnator_core.queue import SEED_INPUTS
from carnator_core.reuse.input_start import INPUT_NOTE, MAX_INPUT_DISTANCE
from carnator_core.reuse.recording import entry_writer

pytestmark = pytest.mark.server

NAMES = sorted(FAMILY)
TWINS = NAMES + sorted(GROUP_ENABLED)  # the API twins
FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute"}  # virtual nodes: the frontend never sends them to the server
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
# what every shipped workflow's note says about its seed controls, all `fixed`
SEED_NOTE = ("The sampler's seed control is **fixed**: with seed policy same-noise (the default) an edited prompt "
             "reuses only a run made with the same seed, so a seed randomized on every run never finds its donor.")
LOADER_FOLDERS = {  # loader's widget (by position) -> model folder, for the placeholder files
    ("UNETLoader", 0): "diffusion_models",
    ("CLIPLoader", 0): "text_encoders",
    ("DualCLIPLoader", 0): "text_encoders",
    ("DualCLIPLoader", 1): "text_encoders",
    ("LTXAVTextEncoderLoader", 0): "text_encoders",
    ("LTXAVTextEncoderLoader", 1): "checkpoints",
    ("VAELoader", 0): "vae",
    ("LTXVAudioVAELoader", 0): "checkpoints",
    ("CheckpointLoaderSimple", 0): "checkpoints",
    ("LoraLoaderModelOnly", 0): "loras",
    ("LatentUpscaleModelLoader", 0): "latent_upscale_models",
}
LOW_NOISE_UNET = "tiny_wan_low_noise.safetensors"  # the Wan 2.2 14B workflow's low-noise expert at test size


def ui_workflow(name: str) -> dict:
    return json.loads((WORKFLOWS / f"{name}.json").read_text())


def _placeholders(base: Path) -> None:
    """Empty files named like the models the UI workflows load, bypassed loaders too (never loaded here, only
    listed); the demo weights the pack ships are real and stay visible."""
    for name in NAMES:
        for node in ui_workflow(name)["nodes"]:
            for (kind, index), folder in LOADER_FOLDERS.items():
                if node["type"] == kind and node["widgets_values"][index] != DEMO_WEIGHTS:
                    (base / "models" / folder).mkdir(parents=True, exist_ok=True)
                    (base / "models" / folder / node["widgets_values"][index]).touch()


def _tiny_current_models(base: Path, current_model) -> None:
    """The tiny models the workflows need besides `tiny_models`: a second tiny Wan (other weights) as the Wan 2.2
    14B's low-noise expert, each newer model the host has (Wan 2.2 TI2V 5B, HunyuanVideo 1.5 and its SR model and
    latent upsamplers, LTX-2 with its VAE and latent upsamplers), and LTX-2's empty audio latent in the input
    directory."""
    models = base / "models" / "diffusion_models"
    write_tiny_model("wan", models, seed=1, filename=LOW_NOISE_UNET)
    for family, spec in CURRENT_SPECS.items():
        if not host_lacks(spec):
            (models / spec.filename).symlink_to(current_model(family).path)
    if not host_lacks(CURRENT_SPECS["hunyuan_video15_sr"]):
        for seed, filename in enumerate(HUNYUAN_VIDEO15_UPSAMPLERS):
            write_tiny_model("hunyuan_video15_upsampler", base / "models" / "latent_upscale_models", seed=seed,
                             filename=filename)
    if not host_lacks(LTXAV):
        write_ltx2_stage_models(base / "models")
    audio = {"latent_tensor": torch.zeros(ltx2_audio_latent_shape()), "latent_format_version_0": torch.tensor([])}
    (base / "input").mkdir(exist_ok=True)
    save_file(audio, str(base / "input" / LTX2_AUDIO_LATENT))


@pytest.fixture(scope="module")
def server(comfyui_path: Path, new_base_dir, current_model) -> Iterator[ComfyServer]:
    factory = ServerFactory(comfyui_path, new_base_dir)
    base = new_base_dir()
    _placeholders(base)
    _tiny_current_models(base, current_model)
    try:
        yield factory(base)
    finally:
        factory.stop_all()


@pytest.fixture(scope="module")
def object_info(server: ComfyServer) -> dict:
    return server.object_info()


# ------------------------------------------------------------------ UI format vs /object_info
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"  # a combo whose chosen option brings its own widgets (newer hosts)


def _is_widget(spec: list) -> bool:
    """Whether the frontend draws this input as a widget: a plain widget type, a combo, a dynamic combo, or a
    several-type input that names its widget type; not one forced to a socket or hidden."""
    options = spec[1] if len(spec) > 1 else {}
    if options.get("forceInput") or options.get("hidden"):
        return False
    return isinstance(spec[0], list) or spec[0] in WIDGET_TYPES or spec[0] == DYNAMIC_COMBO or "widgetType" in options


def _value_spec(spec: list) -> list:
    """The spec a widget's value is checked against: a dynamic combo's option keys, a several-type input's widget."""
    options = spec[1] if len(spec) > 1 else {}
    if spec[0] == DYNAMIC_COMBO:
        return [[option["key"] for option in options["options"]], options]
    return [options.get("widgetType", spec[0]), options]


def _widget_inputs(inputs: dict, order: dict | None = None) -> list[tuple[str, list, bool]]:
    """(name, spec, optional) of the inputs the frontend shows as widgets, in its order: required, then optional."""
    widgets = []
    for section in ("required", "optional"):
        names = (order or {}).get(section, list(inputs.get(section, {})))
        for name in names:
            spec = inputs[section][name]
            if _is_widget(spec):
                widgets.append((name, spec, section == "optional"))
    return widgets


def _has_control(name: str, spec: list) -> bool:
    """Seed widgets carry a second, frontend-only value: what to do after queueing (fixed, randomize ...)."""
    return spec[0] == "INT" and (bool(spec[1].get("control_after_generate")) or name in ("seed", "noise_seed"))


def widget_specs(node: dict, info: dict) -> dict[str, tuple[list, object]]:
    """A UI node's widgets_values by input name, each with the spec it is checked against; fails on too few or
    too many values. A dynamic combo's value is followed by the widgets of the option it chose, named as the
    host's flat inputs of the same name (what an API prompt sets)."""
    return _widgets(node, info)[0]


def widget_controls(node: dict, info: dict) -> dict[str, str]:
    """A UI node's value controls (control_after_generate) by the input they change."""
    return _widgets(node, info)[1]


def _widgets(node: dict, info: dict) -> tuple[dict[str, tuple[list, object]], dict[str, str]]:
    values = list(node.get("widgets_values") or [])
    named: dict[str, tuple[list, object]] = {}
    controls: dict[str, str] = {}
    pending = _widget_inputs(info["input"], info.get("input_order", {}))
    while pending:
        name, spec, optional = pending.pop(0)
        if not values and optional:
            break  # an optional input newer than the workflow: the frontend gives it its default
        assert values, f"node {node['id']} ({node['type']}): no value for widget {name}"
        value = values.pop(0)
        named[name] = (_value_spec(spec), value)
        if _has_control(name, spec):
            control = values.pop(0) if values else None
            assert control in CONTROL_VALUES, f"node {node['id']} ({node['type']}): bad control value {control!r}"
            controls[name] = control
        if spec[0] == DYNAMIC_COMBO:
            chosen = next((o for o in spec[1]["options"] if o["key"] == value), {"inputs": {}})
            pending = _widget_inputs(chosen["inputs"]) + pending
    assert not values, f"node {node['id']} ({node['type']}): {len(values)} widget values more than inputs: {values}"
    return named, controls


def widget_values(node: dict, info: dict) -> dict:
    """A UI node's widgets_values by input name."""
    return {name: value for name, (_, value) in widget_specs(node, info).items()}


def _check_value(where: str, spec: list, value) -> None:
    kind, options = spec[0], (spec[1] if len(spec) > 1 else {})
    if isinstance(kind, list) or kind == "COMBO":
        choices = kind if isinstance(kind, list) else options["options"]
        assert value in choices, f"{where}: {value!r} is not one of {choices[:12]}"
    elif kind == "BOOLEAN":
        assert isinstance(value, bool), f"{where}: {value!r} is not a boolean"
    elif kind == "STRING":
        assert isinstance(value, str), f"{where}: {value!r} is not a string"
    else:
        number = int if kind == "INT" else (int, float)
        assert isinstance(value, number) and not isinstance(value, bool), f"{where}: {value!r} is not {kind}"
        assert options.get("min", value) <= value <= options.get("max", value), f"{where}: {value} out of range"


def _input_spec(info: dict, name: str) -> list:
    for section in ("required", "optional"):
        if name in info["input"].get(section, {}):
            return info["input"][section][name]
    raise AssertionError(f"no input {name}")


def _types_match(output: str, wanted) -> bool:
    if isinstance(wanted, list):  # a combo input fed by a primitive
        return output in ("COMBO", "*")
    return "*" in (output, wanted) or bool(set(output.split(",")) & set(wanted.split(",")))


def skip_where_the_host_lacks_the_model(name: str) -> None:
    for family in twin_families(name):
        reason = host_lacks(CURRENT_SPECS[family]) if family in CURRENT_SPECS else ""
        if reason:
            pytest.skip(f"{name}: {reason}")


@pytest.mark.parametrize("name", NAMES)
def test_ui_workflow_validates_against_object_info(object_info, name):
    skip_where_the_host_lacks_the_model(name)
    workflow = ui_workflow(name)
    nodes = {node["id"]: node for node in workflow["nodes"]}
    reuse_nodes = [n for n in nodes.values() if n["type"] in ("CarnatorReuse", "CarnatorReuseSampler")]
    assert reuse_nodes, f"{name} has no Carnator reuse node"
    for node in nodes.values():
        if node["type"] in FRONTEND_ONLY:
            continue
        assert node["type"] in object_info, f"{name}: node {node['id']} type {node['type']} unknown to the server"
        info = object_info[node["type"]]
        for field, (spec, value) in widget_specs(node, info).items():
            _check_value(f"{name}: node {node['id']} ({node['type']}).{field}", spec, value)
        linked = {i["name"] for i in node.get("inputs", []) if i.get("link") is not None}
        for field in info.get("input_order", {}).get("required", []):
            spec = info["input"]["required"][field]
            if not _is_widget(spec):
                assert field in linked, f"{name}: node {node['id']} ({node['type']}) input {field} is not connected"
    for link_id, origin, origin_slot, target, target_slot, link_type in workflow["links"]:
        source, sink = nodes[origin], nodes[target]
        output = object_info[source["type"]]["output"][origin_slot]
        wanted = _input_spec(object_info[sink["type"]], sink["inputs"][target_slot]["name"])[0]
        assert _types_match(output, wanted), f"{name}: link {link_id} {output} -> {sink['type']} wants {wanted}"
        assert link_type in (output, "*"), f"{name}: link {link_id} is typed {link_type}, its source gives {output}"


@pytest.mark.parametrize("name", NAMES)
def test_every_seed_control_is_fixed_and_the_note_says_why(object_info, name):
    skip_where_the_host_lacks_the_model(name)
    workflow = ui_workflow(name)
    controls = {f"{node['id']} ({node['type']}).{field}": control for node in workflow["nodes"]
                if node["type"] not in FRONTEND_ONLY
                for field, control in widget_controls(node, object_info[node["type"]]).items() if field in SEED_INPUTS}
    assert controls and set(controls.values()) == {"fixed"}, f"{name}: {controls}"
    notes = [node["widgets_values"][0] for node in workflow["nodes"] if node["type"] in ("Note", "MarkdownNote")]
    assert any(SEED_NOTE in note for note in notes), f"{name}: no note says why the seed is fixed"


BYPASSED = 4  # a UI node's mode: the frontend queues its input of the output's type in its place


def queued_source(ui: dict, target: int, slot: int) -> list | None:
    """[node id, output] of the active node that feeds input `slot` of `target` in what the frontend queues: links
    through reroutes and bypassed nodes resolved (None: a bypassed node with no input of that type)."""
    nodes = {node["id"]: node for node in ui["nodes"]}
    link = next((link for link in ui["links"] if link[3] == target and link[4] == slot), None)
    if link is None:
        return None
    _, origin, origin_slot, _, _, link_type = link
    source = nodes[origin]
    if source["type"] == "Reroute":
        return queued_source(ui, origin, 0)
    if source["mode"] == BYPASSED:
        matching = [i for i, entry in enumerate(source["inputs"]) if entry["type"] == link_type]
        return queued_source(ui, origin, matching[0]) if matching else None
    return [str(origin), origin_slot]


def queued_ui(name: str) -> dict:
    """The UI workflow API twin `name` is queued from: a `GROUP_ENABLED` twin's workflow with that group's nodes (by
    position, as the frontend selects a group's nodes) active, its EasyCache left bypassed."""
    if name not in GROUP_ENABLED:
        return ui_workflow(name)
    workflow, title, _ = GROUP_ENABLED[name]
    ui = ui_workflow(workflow)
    left, top, width, height = next(group["bounding"] for group in ui["groups"] if group["title"].startswith(title))
    for node in ui["nodes"]:
        x, y = node["pos"]
        if left <= x <= left + width and top <= y <= top + height and node["type"] != "EasyCache":
            node["mode"] = 0
    return ui


@pytest.mark.parametrize("name", TWINS)
def test_api_twin_is_the_ui_workflow(object_info, name):
    skip_where_the_host_lacks_the_model(name)
    ui, api = queued_ui(name), api_workflow(name)
    nodes = {str(node["id"]): node for node in ui["nodes"] if node["type"] not in FRONTEND_ONLY and node["mode"] == 0}
    assert set(api) == set(nodes), f"{name}: API twin nodes {sorted(api)} != UI nodes {sorted(nodes)}"
    links = {(str(target), nodes[str(target)]["inputs"][slot]["name"]): queued_source(ui, target, slot)
             for _, _, _, target, slot, _ in ui["links"] if str(target) in nodes}
    links = {key: source for key, source in links.items() if source is not None}
    for node_id, node in api.items():
        assert node["class_type"] == nodes[node_id]["type"]
        values = widget_values(nodes[node_id], object_info[node["class_type"]])
        expected = {field: value for field, value in values.items() if (node_id, field) not in links}
        expected.update({field: link for (target, field), link in links.items() if target == node_id})
        info = object_info[node["class_type"]]["input"]
        declared = {field: value for field, value in node["inputs"].items()  # not display-only widgets (PreviewAny)
                    if any(field in info.get(section, {}) for section in ("required", "optional"))}
        assert declared == expected, f"{name}: node {node_id} ({node['class_type']}) differs from the UI"


# ------------------------------------------------------------------ execution on the tiny models
def tiny_graph(name: str, tiny_models) -> dict:
    """The API twin `name` on the tiny models; skips where the host lacks one of the workflow's models."""
    skip_where_the_host_lacks_the_model(name)
    family = twin_families(name)[0]
    unet_name = CURRENT_SPECS[family].filename if family in CURRENT_SPECS else tiny_models[family].name
    return on_tiny_models(api_workflow(name), family, unet_name, low_noise_unet=LOW_NOISE_UNET)


def run_with_statuses(server: ComfyServer, graph: dict) -> tuple[dict, dict[str, dict]]:
    """Queue `graph`; its /history entry and its `carnator.status` reports by sampler node (one from each sampler
    the server ran rather than took from its cache, checked)."""
    run = server.client.run(graph, timeout=300)
    history, statuses = run.history, run.statuses
    cached = {node for kind, message in history["status"]["messages"] if kind == "execution_cached"
              for node in message["nodes"]}
    samplers = [node_id for node_id, node in graph.items() if node["class_type"] in SAMPLERS and node_id not in cached]
    assert samplers, "every sampler came from the server's cache"
    assert sorted(s["node"] for s in statuses) == sorted(samplers), statuses
    for sampler in samplers:
        stats = history["outputs"][f"stats_{sampler}"]["latent_stats"][0]
        assert stats["finite"] and stats["shape"][0] == 1, stats
    return history, {s["node"]: s for s in statuses}


def _shapes(history: dict) -> dict[str, list]:
    return {node: output["latent_stats"][0]["shape"] for node, output in history["outputs"].items()
            if node.startswith("stats_")}


# queued, these start a background calibration (its own runs queue behind): tests/server/test_calibrate.py runs it
CALIBRATES = {"carnator_calibrate_demo"}


@pytest.mark.parametrize("name", sorted(set(TWINS) - CALIBRATES))
def test_api_twin_runs_on_the_tiny_models(server, tiny_models, name):
    run_with_statuses(server, tiny_graph(name, tiny_models))


EDITS = {  # workflow -> one word of its shipped prompt and its replacement
    "carnator_wan22_14b_t2v": ("honey", "golden"),
    "carnator_wan22_5b_ti2v": ("guitar", "violin"),
    "carnator_hunyuan_video15_720p_t2v": ("sunset", "sunrise"),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_workflow_reuses_its_run_for_a_one_word_edit(server, tiny_models, name):
    """As shipped (Carnator's default thresholds): the edit's probes pass on the tiny models too."""
    graph = tiny_graph(name, tiny_models)
    positive = next(n for n in api_workflow(name).values() if "Positive" in n["_meta"]["title"])["inputs"]["text"]
    word, replacement = EDITS[name]
    assert positive.count(word) == 1, positive
    (text_node,) = [node for node in graph.values() if node["inputs"].get("text") == positive]
    first = server.client.run(graph, timeout=300).history  # recorded here, or by the run of the same graph before (then cached)
    text_node["inputs"]["text"] = positive.replace(word, replacement)
    edited, reports = run_with_statuses(server, graph)
    assert _shapes(edited) == _shapes(first)
    samplers = {node["inputs"].get("add_noise", "enable"): node_id for node_id, node in graph.items()
                if node["class_type"] in SAMPLERS}
    report = reports[samplers["enable"]]  # the sampler that starts the trajectory (the 14B's high-noise expert)
    assert report["hit"] and report["skipped_steps"] > 0, json.dumps(report)
    if len(samplers) == 2:
        assert report["stage"]["skipped_whole"], json.dumps(report)
        assert reports[samplers["disable"]]["stage"]["first_step"] == 2, json.dumps(reports)


def test_ltx2_workflow_resumes_its_packed_audio_and_video_first_stage(server, tiny_models):
    """The LTX-2 twin as shipped, after a one-word edit of its prompt: its first stage resumes the packed audio+video
    latent from the edit's run, verified on video and audio alike; the refinement stage, whose input is the
    upsampled first stage (with a noise mask of ones), resumes from the edit's refinement."""
    graph = tiny_graph("carnator_ltx2_t2v", tiny_models)
    for node in graph.values():  # the shipped graph ran before in this module: an exact repeat would answer it
        if node["class_type"] == "CarnatorReuse":
            node["inputs"]["exact_repeats"] = False
    edited = copy.deepcopy(graph)  # first: the shipped graph may be the one this server ran last (then cached)
    (text_node,) = [node for node in edited.values() if "cheerful" in node["inputs"].get("text", "")]
    text_node["inputs"]["text"] = text_node["inputs"]["text"].replace("cheerful", "joyful")
    edited_history, _ = run_with_statuses(server, edited)
    shipped_history, reports = run_with_statuses(server, graph)
    assert _shapes(shipped_history) == _shapes(edited_history)
    first_stage, refinement = sorted(reports.values(), key=lambda report: -report["total_steps"])
    assert first_stage["hit"] and first_stage["skipped_steps"] > 0, json.dumps(first_stage)
    assert all(len(probe["other_parts_agreement"]) == 1 for probe in first_stage["probes"]), json.dumps(first_stage)
    # the refinement starts from the upsampled first stage: it resumes from the edit's refinement, whose input lies
    # close, screened on its own first evaluation and verified at the corrected state (balanced: step 1 of 3)
    assert refinement["hit"] and refinement["skipped_steps"] == 1 and INPUT_NOTE in refinement["notes"], \
        json.dumps(refinement)
    verified = [probe for probe in refinement["probes"] if probe["passed"] and not probe["confirms_deeper"]]
    assert [(probe["step"], probe.get("corrected")) for probe in verified] == [(1, True)], json.dumps(refinement)
    assert any(probe["step"] == 0 and probe["passed"] and probe["donor_id"] == verified[0]["donor_id"]
               for probe in refinement["probes"]), json.dumps(refinement)
    assert refinement["model_calls"] <= 3  # the screen is step 0's evaluation: a hit never costs more than plain


def _ltx2_outputs(server: ComfyServer, graph: dict, label: str) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """The LTX-2 twin's final video and audio latents (what it decodes) and its reports by sampler node."""
    graph = copy.deepcopy(graph)
    (separate,) = [node_id for node_id, node in graph.items() if node["class_type"] == "LTXVSeparateAVLatent"
                   and graph[node["inputs"]["av_latent"][0]]["inputs"]["sigmas"][0] in graph
                   and graph[graph[node["inputs"]["av_latent"][0]]["inputs"]["sigmas"][0]]["class_type"] ==
                   "ManualSigmas"]
    for index, part in enumerate(("video", "audio")):
        graph[f"save_{part}"] = {"class_type": "SaveLatent",
                                 "inputs": {"samples": [separate, index], "filename_prefix": f"ltx2/{label}-{part}"}}
    run = server.client.run(graph, timeout=300)
    latents = {}
    for part in ("video", "audio"):
        saved = run.history["outputs"][f"save_{part}"]["latents"][0]
        path = server.base_dir / "output" / saved["subfolder"] / saved["filename"]
        latents[part] = load_file(str(path))["latent_tensor"]
    return latents, {report["node"]: report for report in run.statuses}


def _without_reuse(graph: dict) -> dict:
    """The graph with its Carnator Reuse nodes taken out (their model input linked through): plain sampling."""
    graph = copy.deepcopy(graph)
    for node_id in [n for n, node in graph.items() if node["class_type"] == "CarnatorReuse"]:
        model = graph.pop(node_id)["inputs"]["model"]
        for node in graph.values():
            for name, value in node["inputs"].items():
                if is_link(value) and value[0] == node_id:
                    node["inputs"][name] = model
    return graph


def _with_own_store(graph: dict, path: str) -> dict:
    """The graph with every Carnator Reuse node on a store of its own (a CarnatorStore at `path`): no other test's
    runs are donors."""
    graph["store"] = {"class_type": "CarnatorStore", "inputs": {"path": path, "size_limit_gb": 4.0}}
    for node in graph.values():
        if node["class_type"] == "CarnatorReuse":
            node["inputs"]["store"] = ["store", 0]
    return graph


def _with_text(graph: dict, word: str, replacement: str) -> dict:
    graph = copy.deepcopy(graph)
    (text_node,) = [node for node in graph.values() if word in node["inputs"].get("text", "")]
    text_node["inputs"]["text"] = text_node["inputs"]["text"].replace(word, replacement)
    return graph


def test_ltx2_workflow_resumed_audio_and_video_stay_close_to_plain_and_a_rejected_prompt_is_plain(server,
                                                                                                  tiny_models):
    """The LTX-2 twin (euler_ancestral, cfg 4, then the 3-step refinement) on the tiny model: a rewording resumes its
    first stage at balanced's depth (half of its steps), and its audio and video, continuing the plain run's noise,
    stay closer to the same prompt's plain run than another prompt's plain run is (figures printed); a prompt the
    model rejects (here: a structure bar no agreement reaches) samples both stages plain, bit for bit, at plain's
    model calls."""
    graph = tiny_graph("carnator_ltx2_t2v", tiny_models)
    _ltx2_outputs(server, _with_text(graph, "cheerful", "merry"), "donor")
    request = _with_text(graph, "cheerful", "happy")
    plain, _ = _ltx2_outputs(server, _without_reuse(request), "plain")
    resumed, reports = _ltx2_outputs(server, request, "resumed")
    first_stage = max(reports.values(), key=lambda report: report["total_steps"])
    assert first_stage["hit"] and first_stage["skipped_steps"] == first_stage["total_steps"] // 2, \
        json.dumps(first_stage)
    other_text = _with_text(graph, "cheerful", "gloomy")
    other_plain, _ = _ltx2_outputs(server, _without_reuse(other_text), "plain-other")
    for part in ("video", "audio"):  # closer to its own plain run than another prompt's plain run is
        psnr, similarity = latent_quality(resumed[part], plain[part])
        other_psnr, _ = latent_quality(other_plain[part], plain[part])
        print(f"LTX-2 tiny, resumed rewording against plain, {part}: PSNR {psnr:.1f} dB, SSIM {similarity:.3f} "
              f"(another prompt's plain run: {other_psnr:.1f} dB)")
        assert resumed[part].shape == plain[part].shape and psnr > other_psnr, (part, psnr, other_psnr)
    assert all(report["model_calls"] <= report["total_steps"] for report in reports.values())

    strict = copy.deepcopy(other_text)
    for node in strict.values():
        if node["class_type"] == "CarnatorReuse":
            node["inputs"]["structure_threshold"] = 1.0
    rejected, reports = _ltx2_outputs(server, strict, "rejected")
    for part in ("video", "audio"):
        assert torch.equal(rejected[part], other_plain[part]), part
    for report in reports.values():  # the step-0 screen that rejected the donors is the sampler's own first call
        assert not report["hit"] and report["model_calls"] == report["total_steps"], json.dumps(report)


def test_ltx2_exact_repeat_serves_both_stages_their_stored_outputs(server, tiny_models):
    """The LTX-2 twin with its prompt, another prompt, then its prompt again: the first stage repeats exactly, and so
    does the refinement, whose input (the upsampled repeated output) is the stored one's: each stage a model call or
    two, the first run's video and audio bit for bit."""
    graph = _with_own_store(tiny_graph("carnator_ltx2_t2v", tiny_models), "stores/ltx2-exact")
    graph = _with_text(graph, "cheerful", "sunny")
    first, _ = _ltx2_outputs(server, graph, "exact-first")
    _ltx2_outputs(server, _with_text(graph, "sunny", "stormy"), "exact-other")
    again, reports = _ltx2_outputs(server, graph, "exact-again")
    assert len(reports) == 2, json.dumps(reports)
    for report in reports.values():
        assert report["verdict"] == "exact repeat" and report["model_calls"] <= 2, json.dumps(report)
    for part in ("video", "audio"):
        assert torch.equal(again[part], first[part]), part


def test_ltx2_refinement_after_another_latent_upsampler_file_samples_plain(server, tiny_models):
    """The LTX-2 twin, its first stage upsampled by the shipped upsampler file, queued again with the other LTX-2
    latent upsampler file (other weights): the refinement (the first stage is ComfyUI's cached output), starting from
    another upsampled video, finds no donor, says why, and its video and audio are the plain run's, bit for bit."""
    graph = _with_own_store(tiny_graph("carnator_ltx2_t2v", tiny_models), "stores/ltx2-upsampler")
    _, reports = _ltx2_outputs(server, graph, "upsampler-donor")
    assert not any(report["hit"] for report in reports.values()), json.dumps(reports)
    (loader,) = [node for node in graph.values() if node["class_type"] == "LatentUpscaleModelLoader"]
    assert loader["inputs"]["model_name"] == LTX2_UPSAMPLERS[0]
    loader["inputs"]["model_name"] = LTX2_UPSAMPLERS[1]
    output, reports = _ltx2_outputs(server, graph, "other-upsampler")
    plain, _ = _ltx2_outputs(server, _without_reuse(graph), "other-upsampler-plain")
    for part in ("video", "audio"):
        assert torch.equal(output[part], plain[part]), part
    (refinement,) = reports.values()
    print("LTX-2 refinement after another upsampler:", refinement["reason"], refinement["filtered"])
    assert not refinement["hit"] and refinement["skipped_steps"] == 0, json.dumps(refinement)
    assert refinement["reason"] == f"filtered: input farther than {MAX_INPUT_DISTANCE} from the donor's", \
        json.dumps(refinement)
    assert refinement["model_calls"] == refinement["total_steps"]


# ------------------------------------------------------------------ on the demo model
def _demo_run(server: ComfyServer, graph: dict) -> tuple[dict, torch.Tensor]:
    """Queue a demo-model graph; its (single) Carnator report and the sampled latent."""
    history = server.client.run(graph, timeout=300).history
    report = json.loads(history["outputs"]["report"]["carnator_report"][0])[0]
    saved = history["outputs"]["save"]["latents"][0]
    latent = load_file(str(server.base_dir / "output" / saved["subfolder"] / saved["filename"]))["latent_tensor"]
    return report, latent


def test_official_wan21_template_resumes_a_reworded_prompt_on_the_demo_model(server):
    """The Wan 2.1 template's own sampler settings (uni_pc, simple, cfg 6, shift 8, 30 steps), as shipped."""
    template = api_workflow("carnator_wan21_t2v")
    sampler = next(node for node in template.values() if node["class_type"] == "KSampler")["inputs"]
    assert (sampler["sampler_name"], sampler["scheduler"], sampler["cfg"], sampler["steps"]) == ("uni_pc", "simple", 6, 30)
    first, _ = _demo_run(server, on_demo_model(template, "a red circle moving left on a black background"))
    assert first["hit"] is False
    reworded, _ = _demo_run(server, on_demo_model(template, "a red ball moving to the left on a black background"))
    assert reworded["hit"] and reworded["skipped_steps"] == 15, json.dumps(reworded["probes"])


def test_official_wan21_template_final_resumes_from_its_eight_step_draft_on_the_demo_model(server):
    """The Wan 2.1 template as shipped (one CarnatorReuse, uni_pc, cfg 6, shift 8), its steps set to 8 for a draft,
    then back to 30 for the final of the same prompt and seed: the final resumes from the draft's state at the sigma
    where its own schedule reaches it."""
    prompt = "a green square moving up on a gray background"
    template = api_workflow("carnator_wan21_t2v")
    sampler = next(node for node in template.values() if node["class_type"] == "KSampler")["inputs"]
    sampler["steps"] = 8
    draft, _ = _demo_run(server, on_demo_model(template, prompt))
    assert draft["hit"] is False and draft["model_calls"] <= 9, json.dumps(draft)  # uni_pc: the screen costs one
    sampler["steps"] = 30
    final, _ = _demo_run(server, on_demo_model(template, prompt))
    assert final["verdict"] == "resumed" and final["resumed_at"]["donor_steps"] == 8, json.dumps(final)
    assert final["skipped_steps"] >= 10 and final["model_calls"] <= 30 - final["skipped_steps"] + 2


@pytest.mark.parametrize("workflow", ["ui", "api"])
def test_demo_workflows_use_the_clip_size_the_demo_model_was_trained_on(workflow):
    wanted = latent_size(world.CLIP)
    if workflow == "ui":
        (node,) = [n for n in ui_workflow("carnator_demo_cpu")["nodes"] if n["type"] == "EmptyHunyuanLatentVideo"]
        width, height, length = node["widgets_values"][:3]
    else:
        (node,) = [n for n in api_workflow("carnator_demo_cpu").values() if n["class_type"] == "EmptyHunyuanLatentVideo"]
        width, height, length = (node["inputs"][k] for k in ("width", "height", "length"))
    assert {"width": width, "height": height, "length": length} == wanted


def test_demo_workflow_as_shipped_draws_its_prompt(server):
    """Queued as shipped (30 steps, its seed and prompt), the oracle reads the prompt back from the clip."""
    graph = api_workflow("carnator_demo_cpu")
    prompt = next(n for n in graph.values() if n["class_type"] == "PrimitiveStringMultiline")["inputs"]["value"]
    graph["save"] = {"class_type": "SaveLatent", "inputs": {"samples": ["9", 0], "filename_prefix": "demo"}}
    graph["report"] = graph.pop("12")
    graph["8"]["inputs"]["record"] = False
    _, latent = _demo_run(server, graph)
    entry_writer().flush()
    assert tuple(latent.shape[2:]) == world.CLIP
    result = score(prompt, world.decode(world.from_raw(latent[0].float())))
    assert result.adherence == 1.0, (result.observed, result.expected)


# ------------------------------------------------------------------ template browser, bad input
def test_template_browser_lists_workflows_with_thumbnails(server):
    listed = server.get("/api/workflow_templates").json()
    assert sorted(listed["carnator"]) == NAMES
    for name in NAMES:
        response = server.get(f"/api/workflow_templates/carnator/{name}.jpg")
        assert response.status_code == 200 and response.content.startswith(b"\xff\xd8"), name
        assert server.get(f"/api/workflow_templates/carnator/{name}.json").json() == ui_workflow(name)


def test_workflow_with_a_node_this_version_lacks_gets_comfyuis_validation_error(server, tiny_models):
    graph = on_tiny_models(api_workflow("carnator_wan21_t2v"), "wan", tiny_models["wan"].name)
    reuse = next(node_id for node_id, node in graph.items() if node["class_type"] == "CarnatorReuse")
    graph[reuse]["class_type"] = "CarnatorReuseV0"  # e.g. a node of an older Carnator
    # the error names the node: by its type, or (newer hosts) by its title and id
    with pytest.raises(RequestRefused, match=rf"CarnatorReuseV0|Node ID '#{reuse}'"):
        server.client.queue(graph)
    assert server.get("/system_stats").ok


def _recorded(name: str, tmp_path: Path, monkeypatch) -> list[str]:
    """`--record NAME`: the stages tables of docs/measurements.md come from these runs on the tiny models (`python -m
    carnator_core.bench report`). Stored into docs/results/ where CARNATOR_RECORD_RESULTS=1, else into a folder of the
    test's own, so that every run checks what it would store."""
    if os.environ.get("CARNATOR_RECORD_RESULTS") != "1":
        monkeypatch.setattr(recorded_runs, "REPO_DIR", tmp_path)
        monkeypatch.setattr(recorded_runs, "RESULTS_DIR", tmp_path / "results")
    return ["--record", name]


def _check_recorded(name: str, result: dict) -> None:
    """The stored run is the benchmark's result with the conditions it ran under, and its published table is the
    benchmark's own markdown under a line naming the run."""
    conditions, stored = recorded_runs.read_result(name, recorded_runs.RESULTS_DIR)
    assert stored == result and not conditions.timed and conditions.comfyui_version != recorded_runs.NO_COMFYUI
    table = stages_tables.stages_table(name, StoredRuns(recorded_runs.RESULTS_DIR), str)
    assert table.endswith(stages_markdown(result) + "\n") and table.startswith(f"[`{name}`]({name})")


def test_stages_benchmark_reports_each_stage_of_hunyuan_video15_super_resolution(server, tiny_models, tmp_path, capsys,
                                                                                 monkeypatch):
    """`bench stages --graph hunyuan15-sr`'s workflow (the HunyuanVideo 1.5 twin with its super-resolution group
    enabled) on the tiny 720p and SR models, cfg stream: three stages, the 720p sampler and the SR model's two
    samplers (8 steps split at 4). The later requests resume the 720p stage; the SR stage, guided by an image close
    to the donor's, is screened and skipped to the donor's hand-over; the plain runs stay bit-identical (figures
    printed)."""
    graph = tiny_graph("carnator_hunyuan_video15_720p_t2v_sr", tiny_models)
    workflow = tmp_path / "hunyuan15_sr.json"
    workflow.write_text(json.dumps(graph), encoding="utf-8")
    argv = ["stages", "--server", server.url, "--workflow", str(workflow), "--text-node", "44", "--vary", "cfg",
            "--n", "3", "--json", "--out", str(tmp_path / "out"),
            *_recorded("stages-hunyuan15-sr", tmp_path, monkeypatch)]
    assert bench_main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    print(json.dumps(result, indent=1))
    _check_recorded("stages-hunyuan15-sr", result)
    assert result["requests"] == ["cfg 6", "cfg 6.25", "cfg 5.75"]
    assert [stage.split()[0] for stage in result["stages"]] == ["127", "140", "141"]
    split, sr_steps = graph["137"]["inputs"]["step"], graph["136"]["inputs"]["steps"]
    configs = {row["name"]: row for row in result["configs"]}
    assert configs["plain"]["stage_model_calls"] == [graph["128"]["inputs"]["steps"], split, sr_steps - split]
    assert configs["plain"]["hit_rate"] == 0
    assert all(q["psnr"] == 100.0 and q["ssim"] == 1.0 for q in configs["plain"]["quality"])
    for mode in ("balanced", "fast"):  # the first request records; the other two reuse it
        row = configs[mode]
        assert row["hit_rate"] == pytest.approx(2 / 3, abs=1e-3), json.dumps(row)
        plain_calls = configs["plain"]["stage_model_calls"]
        assert row["stage_model_calls"][0] < plain_calls[0] and row["stage_model_calls"][1] < split, json.dumps(row)
        assert row["stage_model_calls"][2] <= plain_calls[2], json.dumps(row)
        assert all(q["psnr"] > 20 for q in row["quality"]), json.dumps(row)


def _sr_output(server: ComfyServer, graph: dict, label: str) -> tuple[torch.Tensor, dict[str, dict]]:
    """The super-resolution twin's final latent (the SR model's second sampler, 141) and its reports by sampler."""
    graph = copy.deepcopy(graph)
    graph["save_sr"] = {"class_type": "SaveLatent", "inputs": {"samples": ["141", 0], "filename_prefix": f"sr/{label}"}}
    run = server.client.run(graph, timeout=300)
    saved = run.history["outputs"]["save_sr"]["latents"][0]
    latent = load_file(str(server.base_dir / "output" / saved["subfolder"] / saved["filename"]))["latent_tensor"]
    return latent, {report["node"]: report for report in run.statuses}


def test_super_resolution_after_another_upsampler_file_samples_plain(server, tiny_models):
    """The HunyuanVideo 1.5 twin with its super-resolution group, queued again with the other latent upsampler file
    (other weights): the SR stage, starting from (and guided by) another upscaled video, finds no donor, says why,
    and samples plain, bit for bit."""
    graph = _with_own_store(tiny_graph("carnator_hunyuan_video15_720p_t2v_sr", tiny_models), "stores/sr-upsampler")
    _, reports = _sr_output(server, graph, "donor")
    assert not any(report["hit"] for report in reports.values()), json.dumps(reports)
    (loader,) = [node for node in graph.values() if node["class_type"] == "LatentUpscaleModelLoader"]
    assert loader["inputs"]["model_name"] == HUNYUAN_VIDEO15_UPSAMPLERS[0]
    loader["inputs"]["model_name"] = HUNYUAN_VIDEO15_UPSAMPLERS[1]
    output, reports = _sr_output(server, graph, "other-upsampler")
    plain, _ = _sr_output(server, _without_reuse(graph), "other-upsampler-plain")
    assert torch.equal(output, plain)
    for sampler in ("140", "141"):
        assert not reports[sampler]["hit"] and reports[sampler]["skipped_steps"] == 0, json.dumps(reports[sampler])
    screened = reports["140"]
    print("SR stage after another upsampler:", screened["reason"], screened["filtered"])
    assert screened["reason"] == f"filtered: input farther than {MAX_INPUT_DISTANCE} from the donor's", json.dumps(screened)
    assert screened["model_calls"] == screened["total_steps"]


def test_stages_benchmark_reports_each_stage_of_the_ltx2_workflow(server, tiny_models, tmp_path, capsys, monkeypatch):
    """`python -m carnator_core.bench stages` on the LTX-2 twin (tiny model) with the cfg stream: per configuration
    the model calls of each stage in stage order, and per stage the video's and the audio's PSNR and SSIM against
    the same request's plain run (figures printed)."""
    graph = tiny_graph("carnator_ltx2_t2v", tiny_models)
    workflow = tmp_path / "ltx2.json"
    workflow.write_text(json.dumps(graph), encoding="utf-8")
    (text_node,) = [node_id for node_id, node in graph.items() if "cheerful" in node["inputs"].get("text", "")]
    argv = ["stages", "--server", server.url, "--workflow", str(workflow), "--text-node", text_node, "--vary", "cfg",
            "--n", "3", "--json", "--out", str(tmp_path / "out"), *_recorded("stages-ltx2", tmp_path, monkeypatch)]
    assert bench_main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    print(json.dumps(result, indent=1))
    assert result == json.loads((tmp_path / "out" / "stages.json").read_text(encoding="utf-8"))
    _check_recorded("stages-ltx2", result)
    assert result["requests"] == ["cfg 4", "cfg 4.25", "cfg 3.75"] and len(result["stages"]) == 2
    configs = {row["name"]: row for row in result["configs"]}
    first_steps = next(node for node in graph.values() if node["class_type"] == "LTXVScheduler")["inputs"]["steps"]
    assert configs["plain"]["stage_model_calls"] == [first_steps, 3] and configs["plain"]["hit_rate"] == 0
    parts = [(q["stage"], q["part"]) for q in configs["plain"]["quality"]]
    assert parts == [(1, "video"), (1, "audio"), (2, "video"), (2, "audio")]
    assert all(q["psnr"] == 100.0 and q["ssim"] == 1.0 for q in configs["plain"]["quality"])
    for mode in ("balanced", "fast"):  # the first request records; the other two resume its first stage
        row = configs[mode]
        assert row["hit_rate"] == pytest.approx(2 / 3, abs=1e-3), json.dumps(row)
        assert row["stage_model_calls"][0] < first_steps and row["stage_model_calls"][1] <= 3, json.dumps(row)
        assert all(q["psnr"] > 20 for q in row["quality"]), json.dumps(row)
    # the 3-step refinement: balanced's depth (step 1) saves no call; fast asks step 2 first and saves one per hit;
    # on the 4-step first stage fast asks step 3 first where balanced resumes at step 2
    assert configs["balanced"]["stage_model_calls"][1] == 3 and configs["fast"]["stage_model_calls"][1] < 3
    assert configs["fast"]["stage_model_calls"][0] < configs["balanced"]["stage_model_calls"][0]

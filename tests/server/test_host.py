"""The pack inside a real ComfyUI: loading, /object_info, and tiny video models sampling on CPU."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch
from support.comfy_host import PACK_NAME, ComfyNotFound, captured_logs, find_comfyui
from support.t2v_graphs import GRAPHS, SAMPLER, STATS

pytestmark = pytest.mark.shared_server  # see tests/conftest.py: comfy_server

# Nodes looked up by name; whatever else the extension returns is checked generically (prefix, tooltips).
EXPECTED_NODE_IDS = {"CarnatorStore", "CarnatorCompatibilityLookup", "CarnatorStoreInfo"}
# Latent each template graph samples at its default test size (64x64; 5 frames, LTX 9 frames).
EXPECTED_SHAPES = {"wan": [1, 16, 2, 8, 8], "hunyuan_video": [1, 16, 2, 8, 8], "ltxv": [1, 128, 2, 2, 2]}


def _extension_node_ids(comfy) -> set[str]:
    """Node ids the pack's own comfy_entrypoint returns (the module ComfyUI's loader imported)."""
    module = sys.modules[str(comfy.base_dir / "custom_nodes" / PACK_NAME)]
    extension = asyncio.run(module.comfy_entrypoint())
    return {node.GET_SCHEMA().node_id for node in asyncio.run(extension.get_node_list())}


def test_missing_comfyui_fails_naming_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ComfyNotFound, match="COMFYUI_PATH"):
        find_comfyui({"COMFYUI_PATH": str(tmp_path)})


def test_pack_loads_through_comfy_loader_in_process(comfy) -> None:
    ids = _extension_node_ids(comfy)
    assert EXPECTED_NODE_IDS <= ids
    assert all(i.startswith("Carnator") for i in ids)
    assert set(comfy.pack_node_ids()) == ids
    assert {"HarnessTextConditioning", "HarnessLatentStats"} <= set(comfy.pack_node_ids("carnator_harness"))


@pytest.mark.server
def test_object_info_lists_every_carnator_node_with_tooltips(comfy, comfy_server) -> None:
    info = comfy_server.object_info()
    carnator = {node_id: spec for node_id, spec in info.items() if node_id.startswith("Carnator")}
    assert set(carnator) == _extension_node_ids(comfy)
    for node_id, spec in carnator.items():
        assert spec["python_module"] == f"custom_nodes.{PACK_NAME}", node_id
        assert spec["category"].startswith("Carnator/"), node_id
        for section in ("required", "optional"):
            for name, (_type, options) in spec["input"].get(section, {}).items():
                assert options.get("tooltip"), f"{node_id}.{name} has no tooltip"


def test_tiny_models_are_detected_by_comfy_loader(comfy, tiny_models) -> None:
    import comfy.sd

    for family, model in tiny_models.items():
        with captured_logs() as logs:
            patcher = comfy.sd.load_diffusion_model(str(model.path))
        assert type(patcher.model.model_config).__name__ == model.spec.model_config_class, family
        assert not [line for line in logs if "unet missing" in line or "unet unexpected" in line], family


@pytest.mark.parametrize("family", sorted(GRAPHS))
def test_template_graph_samples_in_process(comfy, tiny_models, family: str) -> None:
    run = comfy.run_prompt(GRAPHS[family](tiny_models[family].name))
    latent = run.output(SAMPLER)["samples"]
    assert list(latent.shape) == EXPECTED_SHAPES[family]
    assert torch.isfinite(latent).all() and latent.abs().max() > 0
    stats = run.history["outputs"][STATS]["latent_stats"][0]
    assert stats["shape"] == EXPECTED_SHAPES[family] and stats["finite"]


def test_in_process_events_reach_the_prompt_server_queue(comfy, tiny_models) -> None:
    comfy.drain_events()
    run = comfy.run_prompt(GRAPHS["wan"](tiny_models["wan"].name, seed=2), client_id="harness")
    events = [(event, data.get("prompt_id"), sid) for event, data, sid in comfy.drain_events() if isinstance(data, dict)]
    assert ("execution_start", run.prompt_id, "harness") in events
    assert ("execution_success", run.prompt_id, "harness") in events


@pytest.mark.server
@pytest.mark.parametrize("family", sorted(GRAPHS))
def test_template_graph_samples_through_server_api(comfy_server, tiny_models, family: str) -> None:
    run = comfy_server.client.run(GRAPHS[family](tiny_models[family].name), timeout=300)
    stats = run.history["outputs"][STATS]["latent_stats"][0]
    assert stats["shape"] == EXPECTED_SHAPES[family]
    assert stats["finite"] and stats["abs_max"] > 0


@pytest.mark.server
def test_websocket_reports_a_prompt_from_start_to_success(comfy_server, tiny_models) -> None:
    messages = comfy_server.client.run(GRAPHS["wan"](tiny_models["wan"].name, seed=1), timeout=300).events
    types = [m["type"] for m in messages]
    assert "execution_start" in types and types[-1] == "execution_success"
    assert any(m["type"] == "executing" and m["data"].get("node") == SAMPLER for m in messages)


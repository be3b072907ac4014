"""Model fingerprints and hard keys of real ComfyUI models (UNETLoader, LoraLoaderModelOnly)."""

from __future__ import annotations

import sys

import pytest
import torch
from support.comfy_host import PACK_NAME
from support.tiny_models import write_tiny_model

from carnator_core.lookup.fingerprint import FingerprintError, schedule_fingerprint, token_grid


@pytest.fixture(scope="module")
def host(comfy):
    """The pack's host bridge module, as ComfyUI's loader imported it."""
    return sys.modules[f"{comfy.base_dir / 'custom_nodes' / PACK_NAME}.nodes.host"]


def _unet(comfy, name: str):
    return comfy.call_node("UNETLoader", unet_name=name, weight_dtype="default")[0]


def test_fingerprint_is_stable_for_a_reload_and_changes_with_the_model(comfy, tiny_models, host):
    first = host.fingerprint(_unet(comfy, tiny_models["wan"].name))
    comfy.unload_models()
    assert host.fingerprint(_unet(comfy, tiny_models["wan"].name)) == first
    other = write_tiny_model("wan", tiny_models["wan"].path.parent, seed=5, filename="tiny_wan_other.safetensors")
    assert host.fingerprint(_unet(comfy, other.name)) != first
    assert host.fingerprint(_unet(comfy, tiny_models["hunyuan_video"].name)) != first


def test_fingerprint_changes_with_a_lora_and_its_strength(comfy, tiny_models, host, wan_lora):
    base = _unet(comfy, tiny_models["wan"].name)
    plain = host.fingerprint(base)
    full = host.fingerprint(comfy.call_node("LoraLoaderModelOnly", model=base, lora_name=wan_lora,
                                            strength_model=1.0)[0])
    half = host.fingerprint(comfy.call_node("LoraLoaderModelOnly", model=base, lora_name=wan_lora,
                                            strength_model=0.5)[0])
    again = host.fingerprint(comfy.call_node("LoraLoaderModelOnly", model=base, lora_name=wan_lora,
                                             strength_model=0.5)[0])
    assert len({plain, full, half}) == 3
    assert half == again


def test_fingerprint_ignores_weights_currently_patched_in_place(comfy, tiny_models, host, wan_lora,
                                                                fresh_process_state):
    """ComfyUI applies LoRAs to the weights in place while a model is loaded; the fingerprint must not see that."""
    from comfy.model_management import load_models_gpu

    base = _unet(comfy, tiny_models["wan"].name)
    plain = host.fingerprint(base)
    patched = comfy.call_node("LoraLoaderModelOnly", model=base, lora_name=wan_lora, strength_model=1.0)[0]
    expected = host.fingerprint(patched)
    weight = patched.model.diffusion_model.blocks[0].self_attn.q.weight
    before = weight.detach().clone()
    load_models_gpu([patched])  # applies the LoRA to the shared weights
    assert not torch.equal(patched.model.diffusion_model.blocks[0].self_attn.q.weight, before)
    fresh_process_state()
    assert host.fingerprint(patched) == expected
    comfy.unload_models()
    fresh_process_state()
    assert host.fingerprint(base) == plain


def test_hard_key_parts(comfy, tiny_models, host):
    wan = _unet(comfy, tiny_models["wan"].name)
    key = host.hard_key(wan, torch.zeros(1, 16, 21, 60, 104), torch.linspace(1, 0, 31))
    assert key.grid == (21, 30, 52)  # Wan 2.1 480p, 81 frames: patch (1, 2, 2)
    assert key.schedule == schedule_fingerprint(torch.linspace(1, 0, 31))
    assert key.schedule != schedule_fingerprint(torch.linspace(1, 0, 21))
    ltxv = _unet(comfy, tiny_models["ltxv"].name)
    assert host.hard_key(ltxv, torch.zeros(1, 128, 13, 16, 22)).grid == (13, 16, 22)  # LTX-Video: patch 1
    assert token_grid((1, 16, 5, 9, 9), (1, 2, 2)) == (5, 5, 5)  # odd sizes round up like patch embedding


def test_unfingerprintable_model_is_a_clear_error(host):
    with pytest.raises(FingerprintError, match="not a ComfyUI model patcher"):
        host.fingerprint(object())


def test_model_whose_weights_cannot_be_read_is_not_fingerprinted(comfy, tiny_models, host, monkeypatch,
                                                                  fresh_process_state):
    """A weight without data (a meta tensor) or one whose read raises is "model not fingerprinted", never a crash."""
    model = _unet(comfy, tiny_models["wan"].name)
    weight = model.model.diffusion_model.blocks[0].self_attn.q.weight
    monkeypatch.setattr(model.model.diffusion_model.blocks[0].self_attn.q, "weight",
                        torch.nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False))
    with pytest.raises(FingerprintError, match="^model not fingerprinted: .*meta tensor"):
        host.fingerprint(model)

    def unreadable(tensor, count=16):
        raise RuntimeError("Cannot copy out of meta tensor; no data!")

    monkeypatch.undo()
    monkeypatch.setattr(sys.modules["carnator_core.lookup.fingerprint"], "tensor_sample", unreadable)
    with pytest.raises(FingerprintError, match="^model not fingerprinted: RuntimeError: Cannot copy out of meta"):
        host.fingerprint(model)

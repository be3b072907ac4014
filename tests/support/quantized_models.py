"""The demo model written the ways people download Wan models: GGUF (city96's conventions), fp8 `scaled_fp8` and
`_quantization_metadata` checkpoints. Each writer takes the demo model's safetensors and returns the file it wrote.

GGUF follows the pack's tools/convert.py: tensor names without the `model.diffusion_model.` prefix, 1-D tensors in
F32, the quantization type on 2-D weights whose rows fill whole blocks, every other tensor (the 5-D patch embedding)
in F16. The fp8 files follow comfy/utils.py `convert_old_quants`: an fp8 weight per linear layer with its per-tensor
scale, marked by a `scaled_fp8` tensor or by the `_quantization_metadata` header entry.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_WEIGHTS = "carnator_demo_wan21_t2v.safetensors"
DEMO_SOURCE = REPO_ROOT / "carnator_core" / "demo" / "weights" / DEMO_WEIGHTS
GGUF_PACK = REPO_ROOT.parent / "shared" / "packs" / "ComfyUI-GGUF-795e451.tar.gz"  # city96's pack, as packed
GGUF_PREFIX = "model.diffusion_model."
_FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def write_gguf(source: Path, target: Path, quantization: str) -> Path:
    """`quantization`: a GGMLQuantizationType name, e.g. "Q8_0" or "Q4_0"."""
    import gguf

    qtype = gguf.GGMLQuantizationType[quantization]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    writer = gguf.GGUFWriter(path=None, arch="wan")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, tensor in load_file(str(source)).items():
        data = tensor.to(torch.float32).numpy()
        if data.ndim == 1:
            kind = gguf.GGMLQuantizationType.F32
        elif data.ndim == 2 and data.shape[-1] % block == 0:
            kind = qtype
        else:
            kind = gguf.GGMLQuantizationType.F16
        writer.add_tensor(name.removeprefix(GGUF_PREFIX), gguf.quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file(path=str(target))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def _fp8_layers(source: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The state dict with every 2-D linear weight in fp8, and each such layer's per-tensor scale."""
    state = load_file(str(source))
    scales = {}
    for name in [n for n, t in state.items() if n.endswith(".weight") and t.ndim == 2]:
        weight = state[name].to(torch.float32)
        scale = (weight.abs().amax() / _FP8_MAX).clamp(min=1e-12)
        state[name] = (weight / scale).to(torch.float8_e4m3fn)
        scales[name.removesuffix(".weight")] = scale.reshape(())
    return state, scales


def write_scaled_fp8(source: Path, target: Path) -> Path:
    """The official templates' `*_fp8_scaled` format: `<layer>.scale_weight` and a `scaled_fp8` marker tensor."""
    state, scales = _fp8_layers(source)
    state.update({f"{layer}.scale_weight": scale for layer, scale in scales.items()})
    state["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    save_file(state, str(target))
    return target


def write_quantization_metadata(source: Path, target: Path) -> Path:
    """ComfyUI's mixed-precision format: `<layer>.weight_scale` and the layers' formats in the file header."""
    state, scales = _fp8_layers(source)
    state.update({f"{layer}.weight_scale": scale for layer, scale in scales.items()})
    layers = {layer: {"format": "float8_e4m3fn"} for layer in scales}
    save_file(state, str(target), metadata={"_quantization_metadata": json.dumps({"layers": layers})})
    return target

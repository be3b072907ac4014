"""Random-weight Wan 2.1 T2V models in ComfyUI's format: test stand-ins for the demo weights, and the
attention-heavy timing model of the workload benchmark (where only the cost of attention matters)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from carnator_core.demo.wan_model import WanConfig, WanT2V

SMALL = WanConfig(dim=128, ffn_dim=256, num_layers=2)  # one head of 128: the smallest ComfyUI detects


def write_random_wan(path: Path, config: WanConfig = SMALL, seed: int = 0) -> Path:
    """Save a randomly initialised WanT2V as fp16 safetensors that UNETLoader detects as Wan 2.1 T2V.

    The output head is re-initialised (training starts it at zero), so samples are not trivially the noise.
    """
    torch.manual_seed(seed)
    model = WanT2V(config)
    torch.nn.init.normal_(model.head.head.weight, std=0.02)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().half().contiguous() for k, v in model.state_dict().items()}, str(path))
    return path

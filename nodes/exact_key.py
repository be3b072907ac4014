"""The exact key of a sampling run (`carnator_core.reuse.exact_repeat`): every input that decides what ComfyUI's
sampler returns, hashed from the objects the sampler is handed.

The model by its fingerprint (weights, LoRAs and their strengths, `HardKey`), the scope, the guider's conditions
whole (every tensor of positive and negative, and every option that goes with them), the initial noise and the input
latent bit for bit, the denoise mask (inpainting, a refinement's mask of ones), the sampler (its function and
options), the sigmas, the guidance scale and every model option on the CFG path. A run with a step cache (EasyCache,
LazyCache: their state runs on across calls) has no key: it is never served nor recorded as an exact repeat.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

from carnator_core.store.entry import HardKey

from .reuse_lifecycle import CFG_PATH_OPTIONS

_DEPTH = 12  # how deep the conditions' nested options are followed


class _NoKey(Exception):  # noqa: N818 (a signal, not an error)
    """An input the key cannot hold whole (a module, such as a ControlNet in the conditions)."""


def exact_key(guider, sampler, noise: torch.Tensor, latent_image: torch.Tensor | None, sigmas: torch.Tensor,
              denoise_mask: Any, key: HardKey, step_cache: bool) -> str | None:
    """The run's exact key, or None where it has none (a step cache, a module in the conditions)."""
    options = getattr(guider, "model_options", {})
    if step_cache:
        return None
    hasher = hashlib.sha256()
    feed = _feeder(hasher)
    try:
        _feed_inputs(feed, guider, sampler, noise, latent_image, denoise_mask, sigmas, key, options)
    except _NoKey:
        return None
    return hasher.hexdigest()


def _feed_inputs(feed: Callable[[Any], None], guider, sampler, noise: torch.Tensor, latent_image: torch.Tensor | None,
                 denoise_mask: Any, sigmas: torch.Tensor, key: HardKey, options: dict) -> None:
    feed(("key", key.model, key.grid, key.frame_rate, key.scope))
    feed(("conds", getattr(guider, "conds", {})))
    feed(("noise", noise, "latent", latent_image, "mask", denoise_mask, "sigmas", sigmas.to(torch.float64)))
    function = getattr(sampler, "sampler_function", None)
    feed(("sampler", type(sampler).__qualname__, getattr(function, "__qualname__", repr(function)),
          getattr(sampler, "extra_options", None), getattr(sampler, "inpaint_options", None)))
    feed(("cfg", getattr(guider, "cfg", None), [(name, options.get(name)) for name in CFG_PATH_OPTIONS]))


def _feeder(hasher) -> Callable[[Any], None]:
    def feed(value: Any, depth: int = 0) -> None:
        if depth > _DEPTH or isinstance(value, torch.nn.Module):
            raise _NoKey
        elif isinstance(value, torch.Tensor):
            values = value.detach().to("cpu").contiguous()
            hasher.update(f"tensor:{values.dtype}:{tuple(values.shape)}:".encode())
            hasher.update(values.reshape(-1).view(torch.uint8).numpy().tobytes() if values.numel() else b"")
        elif isinstance(value, dict):
            hasher.update(b"{")
            for name in sorted(value, key=str):
                hasher.update(f"{name}:".encode())
                feed(value[name], depth + 1)
            hasher.update(b"}")
        elif isinstance(value, (list, tuple)):
            hasher.update(b"[")
            for item in value:
                feed(item, depth + 1)
            hasher.update(b"]")
        elif value is None or isinstance(value, (bool, int, float, str)):
            hasher.update(f"{type(value).__name__}:{value!r};".encode())
        elif callable(value):
            cells = [cell.cell_contents for cell in getattr(value, "__closure__", None) or ()
                     if isinstance(cell.cell_contents, (bool, int, float, str, torch.Tensor))]
            hasher.update(f"fn:{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', repr(type(value)))};"
                          .encode())
            feed(cells, depth + 1)
        elif hasattr(value, "__dict__"):  # ComfyUI's CONDRegular and its kind: their tensors and settings
            hasher.update(f"obj:{type(value).__qualname__};".encode())
            feed(vars(value), depth + 1)
        else:
            hasher.update(f"{type(value).__qualname__};".encode())

    return feed

"""Fingerprints for hard compatibility: a donor must share model, token grid and schedule.

Everything here takes plain data (names, dicts, tensors), so the host layer decides how to
pull it out of a ComfyUI ModelPatcher and this module stays host-agnostic.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

_SAMPLES_PER_TENSOR = 16
_DIGEST_CHARS = 24


class FingerprintError(ValueError):
    """The model could not be fingerprinted; reuse must be skipped for it."""


@dataclass(frozen=True)
class StoredWeight:
    """One weight as its loader stores it: the plain tensors that hold its data (a quantized weight's packed blocks
    and its scales) and the storage format's name (dtype, GGUF quantization type, quantized layout), so that two
    quantizations of one model never share a fingerprint, whatever their sampled values."""

    name: str
    layout: str
    shape: tuple[int, ...]
    parts: tuple[torch.Tensor, ...]


def _digest(hasher: hashlib._Hash) -> str:
    return hasher.hexdigest()[:_DIGEST_CHARS]


def tensor_sample(tensor: torch.Tensor, count: int = _SAMPLES_PER_TENSOR) -> bytes:
    """A deterministic, strided sample of a tensor as float32 bytes.

    A handful of evenly spaced elements per tensor tells two checkpoints apart at a tiny
    fraction of the cost of hashing billions of weights.
    """
    if tensor.is_meta:
        raise FingerprintError("a weight is a meta tensor (it holds no data)")
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return b""
    stride = max(1, flat.numel() // count)
    picked = flat[::stride][:count]
    return picked.to(device="cpu", dtype=torch.float32).numpy().tobytes()


def _canonical(value: Any) -> Any:
    """JSON-stable view of config values (tuples, dtypes, nested dicts)."""
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        return round(value, 9)
    return str(value)


def model_fingerprint(model_class: str, config: Mapping[str, Any],
                      weights: Iterable[StoredWeight],
                      patches: Iterable[tuple[str, float, float, torch.Tensor | None]] = ()) -> str:
    """Hash of the model class, its config, a sample of the stored weights and the applied weight patches.

    `weights` are the *unpatched* weights as stored; `patches` are (key, strength_patch, strength_model,
    patch weight sample) so that a LoRA, and any change of its strength, yields another fingerprint.
    """
    hasher = hashlib.sha256()
    hasher.update(model_class.encode())
    hasher.update(json.dumps(_canonical(dict(config)), sort_keys=True).encode())
    count = 0
    for weight in sorted(weights, key=lambda item: item.name):
        hasher.update(f"{weight.name}:{weight.layout}:{weight.shape}".encode())
        for part in weight.parts:
            hasher.update(str(tuple(part.shape)).encode())
            hasher.update(tensor_sample(part))
        count += 1
    if count == 0:
        raise FingerprintError(f"{model_class} exposes no weights to fingerprint")
    for key, strength_patch, strength_model, sample in sorted(patches, key=lambda item: item[0]):
        hasher.update(f"patch:{key}:{strength_patch:.9g}:{strength_model:.9g}".encode())
        if sample is not None:
            hasher.update(tensor_sample(sample))
    return _digest(hasher)


def token_grid(latent_shape: Sequence[int], patch_size: Sequence[int] | int) -> tuple[int, ...]:
    """Tokens per axis after patchify, e.g. (frames, h, w) for a (B, C, T, H, W) video latent."""
    spatial = [int(v) for v in latent_shape[2:]]
    if not spatial:
        raise FingerprintError(f"latent shape {tuple(latent_shape)} has no spatial axes")
    patch = [int(patch_size)] * len(spatial) if isinstance(patch_size, int) else [int(p) for p in patch_size]
    if len(patch) < len(spatial):
        patch = [1] * (len(spatial) - len(patch)) + patch
    patch = patch[-len(spatial):]
    return tuple(math.ceil(size / max(p, 1)) for size, p in zip(spatial, patch, strict=True))


def schedule_fingerprint(sigmas: torch.Tensor | Sequence[float]) -> str:
    """Hash of the sigma schedule, rounded so float noise between processes does not split it."""
    values = torch.as_tensor(sigmas, dtype=torch.float64).reshape(-1).cpu()
    rounded = [round(float(v), 6) for v in values]
    return _digest(hashlib.sha256(json.dumps(rounded).encode()))


def noise_fingerprint(noise: torch.Tensor) -> str:
    """Identity of the initial noise tensor itself: same seed, generator and shape give the same noise.

    Hashing a sample of the tensor (not the seed) also covers custom noise nodes and batches.
    """
    hasher = hashlib.sha256(str(tuple(noise.shape)).encode())
    hasher.update(tensor_sample(noise, count=256))
    return _digest(hasher)


def content_fingerprint(tensor: torch.Tensor) -> str:
    """Identity of a latent's whole content, as the fp16 values ComfyUI may keep between nodes: a stage's output and
    the next sampler's input match only when they are the same tensor (any edit in between changes it)."""
    values = tensor.detach().to(device="cpu", dtype=torch.float16).contiguous()
    hasher = hashlib.sha256(str(tuple(values.shape)).encode())
    hasher.update(values.view(torch.int16).numpy().tobytes())
    return _digest(hasher)

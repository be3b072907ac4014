"""Exact repeats: a request whose every sampler input matches a stored run's gets that run's output after one model
call.

ComfyUI keeps only the last output of each node, so going back to an earlier variant (the template's example prompt,
a retry, an earlier wording) recomputes it, and a rewording's resume would too. A run sampled plain (no resume, no
sparse attention, no step cache) records, beside its checkpoints, its exact key (the host's hash of every sampler
input: model with its patches, positive and negative conditioning, initial noise, input latent and denoise mask,
sampler and its options, sigmas, guidance, every model option on the CFG path, the scope), the digest of its first
model prediction (the step-0 callback's, bit for bit) and its output at full precision. A later request with the
same key samples its step 0 as usual; where that prediction's digest equals the stored one (same machine, same
attention path: the computation is deterministic), its output is the stored one, which is what its own sampling
would give bit for bit.
Any other bit (another device, another kernel) samples on from there as the usual run does.

A request sampled in stages (two experts, a refinement) repeats stage by stage: a stage that repeated its stored
stage exactly hands the entry on, and the stage continuing it is served from that entry's next stage where its own
exact key (its input latent is the repeated output) is the one recorded there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from carnator_core.store.entry import EntryMeta
from carnator_core.store.reuse_store import ReuseStore
from carnator_core.store.stages import final_blob, stage_entry

EXACT = "exact"  # a stage's `extra` key: {"key": the exact key, "first": the first prediction's digest}
FINAL_TENSOR = "final"  # the tensor of a stage's output in its `final_blob`, at its own precision


def prediction_digest(tensor: torch.Tensor) -> str:
    """The digest of a tensor's exact bits (dtype, shape and every byte)."""
    values = tensor.detach().to("cpu").contiguous()
    hasher = hashlib.sha256(f"{values.dtype}:{tuple(values.shape)}".encode())
    hasher.update(values.reshape(-1).view(torch.uint8).numpy().tobytes() if values.numel() else b"")
    return hasher.hexdigest()


@dataclass(frozen=True)
class ExactRepeat:
    """A stored run the request repeats exactly: its entry, its first prediction's digest and its output."""

    entry: EntryMeta
    first: str
    output: torch.Tensor


class RepeatConfirmed(Exception):  # noqa: N818 (a signal, not an error)
    """The request's first prediction equals the stored run's: the sampler stops, the output is the stored one."""


class RepeatDiffers(Exception):  # noqa: N818 (a signal, not an error)
    """The request's first prediction differs from the stored run's in some bit: the run samples as usual."""


def find_exact(store: ReuseStore, entry_ids: Iterable[str], key: str,
               latent_shape: tuple[int, ...]) -> ExactRepeat | None:
    """The first of `entry_ids` that recorded `key`, with its output: of the request's latent shape and finite. An
    entry whose output is missing or damaged is passed over (the request then resumes or samples as usual)."""
    for entry_id in entry_ids:
        meta = store.get_meta(entry_id)
        repeat = None if meta is None else stage_repeat(store, meta, 0, key, latent_shape)
        if repeat is not None:
            return repeat
    return None


def stage_repeat(store: ReuseStore, entry: EntryMeta, stage: int, key: str,
                 latent_shape: tuple[int, ...]) -> ExactRepeat | None:
    """Stage `stage` of `entry` where it recorded `key` and its output is of the request's latent shape and finite;
    else None."""
    meta = stage_entry(entry, stage)
    record = meta.extra.get(EXACT) if meta is not None else None
    if not isinstance(record, dict) or record.get("key") != key or not isinstance(record.get("first"), str):
        return None
    tensors = store.get_tensors(entry.entry_id, final_blob(stage))
    output = tensors.get(FINAL_TENSOR) if tensors is not None else None
    if output is None or tuple(output.shape) != tuple(latent_shape) or not bool(torch.isfinite(output).all()):
        return None
    return ExactRepeat(entry=entry, first=record["first"], output=output)

"""The workload benchmark's configurations: what each one adds to the demo model's graph (reuse modes, EasyCache,
sparse attention with own or an unrelated donor's masks, text-only reuse), the stores they record into, the donor prompt
of the mask configurations and the attention-heavy model."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

from carnator_core.demo import graphs, world
from carnator_core.demo.wan_model import WanConfig
from carnator_core.judging.fewer_steps import fewer_steps_count

CONFIGS = ("plain", "easycache", "text-only", "own-masks", "any-donor-masks", "safe", "balanced", "fast",
           "balanced+easycache")
# The two-expert graph (`--graph two-expert`, the Wan 2.2 14B template's shape): plain and the reuse modes, one
# CarnatorReuse on each expert.
TWO_EXPERT_CONFIGS = ("plain", "safe", "balanced", "fast")
# Configurations that skip steps by extrapolating the model's output within a request: what they leave of the noise
# reads as high-frequency detail, so the yardstick's detail measure would credit it, and they are not weighed.
STEP_CACHES = frozenset({"easycache", "balanced+easycache"})
RECORDING = frozenset({"text-only", "safe", "balanced", "fast", "balanced+easycache"})  # their runs add entries
# `--shared-store`: these modes look up in one store, and each prompt is recorded there by one of them in turn, so
# that every mode meets the same donors, recorded by requests in every mode.
SHARED_MODES = ("safe", "balanced", "fast")
SHARED_STORE = "shared"
DONOR_SEED = 987654321
# ComfyUI's CPU default for dense attention is its sub-quadratic chunked kernel, far slower than PyTorch's
# SDPA; every dense call (plain, and the dense steps/layers of the sparse configurations) uses SDPA instead,
# so that speedups measure sparsity and reuse, not a kernel swap.
DENSE_ATTENTION = ("--use-pytorch-cross-attention",)
HEAVY_CLIP = (9, 48, 48)  # 9 x 24 x 24 = 5184 video tokens after Wan's 1x2x2 patches
HEAVY_MODEL = WanConfig(dim=256, ffn_dim=1024, num_layers=2)
HEAVY_STEPS = 8
# Random weights attend almost uniformly (no structure to find), so the mask density is capped: the
# configuration measures what a given density buys end to end, not whether the masks are right. A 2-layer
# model has no interior layers, so the dense edge blocks (2 of 30 in Wan 1.3B) are switched off here.
# own-masks and any-donor-masks measure the masks themselves, so every mask runs sparse however full it is and
# however few the tokens (the node's defaults run masks fuller than 0.6 dense, and the demo's 320 tokens dense whole).
MASKS_ALWAYS_SPARSE = {"dense_above": 1.0, "min_tokens": 0}
HEAVY_ATTENTION = {"max_density": 0.25, "dense_first_blocks": 0, "dense_last_blocks": 0}


def store_dir(name: str, prefix: str = "stores") -> str:
    return f"{prefix}/{re.sub('[^a-z0-9]+', '_', name)}"


def expert_boundary(steps: int) -> int:
    """The two-expert graph's hand-over step: half-way, and after the one step of a 1-step run (a first expert
    that ends at step 0 would hand over its latent without the noise)."""
    return max(1, steps // 2)


def config_graph(name: str, base: dict, prompt: str, donor_prompt: str, store_prefix: str = "stores",
                 seed_policy: str = "same-noise", shared: bool = False, records: bool = True) -> dict:
    """The base demo graph with configuration `name` spliced in front of its sampler (plain at fewer steps: the
    base graph with its sampler's steps lowered). `shared`: its reuse node uses the store of `SHARED_STORE`, and
    records there only where `records`."""
    steps = fewer_steps_count(name)
    if steps is not None:
        graph = copy.deepcopy(base)
        graph[graphs.SAMPLER]["inputs"]["steps"] = steps
        return graph
    store = store_dir(SHARED_STORE if shared else name, store_prefix)
    record = {} if records else {"record": False}

    def reuse(graph: dict, **options) -> dict:
        return graphs.with_reuse(graph, store, prompt, seed_policy=seed_policy, **record, **options)

    def any_donor() -> dict:
        graph, match = graphs.with_donor_lookup(base, store, donor_prompt)
        return graphs.with_sparse_attention(graph, "borrowed+own", match, **MASKS_ALWAYS_SPARSE)

    builders: dict[str, Callable[[], dict]] = {
        "plain": lambda: base,
        "easycache": lambda: graphs.with_easycache(base),
        "text-only": lambda: reuse(base, mode="balanced", verification="text-only", sparse_attention="off"),
        "own-masks": lambda: graphs.with_sparse_attention(base, "own", **MASKS_ALWAYS_SPARSE),
        "any-donor-masks": any_donor,
        "safe": lambda: reuse(base, mode="safe"),
        "balanced": lambda: reuse(base, mode="balanced"),
        "fast": lambda: reuse(base, mode="fast"),
        "balanced+easycache": lambda: graphs.with_easycache(reuse(base, mode="balanced")),
    }
    return builders[name]()


def donor_prompt_for(prompts: list[str]) -> str:
    """A canonical prompt as far from every scorable stream prompt as the world allows (the arbitrary donor)."""
    parsed = [p for p in (world.parse_prompt(x) for x in prompts) if p is not None]

    def closest_overlap(attrs: dict[str, str]) -> int:  # attributes shared with the most similar stream prompt
        return max((sum(attrs[k] == p[k] for k in world.ATTRIBUTES) for p in parsed), default=0)

    return world.canonical_prompt(min(world.all_attribute_sets(), key=closest_overlap))


def mask_donor_graph(base: dict, store: str, donor: str) -> dict:
    """The arbitrary donor's run, recording its own masks into `store` whatever its token count (any-donor-masks
    borrows them)."""
    return graphs.with_reuse(graphs.with_sparse_attention(base, "own", **MASKS_ALWAYS_SPARSE), store, donor,
                             mode="safe", sparse_attention="off")

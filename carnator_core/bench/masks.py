"""Do borrowed attention masks carry over? Recall of a request's true attention under masks from other sources.

`python -m carnator_core.bench masks [--n 8] [--weights FILE] [--json]`

Sparsity reuse is only worth something if a *compatible* donor's masks cover the request's attention better than
masks anyone could have: an arbitrary earlier request's, or a static, prompt-agnostic prior. On the demo model,
for each request (a canonical prompt, fixed seed) this samples the plain result, then at noise levels 0.8 and 0.4
takes every layer's self-attention map of the request (the truth) and of each mask source at the same state
construction (same noise, that source's own sample), keeps per (layer, head, query block) the top `density` share
of key blocks by the source's block mass, and reports the share of the request's true attention mass those blocks
hold (recall; 1.0 = nothing lost):

- own: the request's own map (the upper bound an online estimate approaches);
- paraphrase: a reworded prompt, same seed (the near-duplicate donor Carnator looks for);
- one-word edit: one attribute changed, same seed (the prompt-editing loop);
- arbitrary: an unrelated prompt with another seed;
- static prior: the mean map of 8 other prompts and seeds (prompt-agnostic);
- random: random key blocks (same count).

Blocks are 16 tokens (the demo clip has 320 video tokens, 20 blocks per side).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch

from carnator_core.attention.masks import BlockSparseMask, recall
from carnator_core.bench.probe import load_model
from carnator_core.bench.tables.attention import masks_markdown
from carnator_core.demo import world
from carnator_core.demo.attention_density import block_mass, self_attention_probs
from carnator_core.demo.sampling import sample
from carnator_core.demo.text import token_embeddings
from carnator_core.demo.wan_model import WanT2V
from carnator_core.recorded_runs import Recording, add_record_option

BLOCK = 16
SIGMAS = (0.8, 0.4)
DENSITIES = (0.25, 0.5)
SOURCES = ("own", "paraphrase", "one-word edit", "arbitrary", "static prior", "random")


def top_blocks(scores: torch.Tensor, density: float, n_tokens: int) -> BlockSparseMask:
    """The mask keeping the `density` share of key blocks with the highest scores per query block.

    A fixed share, unlike the engine's `select_blocks` (which keeps blocks up to a mass threshold and always the
    diagonal and first-frame blocks): every source is compared at the same cost, and a source's blocks are its own
    choice alone. Recall is then the engine's `recall`."""
    keep = max(1, round(density * scores.shape[-1]))
    index = scores.topk(keep, dim=-1).indices
    return BlockSparseMask(torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, index, True), BLOCK, n_tokens)


class Maps:
    """Per (sigma, layer) block masses of one prompt/seed, from the demo model's own plain sample."""

    def __init__(self, model: WanT2V, prompts: list[str], seeds: list[int], steps: int) -> None:
        context = token_embeddings(prompts)
        noise = torch.stack([torch.randn(16, *world.CLIP, generator=torch.Generator().manual_seed(s)) for s in seeds])
        x0 = sample(model, context, None, noise, steps)
        self.mass: dict[float, list[torch.Tensor]] = {}
        for sigma in SIGMAS:
            probs = self_attention_probs(model, sigma * noise + (1 - sigma) * x0,
                                         torch.full((len(prompts),), sigma * 1000), context)
            self.n_tokens = probs[0].shape[-1]
            self.mass[sigma] = [block_mass(p, BLOCK) for p in probs]


def measure(model: WanT2V, n: int, steps: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    chosen = world.pick_attribute_sets(rng, n)
    requests = [world.canonical_prompt(a) for a in chosen]
    seeds = [1000 + i for i in range(n)]
    paraphrases = [world.paraphrase(a, rng) for a in chosen]
    edits = [world.canonical_prompt(world.swap(a, world.ATTRIBUTES[i % 4], rng)) for i, a in enumerate(chosen)]
    unrelated = [world.canonical_prompt(a) for a in world.pick_attribute_sets(rng, n)]
    prior_sets = world.pick_attribute_sets(rng, 8)
    maps = {
        "own": Maps(model, requests, seeds, steps),
        "paraphrase": Maps(model, paraphrases, seeds, steps),
        "one-word edit": Maps(model, edits, seeds, steps),
        "arbitrary": Maps(model, unrelated, [2000 + i for i in range(n)], steps),
    }
    prior = Maps(model, [world.canonical_prompt(a) for a in prior_sets], [3000 + i for i in range(8)], steps)
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for sigma in SIGMAS:
        truth = maps["own"].mass[sigma]
        for density in DENSITIES:
            row = {"sigma": sigma, "density": density}
            for source in SOURCES:
                recalls = []
                for layer, true_mass in enumerate(truth):
                    if source == "static prior":
                        scores = prior.mass[sigma][layer].mean(0, keepdim=True).expand_as(true_mass)
                    elif source == "random":
                        scores = torch.rand(true_mass.shape, generator=generator)
                    else:
                        scores = maps[source].mass[sigma][layer]
                    mask = top_blocks(scores, density, maps["own"].n_tokens)
                    recalls.append(float(recall(mask, true_mass).mean()))
                row[source] = round(statistics.mean(recalls), 4)
            rows.append(row)
    return {"requests": n, "steps": steps, "block_tokens": BLOCK, "rows": rows}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m carnator_core.bench masks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=8, help="requests (canonical prompts)")
    parser.add_argument("--steps", type=int, default=20, help="sampling steps of each plain sample")
    parser.add_argument("--weights", type=Path, default=None,
                        help="demo model .safetensors (default: $CARNATOR_DEMO_WEIGHTS, else the shipped file)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    add_record_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    recording = Recording(args.record, "carnator_core.bench masks", argv)
    with torch.no_grad():
        result = measure(load_model(args.weights), args.n, args.steps)
    recording.store(result, torch_threads=args.threads, timed=False)
    print(json.dumps(result) if args.json else masks_markdown(result))
    return 0

"""API-format ComfyUI graphs for the embedded demo model, shared by `demo run` and the workload benchmark.

Why one place: the demo command and every benchmark configuration must sample through the same stock chain
(UNETLoader -> ModelSamplingSD3 -> KSampler over an EmptyHunyuanLatentVideo of the demo clip size), so that
the only difference between two configurations is the nodes a `with_*` function splices in front of the
sampler. Node ids are names (`SAMPLER`, `MODEL_CHAIN` ...), so callers can find outputs in /history.
"""

from __future__ import annotations

import copy

from carnator_core.demo import world

LOADER = "loader"
MODEL_CHAIN = "model_sampling"  # the last node of the plain model chain
POSITIVE = "positive"
NEGATIVE = "negative"
LATENT = "latent"
SAMPLER = "sampler"
STORE = "carnator_store"
REPORT = "carnator_report"
SAVE_LATENT = "save_latent"
# nodes whose work is the same in every configuration (cached by ComfyUI or negligible): not timed
SHARED_NODES = frozenset({LOADER, MODEL_CHAIN, POSITIVE, NEGATIVE, LATENT, STORE, REPORT, SAVE_LATENT,
                          "decode", "save_webp", "donor_text", "high_noise_loader", "high_noise_sampling"})

SHIFT = 3.0  # the flow shift the demo model was trained and evaluated with (train.py)
VAE_SPATIAL, VAE_TEMPORAL = 8, 4  # Wan 2.1's latent compression, which EmptyHunyuanLatentVideo assumes


def _node(class_type: str, **inputs) -> dict:
    return {"class_type": class_type, "inputs": inputs}


def latent_size(clip: tuple[int, int, int] = world.CLIP) -> dict[str, int]:
    """EmptyHunyuanLatentVideo width/height/length that give a latent of `clip` (frames, height, width)."""
    frames, height, width = clip
    return {"width": width * VAE_SPATIAL, "height": height * VAE_SPATIAL, "length": (frames - 1) * VAE_TEMPORAL + 1}


def base_graph(unet_name: str, prompt: str, *, seed: int = 0, steps: int = 30, cfg: float = 1.0,
               clip: tuple[int, int, int] = world.CLIP, sampler_name: str = "euler", scheduler: str = "simple") -> dict:
    """The plain demo graph up to the sampled LATENT (no output node yet)."""
    return {
        LOADER: _node("UNETLoader", unet_name=unet_name, weight_dtype="default"),
        MODEL_CHAIN: _node("ModelSamplingSD3", model=[LOADER, 0], shift=SHIFT),
        POSITIVE: _node("CarnatorDemoTextEncode", text=prompt),
        NEGATIVE: _node("CarnatorDemoTextEncode", text=""),
        LATENT: _node("EmptyHunyuanLatentVideo", batch_size=1, **latent_size(clip)),
        SAMPLER: _node("KSampler", model=[MODEL_CHAIN, 0], seed=seed, steps=steps, cfg=cfg,
                       sampler_name=sampler_name, scheduler=scheduler, positive=[POSITIVE, 0],
                       negative=[NEGATIVE, 0], latent_image=[LATENT, 0], denoise=1.0),
    }


HIGH_NOISE = "high_noise"  # the first expert's KSamplerAdvanced in `two_expert_graph` (SAMPLER is the second's)


def two_expert_graph(unet_name: str, prompt: str, *, seed: int = 0, steps: int = 4, boundary: int = 2,
                     cfg: float = 1.0, low_noise_unet: str | None = None) -> dict:
    """The Wan 2.2 14B template's shape on the demo model: two experts (both the demo model unless
    `low_noise_unet` names another), each loader -> ModelSamplingSD3 -> KSamplerAdvanced; the first samples steps
    0 -> `boundary` and returns the latent with its leftover noise, the second continues without adding noise."""
    graph = base_graph(low_noise_unet or unet_name, prompt, seed=seed, steps=steps, cfg=cfg)
    graph["high_noise_loader"] = _node("UNETLoader", unet_name=unet_name, weight_dtype="default")
    graph["high_noise_sampling"] = _node("ModelSamplingSD3", model=["high_noise_loader", 0], shift=SHIFT)
    shared = dict(noise_seed=seed, steps=steps, cfg=cfg, sampler_name="euler", scheduler="simple",
                  positive=[POSITIVE, 0], negative=[NEGATIVE, 0])
    graph[HIGH_NOISE] = _node("KSamplerAdvanced", model=["high_noise_sampling", 0], add_noise="enable",
                              latent_image=[LATENT, 0], start_at_step=0, end_at_step=boundary,
                              return_with_leftover_noise="enable", **shared)
    graph[SAMPLER] = _node("KSamplerAdvanced", model=[MODEL_CHAIN, 0], add_noise="disable",
                           latent_image=[HIGH_NOISE, 0], start_at_step=boundary, end_at_step=10000,
                           return_with_leftover_noise="disable", **shared)
    return graph


def with_expert_reuse(graph: dict, store_path: str, prompt: str, *, experts: tuple[str, ...] = (HIGH_NOISE, SAMPLER),
                      **options) -> dict:
    """One CarnatorReuse (`carnator_reuse_<sampler>`) in front of each sampler named in `experts` (default both of a
    `two_expert_graph`), sharing one store, plus a report on SAMPLER."""
    graph = with_store(graph, store_path)
    for sampler in experts:
        graph = _splice(graph, f"carnator_reuse_{sampler}",
                        _node("CarnatorReuse", store=[STORE, 0], prompt=prompt, **options), consumer=sampler)
    return with_report(graph)


def _splice(graph: dict, node_id: str, node: dict, consumer: str = SAMPLER) -> dict:
    """Insert a MODEL -> MODEL node between `consumer` (the node that takes the model) and whatever fed its model."""
    graph = copy.deepcopy(graph)
    node = copy.deepcopy(node)
    node["inputs"]["model"] = graph[consumer]["inputs"]["model"]
    graph[node_id] = node
    graph[consumer]["inputs"]["model"] = [node_id, 0]
    return graph


def with_store(graph: dict, path: str, size_limit_gb: float = 1.0) -> dict:
    """A CarnatorStore node (path relative to the ComfyUI base directory)."""
    graph = copy.deepcopy(graph)
    graph[STORE] = _node("CarnatorStore", path=path, size_limit_gb=size_limit_gb)
    return graph


def with_reuse(graph: dict, store_path: str, prompt: str, *, consumer: str = SAMPLER, **options) -> dict:
    """CarnatorReuse (node defaults unless `options` override them) in front of `consumer`, the node that takes the
    model (the sampler; the guider of a SamplerCustomAdvanced graph), plus a report on SAMPLER."""
    graph = _splice(with_store(graph, store_path), "carnator_reuse",
                    _node("CarnatorReuse", store=[STORE, 0], prompt=prompt, **options), consumer)
    return with_report(graph)


def with_easycache(graph: dict, reuse_threshold: float = 0.2, start_percent: float = 0.15,
                   end_percent: float = 0.95) -> dict:
    """ComfyUI's built-in EasyCache (its defaults), verbose so the server log says how many steps it skipped."""
    return _splice(graph, "easycache", _node("EasyCache", reuse_threshold=reuse_threshold,
                                             start_percent=start_percent, end_percent=end_percent, verbose=True))


def with_sparse_attention(graph: dict, source: str = "own", match: list | None = None, **knobs) -> dict:
    """CarnatorSparseAttention in front of the sampler (optionally borrowing from a lookup `match`) plus a report."""
    inputs = {"source": source, **knobs}
    if match is not None:
        inputs["match"] = match
    return with_report(_splice(graph, "sparse_attention", _node("CarnatorSparseAttention", **inputs)))


def with_donor_lookup(graph: dict, store_path: str, donor_prompt: str) -> tuple[dict, list]:
    """A CarnatorCompatibilityLookup fed the conditioning of `donor_prompt`, not the request's own.

    Its match therefore names whatever the store holds for the donor prompt, however unrelated to the request:
    the "arbitrary donor" baseline for sparsity reuse. Returns the graph and the match output to wire in.
    """
    graph = with_store(graph, store_path)
    graph["donor_text"] = _node("CarnatorDemoTextEncode", text=donor_prompt)
    graph["lookup"] = _node("CarnatorCompatibilityLookup", model=graph[SAMPLER]["inputs"]["model"],
                            positive=["donor_text", 0], latent=[LATENT, 0], prompt=donor_prompt,
                            store=[STORE, 0], top_k=1, min_similarity=-1.0)
    return graph, ["lookup", 0]


def with_report(graph: dict) -> dict:
    graph = copy.deepcopy(graph)
    graph[REPORT] = _node("CarnatorReport", samples=[SAMPLER, 0])
    return graph


def with_save_latent(graph: dict, prefix: str) -> dict:
    """SaveLatent into the server's output folder (a safetensors file with key `latent_tensor`)."""
    graph = copy.deepcopy(graph)
    graph[SAVE_LATENT] = _node("SaveLatent", samples=[SAMPLER, 0], filename_prefix=prefix)
    return graph


def with_webp(graph: dict, prefix: str, scale: int = 8, fps: float = 8.0) -> dict:
    """Decode with CarnatorDemoDecode and save an animated WEBP with the stock SaveAnimatedWEBP node."""
    graph = copy.deepcopy(graph)
    graph["decode"] = _node("CarnatorDemoDecode", samples=[SAMPLER, 0], scale=scale)
    graph["save_webp"] = _node("SaveAnimatedWEBP", images=["decode", 0], filename_prefix=prefix, fps=fps,
                               lossless=True, quality=90, method="default")
    return graph

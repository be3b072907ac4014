"""Block-sparse attention patched into real ComfyUI models (tiny Wan, HunyuanVideo, LTX-Video) and its controller."""

from __future__ import annotations

import json

import pytest
import torch
from support.masks import full_mask
from support.t2v_graphs import GRAPHS, SAMPLER

from carnator_core.attention.sparse_attention import SparseAttentionRun, SparseAttentionSettings

# Large enough for several 64-token blocks: Wan/Hunyuan 2 x 16 x 16 = 512 video tokens, LTX 2 x 16 x 16 = 512.
SIZES = {"wan": {"width": 256, "height": 256}, "hunyuan_video": {"width": 256, "height": 256},
         "ltxv": {"width": 512, "height": 512}}
STEPS = 4


def _graph(tiny_models, family: str, **attention) -> dict:
    graph = GRAPHS[family](tiny_models[family].name, steps=STEPS, seed=1, **SIZES[family])
    if attention:
        consumer = "guider" if "guider" in graph else SAMPLER
        upstream = graph[consumer]["inputs"]["model"]
        graph["sparse"] = {"class_type": "CarnatorSparseAttention", "inputs": {
            "model": upstream, "source": "own", "block_size": "64", "tau": 0.9, "min_density": 0.05,
            "max_density": 1.0, "dense_fraction": 0.0, "dense_first_blocks": 0, "dense_last_blocks": 0,
            "refresh_every": 2, "recheck_every": 2, "enter_recall": 0.9, "exit_recall": 0.75, "backend": "auto",
            "dense_above": 1.0, "min_tokens": 0, **attention}}
        graph[consumer]["inputs"]["model"] = ["sparse", 0]
        graph["carnator_report"] = {"class_type": "CarnatorReport", "inputs": {"samples": [SAMPLER, 0]}}
    return graph


def _run(comfy, graph: dict) -> tuple[torch.Tensor, dict | None]:
    comfy.unload_models()
    run = comfy.run_prompt(comfy.complete(graph))
    reports = json.loads(run.output("carnator_report", 1)) if "carnator_report" in graph else [None]
    return run.output(SAMPLER)["samples"], reports[0]


@pytest.mark.parametrize("family", ["wan", "hunyuan_video", "ltxv"])
def test_full_density_equals_the_unpatched_model(comfy, tiny_models, family):
    plain, _ = _run(comfy, _graph(tiny_models, family))
    patched, report = _run(comfy, _graph(tiny_models, family, min_density=1.0))
    summary = report["attention"]
    assert summary["sparse_calls"] > 0 and summary["density"] == pytest.approx(1.0)
    torch.testing.assert_close(patched, plain, rtol=1e-4, atol=1e-4)


def test_wan_cross_attention_is_never_sparsified(comfy, tiny_models):
    _, report = _run(comfy, _graph(tiny_models, "wan", min_density=1.0))
    layers = 2
    # every self-attention call (sparse) has its cross-attention call (dense); cond and uncond may run apart
    summary = report["attention"]
    assert summary["sparse_calls"] == summary["dense_calls"]
    assert summary["sparse_calls"] in (layers * STEPS, 2 * layers * STEPS)


def test_sparse_masks_change_the_result_by_a_bounded_amount(comfy, tiny_models):
    plain, _ = _run(comfy, _graph(tiny_models, "wan"))
    sparse, report = _run(comfy, _graph(tiny_models, "wan", tau=0.5, min_density=0.1, max_density=0.5))
    assert report["attention"]["density"] < 0.6
    relative = float((sparse - plain).norm() / plain.norm())
    assert 0.0 < relative < 0.5, relative


def _controller(**overrides) -> SparseAttentionRun:
    """Every step and block may go sparse, even under full masks (unless `dense_above` is given)."""
    overrides = {"dense_above": 1.0, **overrides}
    settings = SparseAttentionSettings(dense_fraction=0.0, dense_first_blocks=0, dense_last_blocks=0, min_tokens=0,
                                       **overrides)
    return SparseAttentionRun(settings=settings, video_tokens=256, first_frame_tokens=64, num_layers=4, total_steps=10)


def test_controller_leaves_cross_attention_short_sequences_and_dense_steps_alone():
    run = _controller()
    q = torch.randn(2, 4, 256, 64)
    text = torch.randn(2, 4, 77, 64)
    assert run.attend(q, text, text, 4, layer=1, step=5) is None  # cross-attention
    assert run.attend(text, text, text, 4, layer=1, step=5) is None  # text refiner: fewer tokens than the video
    assert run.attend(q, q, q, 4, layer=None, step=5) is None  # block unknown
    late = SparseAttentionRun(settings=SparseAttentionSettings(dense_fraction=0.5, dense_above=1.0, min_tokens=0), video_tokens=256,
                              first_frame_tokens=64, num_layers=4, total_steps=10)
    assert late.attend(q, q, q, 4, layer=1, step=4) is None  # dense first half of the steps
    assert late.attend(q, q, q, 4, layer=0, step=8) is None  # dense first block
    assert late.attend(q, q, q, 4, layer=3, step=8) is None  # dense last block
    assert late.attend(q, q, q, 4, layer=1, step=8) is not None


def test_masks_too_full_to_pay_run_dense():
    q, k, v = (torch.randn(1, 2, 256, 64) for _ in range(3))
    full = _controller(min_density=1.0, dense_above=0.6)
    assert full.attend(q, k, v, 2, layer=1, step=5) is None
    layer = full.summary()["per_layer"]["1"]
    assert layer["density"] == 1.0 and layer["source"].startswith("dense")
    assert 1 in full.own_masks()  # still estimated and recorded for later requests
    sparse = _controller(min_density=0.0, max_density=0.5, dense_above=0.6)
    assert sparse.attend(q, k, v, 2, layer=1, step=5) is not None
    # a donor's full mask is adopted by every head (recall 1.0) but runs dense: not a masks hit
    borrowing = _controller(source="borrowed", dense_above=0.6)
    borrowing.borrowed = {1: full_mask(256, 64, heads=2)}
    assert borrowing.attend(q, k, v, 2, layer=1, step=5) is None
    summary = borrowing.summary()
    assert summary["heads_reuse"] == 2 and summary["borrowed_sparse_calls"] == 0


def test_joint_attention_keeps_text_rows_and_columns_dense():
    run = _controller(min_density=1.0)
    n_text = 40
    q, k, v = (torch.randn(1, 2, 256 + n_text, 64) for _ in range(3))
    out = run.attend(q, k, v, 2, layer=1, step=5)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v), rtol=1e-5, atol=1e-5)
    sparse = _controller(tau=0.3, min_density=0.0, max_density=0.3)
    out = sparse.attend(q, k, v, 2, layer=1, step=5)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    # rows of blocks holding text see every key: the text tokens' outputs are exact
    torch.testing.assert_close(out[:, :, 256:], dense[:, :, 256:], rtol=1e-5, atol=1e-5)


def test_masked_text_keys_are_dropped_not_attended():
    run = _controller(min_density=1.0)
    q, k, v = (torch.randn(1, 2, 300, 64) for _ in range(3))
    valid = torch.ones(300, dtype=torch.bool)
    valid[280:] = False  # padded text tokens
    out = run.attend(q, k, v, 2, layer=1, step=5, key_valid=valid)
    additive = torch.zeros(300)
    additive[~valid] = float("-inf")
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=additive.view(1, 300))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_borrowed_masks_drive_heads_through_hysteresis():
    run = _controller(source="borrowed")
    q, k, v = (torch.randn(1, 2, 256, 64) for _ in range(3))
    assert run.attend(q, k, v, 2, layer=1, step=5) is None  # no donor: dense, own estimate kept for recording
    assert 1 in run.own_masks()
    run.borrowed = {1: full_mask(256, 64, heads=2)}  # covers everything: recall 1.0
    assert run.attend(q, k, v, 2, layer=1, step=6) is not None
    assert run.summary()["heads_reuse"] == 2 and run.summary()["borrowed_sparse_calls"] == 1
    wrong = full_mask(512, 64, heads=2)  # another token grid: ignored, a clean miss
    run.borrowed = {2: wrong}
    assert run.attend(q, k, v, 2, layer=2, step=7) is None


def test_second_request_borrows_the_first_requests_masks(comfy, tiny_models):
    from support.reuse_graphs import with_reuse

    def graph(text: str) -> dict:
        # random weights attend almost uniformly: small masks, and recall thresholds to match
        g = _graph(tiny_models, "wan", source="borrowed", tau=0.5, max_density=0.5, enter_recall=0.4,
                   exit_recall=0.3)
        g["positive"]["inputs"]["text"] = text
        return with_reuse(g, "stores/sparsity-reuse", prompt=text, mode="safe", sparse_attention="off")

    plain, _ = _run(comfy, _graph(tiny_models, "wan"))
    first, first_report = _run(comfy, graph("a red ball rolls left"))
    from carnator_core.reuse.recording import entry_writer

    entry_writer().flush()
    assert torch.equal(first, plain) and not first_report["hit"]  # no donor: dense, masks only estimated
    second, report = _run(comfy, graph("a red ball rolls slowly left"))
    assert report["hit"] and report["heads_reuse"] > 0 and report["skipped_steps"] == 0
    assert report["attention_density"] < 1.0
    assert report["attention"]["head_history"]
    relative = float((second - plain).norm() / plain.norm())
    assert relative < 0.5, relative


def test_dense_calls_chain_to_an_existing_attention_override(comfy, tiny_models):
    """A model already patched by another attention pack (SageAttention-style) keeps that patch for dense calls."""
    calls = []

    def other_pack_override(func, *args, **kwargs):
        calls.append((args[0].shape[1], args[1].shape[1]))  # (query tokens, key tokens)
        return func(*args, **kwargs)

    model = comfy.call_node("UNETLoader", unet_name=tiny_models["wan"].name, weight_dtype="default")[0].clone()
    model.model_options["transformer_options"]["optimized_attention_override"] = other_pack_override
    patched = comfy.call_node(
        "CarnatorSparseAttention", model=model, source="own", block_size="64", tau=0.9, min_density=0.05,
        max_density=1.0, dense_fraction=0.0, dense_first_blocks=0, dense_last_blocks=0, refresh_every=2,
        recheck_every=2, enter_recall=0.9, exit_recall=0.75, backend="auto", dense_above=1.0, min_tokens=0)[0]
    positive = comfy.call_node("HarnessTextConditioning", text="a red ball", family="wan")[0]
    negative = comfy.call_node("HarnessTextConditioning", text="blurry", family="wan")[0]
    latent = comfy.call_node("EmptyHunyuanLatentVideo", width=256, height=256, length=5, batch_size=1)[0]
    comfy.call_node("KSampler", model=patched, seed=0, steps=2, cfg=5.0, sampler_name="euler", scheduler="simple",
                    positive=positive, negative=negative, latent_image=latent, denoise=1.0)
    assert calls, "the existing override was bypassed"
    assert all(queries != keys for queries, keys in calls)  # only cross-attention went dense, through the other pack

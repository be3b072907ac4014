"""The models of current hosts sampled with Carnator in real ComfyUI: Wan 2.2 TI2V 5B (48-channel latent), HunyuanVideo
1.5 (CFG, joint text+video attention) and LTX-2 (audio and video packed into one latent).

Each model is a tiny random-weight file written on first use (`current_model`); a host without the model's config
class skips its tests. On a plain video latent a miss is the plain sampler's output bit for bit and a second request
with the same prompt and seed resumes from the first, LTX-2's packed audio+video latent included (recorded and resumed
whole, its audio judged beside its video).
Block-sparse attention takes video self-attention only: traced call by call, text, audio and audio-video cross
attention stay dense, and the text rows of joint attention are exact.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from collections import Counter

import pytest
import torch
from support.comfy_host import PACK_NAME
from support.latent_files import save_latent, write_retouched_videos
from support.reuse_graphs import with_reuse
from support.t2v_graphs import (
    CURRENT_GRAPHS,
    LTX2_AUDIO_LATENT,
    MODEL,
    SAMPLER,
    STATS,
    hunyuan_video15_sr,
    hunyuan_video15_t2v,
    ltx2_audio_latent_shape,
    ltx2_av_t2v,
    ltxv_t2v,
    wan22_ti2v,
)

from carnator_core.lookup.prompt_text import is_link
from carnator_core.reuse.input_start import GUIDE_NOTE, MAX_INPUT_DISTANCE
from carnator_core.reuse.recording import entry_writer

STEPS = 10
PROMPT = "a red ball rolls left"  # the graphs' default positive text
_stores = itertools.count()


@pytest.fixture
def store_path() -> str:
    return f"stores/current-{next(_stores)}"


@pytest.fixture(scope="module")
def audio_latent(comfy) -> None:
    """The empty LTX-2 audio latent the graphs load (zeros, as LTXVEmptyLatentAudio makes them)."""
    save_latent(comfy.base_dir / "input" / LTX2_AUDIO_LATENT, torch.zeros(ltx2_audio_latent_shape()))


def _pack_module(comfy, name: str):
    return sys.modules[f"{comfy.base_dir / 'custom_nodes' / PACK_NAME}.nodes.{name}"]


def _graph(current_model, family: str, **options) -> dict:
    return CURRENT_GRAPHS[family](current_model(family).name, **{"steps": STEPS, "sampler_name": "euler", **options})


def _sample(comfy, graph: dict) -> tuple[torch.Tensor, list[dict]]:
    """Run a graph from a cold cache: ComfyUI would otherwise serve an identical prompt without sampling."""
    comfy.unload_models()
    run = comfy.run_prompt(comfy.complete(graph))
    reports = json.loads(run.output("carnator_report", 1)) if "carnator_report" in graph else []
    entry_writer().flush()
    return run.output(SAMPLER)["samples"], reports


@pytest.mark.parametrize("family", ["wan22", "hunyuan_video15", "ltxav"])
def test_the_loader_detects_the_models_config_class(comfy, current_model, family):
    tiny = current_model(family)
    model = comfy.call_node("UNETLoader", unet_name=tiny.name, weight_dtype="default")[0]
    assert type(model.model.model_config).__name__ == tiny.spec.model_config_class
    assert model.model.latent_format.latent_channels == tiny.spec.latent_channels


@pytest.mark.parametrize("family", ["wan22", "hunyuan_video15"])
def test_a_plain_video_latent_resumes_from_the_same_prompt_and_seed(comfy, current_model, store_path, family):
    graph = _graph(current_model, family, seed=7)
    plain, _ = _sample(comfy, graph)
    # every clip may run sparse (min_tokens 0), so the override must see its video self-attention
    first, first_reports = _sample(comfy, with_reuse(graph, store_path, prompt=PROMPT, min_tokens=0))
    channels = current_model(family).spec.latent_channels
    assert tuple(first.shape) == (1, channels, 2, 4, 4)  # 64 x 64 x 5 frames, 16x spatial, 4x temporal
    assert not first_reports[0]["hit"] and torch.equal(first, plain)
    attention = first_reports[0]["attention"]
    assert attention["self_attention_calls"] > 0 and not attention["inactive"], attention  # the override sees video

    second, reports = _sample(comfy, with_reuse(graph, store_path, prompt=PROMPT, min_tokens=0))
    report = reports[0]
    assert report["hit"] and report["skipped_steps"] == 5, json.dumps(report)
    assert report["model_calls"] == STEPS - 5 + 1 < first_reports[0]["model_calls"] == STEPS
    # the probe's signals on this latent: same state, same prediction (fp16 checkpoints), CFG guidance compared
    assert report["structure_agreement"] == pytest.approx(1.0, abs=1e-3)
    assert report["guidance_cosine"] == pytest.approx(1.0, abs=1e-2)
    assert float((second - first).norm() / first.norm()) < 2e-3

    store = _pack_module(comfy, "host").store_at(store_path)
    entries = list(store.entry_ids())
    assert len(entries) == 2  # both requests recorded, with checkpoints and a preview of the latent
    for entry_id in entries:
        meta = store.get_meta(entry_id)
        assert tuple(meta.latent_shape) == tuple(first.shape) and "thumb" in meta.blob_bytes
        checkpoints = store.get_tensors(entry_id, "checkpoints")
        assert {tensor.shape[1] for name, tensor in checkpoints.items() if not name.startswith("g_")} == {channels}


def _packed_length(*shapes: tuple[int, ...]) -> int:
    return sum(math.prod(shape[1:]) for shape in shapes)


def test_ltx2_audio_and_video_records_and_resumes_both_parts(comfy, current_model, store_path, audio_latent):
    """The packed audio+video latent is recorded whole and resumed whole; every probe judges the audio as well."""
    graph = _graph(current_model, "ltxav", seed=3, steps=4)
    plain, _ = _sample(comfy, graph)
    first, (first_report,) = _sample(comfy, with_reuse(graph, store_path, prompt=PROMPT))
    assert not first_report["hit"] and first_report["reason"] == "no candidate", json.dumps(first_report)
    assert all(torch.equal(a, b) for a, b in zip(first.unbind(), plain.unbind(), strict=True))  # a miss is plain

    second, (report,) = _sample(comfy, with_reuse(graph, store_path, prompt=PROMPT))
    assert report["hit"] and report["skipped_steps"] == 2 and report["model_calls"] == 3, json.dumps(report)
    assert [probe["step"] for probe in report["probes"]] == [0, 2]  # the step-0 screen, then the resume's probe
    assert report["other_parts_agreement"] == report["probes"][-1]["other_parts_agreement"]  # the resume's audio
    for probe in report["probes"]:  # video and audio each judged, each agreeing with the same prompt's own run
        assert probe["passed"] and probe["structure_agreement"] > 0.99, probe
        assert len(probe["other_parts_agreement"]) == 1 and probe["other_parts_agreement"][0] > 0.99, probe
    video, audio = second.unbind()
    assert tuple(video.shape) == (1, 128, 2, 2, 2) and tuple(audio.shape) == ltx2_audio_latent_shape()
    for part, reference in zip(second.unbind(), plain.unbind(), strict=True):  # fp16 checkpoints
        assert float((part - reference).norm() / reference.norm()) < 2e-3

    store = _pack_module(comfy, "host").store_at(store_path)
    length = _packed_length((1, 128, 2, 2, 2), ltx2_audio_latent_shape())
    for entry_id in store.entry_ids():  # recorded packed, as the sampler sees the latent
        assert tuple(store.get_meta(entry_id).latent_shape) == (1, 1, length)
        states = [t for name, t in store.get_tensors(entry_id, "checkpoints").items() if name.startswith("x_")]
        assert states and all(tuple(t.shape) == (1, 1, length) and bool(torch.isfinite(t).all()) for t in states)


def test_ltx2_rejected_donor_samples_plain_bit_for_bit(comfy, current_model, store_path, audio_latent):
    """A donor the model rejects (here: a structure bar no agreement reaches) leaves the packed run plain bit for bit,
    at plain's model calls: the step-0 screen that rejected it serves the sampler's first call."""
    graph = _graph(current_model, "ltxav", seed=3, steps=4)
    plain, _ = _sample(comfy, graph)
    _sample(comfy, with_reuse(graph, store_path, prompt=PROMPT))
    reused, (report,) = _sample(comfy, with_reuse(graph, store_path, prompt=PROMPT, structure_threshold=1.0))
    assert not report["hit"] and report["model_calls"] == 4, json.dumps(report)
    assert report["probes"] and not any(probe["passed"] for probe in report["probes"]), json.dumps(report)
    assert all(torch.equal(a, b) for a, b in zip(reused.unbind(), plain.unbind(), strict=True))


@pytest.mark.parametrize(("change", "reason"), [("audio_latent", "other token grid"), ("frame_rate", "other frame rate")])
def test_ltx2_donor_with_another_audio_length_or_frame_rate_is_filtered(comfy, current_model, store_path,
                                                                        audio_latent, change, reason):
    """Another audio length is another packed layout, another frame rate another spacing of the same grid in time:
    the donor is never offered, and the run is plain bit for bit."""
    graph = _graph(current_model, "ltxav", seed=3, steps=4)
    _sample(comfy, with_reuse(graph, store_path, prompt=PROMPT))
    if change == "audio_latent":
        longer = "tiny_ltx2_audio_longer.latent"
        save_latent(comfy.base_dir / "input" / longer, torch.zeros(ltx2_audio_latent_shape(length=17)))
        other = _graph(current_model, "ltxav", seed=3, steps=4, audio_latent=longer)
    else:
        other = _graph(current_model, "ltxav", seed=3, steps=4, frame_rate=24.0)
    plain, _ = _sample(comfy, other)
    reused, (report,) = _sample(comfy, with_reuse(other, store_path, prompt=PROMPT))
    assert not report["hit"] and not report["probes"], json.dumps(report)
    assert report["filtered"] == {reason: 1}, json.dumps(report)
    assert all(torch.equal(a, b) for a, b in zip(reused.unbind(), plain.unbind(), strict=True))


def test_a_run_guided_by_an_image_reuses_a_run_guided_by_a_close_image_and_filters_another(comfy, current_model,
                                                                                           store_path):
    """Image-to-video's shape (an empty latent, the image in the conditioning as `concat_latent_image`) on the tiny
    HunyuanVideo 1.5 super-resolution model, whose HunyuanVideo15SuperResolution node puts a low-resolution video into
    the conditioning. A retouched video resumes from the run on the original; another video is filtered by the
    distance of the conditioning images and samples plain, bit for bit; a run guided by text alone is no donor."""
    write_retouched_videos(comfy.base_dir / "input", "sr", (1, 32, 2, 4, 4))  # 64 x 64 x 5 frames, HunyuanVideo 1.5
    model = current_model("hunyuan_video15_sr").name

    def graph(video: str) -> dict:
        graph = hunyuan_video15_sr(model, low_resolution=f"sr_{video}.latent", steps=STEPS, seed=4)
        graph["empty"] = {"class_type": "EmptyHunyuanVideo15Latent",
                          "inputs": {"width": 64, "height": 64, "length": 5, "batch_size": 1}}
        graph[SAMPLER]["inputs"]["latent_image"] = ["empty", 0]
        return graph

    _, (report,) = _sample(comfy, with_reuse(graph("original"), store_path, prompt=PROMPT, sparse_attention="off"))
    assert not report["hit"] and GUIDE_NOTE in report["notes"], json.dumps(report)

    plain, _ = _sample(comfy, graph("retouched"))
    output, (report,) = _sample(comfy, with_reuse(graph("retouched"), store_path, prompt=PROMPT, sparse_attention="off"))
    assert report["hit"] and report["skipped_steps"] == STEPS // 2, json.dumps(report)
    assert output.shape == plain.shape and float((output - plain).norm() / plain.norm()) < 0.05

    plain, _ = _sample(comfy, graph("other"))
    output, (report,) = _sample(comfy, with_reuse(graph("other"), store_path, prompt=PROMPT, sparse_attention="off"))
    assert torch.equal(output, plain) and not report["hit"], json.dumps(report)
    assert report["skipped_donors"] == {f"conditioning image farther than {MAX_INPUT_DISTANCE} from the donor's": 2}

    text_only = hunyuan_video15_t2v(model, steps=STEPS, seed=4, cfg=1.0, shift=2.0)  # the SR model without an image
    _sample(comfy, with_reuse(text_only, store_path, prompt=PROMPT, sparse_attention="off"))
    _, (report,) = _sample(comfy, with_reuse(graph("retouched"), store_path, prompt=PROMPT + " again",
                                             sparse_attention="off"))
    assert report["filtered"].get("not guided by an image", 0) + report["skipped_donors"].get(
        "not guided by an image", 0) == 1, json.dumps(report)


def test_ltx2_packed_shapes_that_do_not_add_up_sample_plain_with_the_reason(comfy):
    host = _pack_module(comfy, "host")
    shapes = [(1, 128, 2, 2, 2), ltx2_audio_latent_shape()]
    noise = torch.zeros(1, 1, _packed_length(*shapes) - 16)
    reason = host.unsupported_latent({"noise": noise, "latent_shapes": shapes})
    assert reason.startswith("packed latent shapes") and f"not {noise.shape[-1]}" in reason, reason
    assert host.unsupported_latent({"noise": torch.zeros(1, 1, _packed_length(*shapes)), "latent_shapes": shapes}) == ""


def test_ltx2_audio_sampled_without_its_video_is_sampled_as_the_host_makes_it(comfy, current_model, store_path,
                                                                              audio_latent):
    """LTX-2's empty audio latent sampled alone reaches the sampler as the host makes it (an empty latent of the
    model's video channels; a non-empty one the host cannot sample at all): a miss is the plain output bit for bit,
    in plain's shape, and the same request again resumes it like any video latent."""
    graph = _graph(current_model, "ltxav", seed=3, steps=4)
    graph[SAMPLER]["inputs"]["latent_image"] = ["audio_latent", 0]
    for node_id in ("av_latent", "separate"):
        graph.pop(node_id)
    graph[STATS]["inputs"]["latent"] = [SAMPLER, 0]
    plain, _ = _sample(comfy, graph)
    first, (report,) = _sample(comfy, with_reuse(graph, store_path, prompt=PROMPT))
    assert not report["hit"] and torch.equal(first, plain), json.dumps(report)
    second, (report,) = _sample(comfy, with_reuse(graph, store_path, prompt=PROMPT))
    assert report["hit"] and second.shape == plain.shape, json.dumps(report)


def test_ltx2_through_the_reuse_sampler_records_and_resumes_the_same(comfy, current_model, store_path, audio_latent):
    """CarnatorReuseSampler (SamplerCustom's SAMPLER input) opens its run as the model wrapper does: the packed
    latent is recorded on the first request, plain bit for bit, and resumed on the second."""
    from carnator_core.demo.graphs import STORE, with_report, with_store

    graph = _graph(current_model, "ltxav", seed=3, steps=4)
    plain, _ = _sample(comfy, graph)
    graph = with_store(graph, store_path)
    graph["reuse_sampler"] = {"class_type": "CarnatorReuseSampler", "inputs": {  # otherwise the node's defaults
        "sampler": ["ksampler_select", 0], "store": [STORE, 0], "prompt": PROMPT,
        "exact_repeats": False}}  # the resume of an identical request is what this measures
    graph[SAMPLER]["inputs"]["sampler"] = ["reuse_sampler", 0]
    graph = with_report(graph)
    first, (report,) = _sample(comfy, graph)
    assert not report["hit"] and report["model_calls"] == 4, json.dumps(report)
    assert all(torch.equal(a, b) for a, b in zip(first.unbind(), plain.unbind(), strict=True))
    _, (report,) = _sample(comfy, graph)
    assert report["hit"] and report["skipped_steps"] == 2, json.dumps(report)


# Every video self-attention call may go sparse: no dense steps or edge blocks, own masks at most half full.
SPARSE_EVERYWHERE = {
    "source": "own", "block_size": "64", "tau": 0.5, "min_density": 0.1, "max_density": 0.5, "dense_fraction": 0.0,
    "dense_first_blocks": 0, "dense_last_blocks": 0, "refresh_every": 2, "recheck_every": 2, "enter_recall": 0.9,
    "exit_recall": 0.75, "backend": "auto", "dense_above": 1.0, "min_tokens": 0,
}


class AttentionTrace:
    """Every attention call of a run as Carnator's override handles it: (query tokens, key tokens) -> how many went
    sparse and dense. With `joint`, also the largest error against dense attention of the text rows of joint
    text+video calls that went sparse (the text is what lies outside the `img_slice` ComfyUI hands attention
    patches)."""

    def __init__(self, override, joint: bool) -> None:
        self.override = override
        self.joint = joint
        self.calls: Counter[tuple[int, int, bool]] = Counter()
        self.image_slice: list[int] | None = None
        self.text_row_error = 0.0

    def patch(self, model):
        """`model` (already through CarnatorSparseAttention) with its override traced: a sampling wrapper inside
        Carnator's puts the trace in front of the override the run samples with."""
        import comfy.patcher_extension

        model = model.clone()
        model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, "carnator_test_trace",
                                   self._trace_run)
        if self.joint:
            model.set_model_attn1_patch(self._note_image_slice)
        return model

    def _trace_run(self, executor, *args, **kwargs):
        options = executor.class_obj.model_options["transformer_options"]
        self.override = options.get("optimized_attention_override") or self.override
        options["optimized_attention_override"] = self
        try:
            return executor(*args, **kwargs)
        finally:
            options["optimized_attention_override"] = self.override

    def __deepcopy__(self, memo: dict) -> AttentionTrace:
        return self  # hosts whose model clones deep-copy the model options: every clone records here

    def _note_image_slice(self, q, k, v, extra_options, **_) -> dict:
        self.image_slice = extra_options["img_slice"]
        return {}

    def __call__(self, func, *args, **kwargs):
        dense = []

        def traced(*a, **k):
            dense.append(True)
            return func(*a, **k)

        out = self.override(traced, *args, **kwargs)
        q, k, v = args[:3]
        axis = 2 if kwargs.get("skip_reshape", False) else 1
        self.calls[(q.shape[axis], k.shape[axis], not dense)] += 1
        if self.joint and not dense and self.image_slice is not None and self.image_slice[1] == q.shape[axis]:
            start, end = self.image_slice
            text = torch.cat([torch.arange(start), torch.arange(end, q.shape[2])])
            reference = torch.nn.functional.scaled_dot_product_attention(q, k, v)[:, :, text]
            rows = out.view(q.shape[0], q.shape[2], q.shape[1], -1).transpose(1, 2)[:, :, text]
            self.text_row_error = max(self.text_row_error, float((rows - reference).abs().max()))
        return out

    def by_kind(self, kinds: dict[tuple[int, int], str]) -> dict[str, tuple[int, int]]:
        """kind -> (sparse calls, dense calls), naming each (query, key) token count by `kinds`."""
        counts: dict[str, list[int]] = {}
        for (queries, keys, sparse), n in self.calls.items():
            counts.setdefault(kinds[(queries, keys)], [0, 0])[0 if sparse else 1] += n
        return {kind: (sparse, dense) for kind, (sparse, dense) in counts.items()}


def _traced_sample(comfy, graph: dict, trace: AttentionTrace) -> None:
    """Sample `graph` node by node (call_node, under inference mode as ComfyUI's executor runs nodes), its model
    through CarnatorSparseAttention and `trace`."""
    outputs: dict[str, object] = {}

    def output(node_id: str):
        if node_id not in outputs:
            node = graph[node_id]
            inputs = {name: output(value[0])[value[1]] if is_link(value) else value
                      for name, value in node["inputs"].items()}
            result = comfy.call_node(node["class_type"], **inputs)
            if node_id == MODEL:
                result = (trace.patch(comfy.call_node("CarnatorSparseAttention", model=result[0],
                                                      **SPARSE_EVERYWHERE)[0]),)
            outputs[node_id] = result
        return outputs[node_id]

    with torch.inference_mode():
        output(SAMPLER)


def _kinds(video: int, audio: int, joint: bool) -> dict[tuple[int, int], str]:
    """(query, key) token counts -> kind of attention, for the graphs' positive (5 words) and negative (1) texts."""
    kinds = {(video, video): "video self"}
    for text in (5, 1):
        if joint:  # HunyuanVideo: the token refiner's text self-attention, then text and video attended together
            kinds |= {(text, text): "text self", (text + video, text + video): "joint text+video"}
        else:
            kinds |= {(video, text): "video-text"} | ({(audio, text): "audio-text"} if audio else {})
    if audio:
        kinds |= {(audio, audio): "audio self", (video, audio): "audio-to-video", (audio, video): "video-to-audio"}
    return kinds


# model, graph, its size, video tokens, audio tokens, expected (sparse, dense) calls per kind (2 steps, 2 blocks,
# cond and uncond apart)
TRACES = {
    "wan22": ("wan22", wan22_ti2v, {"width": 512, "height": 512}, 2 * 16 * 16, 0,
              {"video self": (8, 0), "video-text": (0, 8)}),
    "hunyuan_video15": ("hunyuan_video15", hunyuan_video15_t2v, {"width": 256, "height": 256}, 2 * 16 * 16, 0,
                        {"joint text+video": (8, 0), "text self": (0, 8)}),
    # LTX-2 on a video latent alone: its audio stream is empty and never attends
    "ltxav-video": ("ltxav", ltxv_t2v, {"width": 512, "height": 512}, 2 * 16 * 16, 0,
                    {"video self": (8, 0), "video-text": (0, 8)}),
    # packed audio+video: the video's self-attention goes sparse, the audio's and every cross-attention stay dense
    "ltxav-audio+video": ("ltxav", ltx2_av_t2v, {"width": 512, "height": 512}, 2 * 16 * 16, 9,
                          {"video self": (8, 0), "video-text": (0, 8), "audio self": (0, 8), "audio-text": (0, 8),
                           "audio-to-video": (0, 8), "video-to-audio": (0, 8)}),
    # at 64 x 64 the audio has more positions (9 x 16) than the video has tokens (8): no call goes sparse
    "ltxav-audio+video-small": ("ltxav", ltx2_av_t2v, {}, 2 * 2 * 2, 9,
                                {"video self": (0, 8), "video-text": (0, 8), "audio self": (0, 8), "audio-text": (0, 8),
                                 "audio-to-video": (0, 8), "video-to-audio": (0, 8)}),
}


@pytest.mark.parametrize("case", list(TRACES))
def test_sparse_attention_takes_video_self_attention_only(comfy, current_model, audio_latent, case):
    family, graph, size, video, audio, expected = TRACES[case]
    joint = "joint text+video" in expected
    trace = AttentionTrace(_pack_module(comfy, "attention_hooks").carnator_attention_override, joint)
    _traced_sample(comfy, graph(current_model(family).name, steps=2, seed=1, **size), trace)
    assert trace.by_kind(_kinds(video, audio, joint)) == expected
    if joint:
        assert trace.image_slice is not None and trace.text_row_error < 1e-5, trace.text_row_error

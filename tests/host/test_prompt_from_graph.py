"""Reuse nodes with an empty `prompt` read the positive prompt from the queued graph (demo model, real ComfyUI).

ComfyUI's own CLIPTextEncode, PrimitiveStringMultiline and ConditioningCombine run here; the CLIP they take is a
stand-in that encodes with the demo model's text encoder (there is no text encoder at test size).
"""

from __future__ import annotations

import itertools
import json

import pytest

from carnator_core.demo.graphs import NEGATIVE, POSITIVE, REPORT, SAMPLER, base_graph, with_reuse
from carnator_core.demo.text import encode_prompts
from carnator_core.reuse.recording import entry_writer
from carnator_core.store.http_api import list_entries
from carnator_core.store.reuse_store import ReuseStore

DEMO_WEIGHTS = "carnator_demo_wan21_t2v.safetensors"
TEXT = "a red circle moving left on a black background"
EDITED = "a blue square moving right on a black background"
_stores = itertools.count()


class _DemoClip:
    """What CLIPTextEncode asks of a CLIP, answered by the demo text encoder."""

    def tokenize(self, text: str) -> str:
        return text

    def encode_from_tokens_scheduled(self, tokens: str) -> list:
        return [[encode_prompts([tokens]), {}]]


class PromptTestDemoClip:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load"
    CATEGORY = "testing"

    def load(self):
        return (_DemoClip(),)


@pytest.fixture(scope="module", autouse=True)
def demo_clip(comfy):
    comfy.node_classes["PromptTestDemoClip"] = PromptTestDemoClip
    yield
    del comfy.node_classes["PromptTestDemoClip"]


def _node(class_type: str, **inputs) -> dict:
    return {"class_type": class_type, "inputs": inputs}


def _graph(text: str = TEXT) -> tuple[dict, str]:
    """The demo graph with CarnatorReuse (prompt empty) and CLIPTextEncode on the stand-in CLIP."""
    store = f"stores/prompt-from-graph-{next(_stores)}"
    graph = with_reuse(base_graph(DEMO_WEIGHTS, "", seed=5, steps=4), store, "", sparse_attention="off")
    graph["clip"] = _node("PromptTestDemoClip")
    graph[POSITIVE] = _node("CLIPTextEncode", text=text, clip=["clip", 0])
    graph[NEGATIVE] = _node("CLIPTextEncode", text="", clip=["clip", 0])
    return graph, store


def _run(comfy, graph: dict) -> dict:
    run = comfy.run_prompt(comfy.complete(graph))  # a completed copy: a fresh prompt, as every queue is
    entry_writer().flush()
    (report,) = json.loads(run.output(REPORT, 1))
    return report


def _listed(comfy, store: str) -> list[str]:
    """The prompts the store panel lists, newest first."""
    listing = list_entries(ReuseStore(str(comfy.base_dir / store)), "", 0, 10, "")
    return [entry["prompt"] for entry in listing["entries"]]


def test_text_of_clip_text_encode_and_a_new_text_on_the_next_queue(comfy):
    comfy.unload_models()
    graph, store = _graph()
    report = _run(comfy, graph)
    assert report["notes"][0] == f"prompt text read from the graph (node {POSITIVE} CLIPTextEncode): {TEXT!r}"
    assert _listed(comfy, store) == [TEXT]
    # the edited text alone changes: CarnatorReuse's inputs do not, yet it must not keep the old text
    graph[POSITIVE]["inputs"]["text"] = EDITED
    report = _run(comfy, graph)
    assert report["notes"][0] == f"prompt text read from the graph (node {POSITIVE} CLIPTextEncode): {EDITED!r}"
    assert _listed(comfy, store) == [EDITED, TEXT]


def test_text_of_a_primitive_and_a_combine_inside_an_expanded_subgraph(comfy):
    """A subgraph as the frontend queues it: its nodes flattened into ids "57:n", CarnatorReuse inside another."""
    comfy.unload_models()
    graph, store = _graph()
    graph["57:4"] = _node("PrimitiveStringMultiline", value=TEXT)
    graph["57:5"] = _node("CLIPTextEncode", text=["57:4", 0], clip=["clip", 0])
    graph["57:6"] = _node("CLIPTextEncode", text="slowly", clip=["clip", 0])
    graph["57:7"] = _node("ConditioningCombine", conditioning_1=["57:5", 0], conditioning_2=["57:6", 0])
    graph["60:1"] = graph.pop("carnator_reuse")
    graph[SAMPLER]["inputs"].update(model=["60:1", 0], positive=["57:7", 0])
    del graph[POSITIVE]
    report = _run(comfy, graph)
    assert report["notes"][0] == ("prompt text read from the graph (nodes 57:5 CLIPTextEncode, 57:6 CLIPTextEncode, "
                                  f"joined): {TEXT + ' slowly'!r}")
    assert _listed(comfy, store) == [f"{TEXT} slowly"]


def test_carnator_ksampler_and_reuse_sampler_read_it_too(comfy):
    comfy.unload_models()
    graph, store = _graph()
    reuse = graph.pop("carnator_reuse")
    graph[SAMPLER] = _node("CarnatorKSampler", **{**graph[SAMPLER]["inputs"], **reuse["inputs"],
                                                  "model": reuse["inputs"]["model"]})
    assert _run(comfy, graph)["notes"][0].startswith(f"prompt text read from the graph (node {POSITIVE} ")
    assert _listed(comfy, store) == [TEXT]

    comfy.unload_models()
    graph, store = _graph(EDITED)
    reuse = graph.pop("carnator_reuse")
    options = {name: value for name, value in reuse["inputs"].items()
               if name not in ("model", "sparse_attention", "enter_recall", "exit_recall")}
    plain, model = graph[SAMPLER]["inputs"], reuse["inputs"]["model"]
    graph["select"] = _node("KSamplerSelect", sampler_name="euler")
    graph["wrap"] = _node("CarnatorReuseSampler", sampler=["select", 0], **options)
    graph["sigmas"] = _node("BasicScheduler", model=model, scheduler="simple", steps=4, denoise=1.0)
    graph[SAMPLER] = _node("SamplerCustom", model=model, add_noise=True, noise_seed=5, cfg=1.0,
                           positive=plain["positive"], negative=plain["negative"], sampler=["wrap", 0],
                           sigmas=["sigmas", 0], latent_image=plain["latent_image"])
    assert _run(comfy, graph)["notes"][0].startswith(f"prompt text read from the graph (node {POSITIVE} ")
    assert _listed(comfy, store) == [EDITED]


def test_a_text_built_at_run_time_is_matched_on_conditioning_only(comfy):
    comfy.unload_models()
    graph, store = _graph()
    graph["edit"] = _node("StringReplace", string=TEXT, find="red", replace="green")
    graph[POSITIVE]["inputs"]["text"] = ["edit", 0]
    report = _run(comfy, graph)
    assert report["notes"][0] == (f"prompt text not found in the graph (the text of node {POSITIVE} CLIPTextEncode "
                                  "comes from node edit StringReplace, which Carnator cannot read before it runs): "
                                  "matched on conditioning only")
    assert not any(note.startswith("no prompt text given") for note in report["notes"])
    assert _listed(comfy, store) == [""]

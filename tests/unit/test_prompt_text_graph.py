"""The prompt text a reuse node reads from the queued graph when its `prompt` input is empty (API-format graphs), and
where the batch runner writes each prompt: the same search, so both take the same text for the prompt."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch

from carnator_core.lookup.compatible import Match
from carnator_core.lookup.prompt_text import (
    MAX_NODES,
    PromptText,
    find_prompt_text,
    find_text_inputs,
    is_link,
    link_source,
    text_node_inputs,
)
from carnator_core.queue import Workflow, WorkflowError
from carnator_core.reuse.run import ReuseRun
from carnator_core.reuse.settings import ReuseSettings
from carnator_core.store.entry import HardKey
from carnator_core.store.reuse_store import ReuseStore

WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows" / "api"
CARNATOR_SAMPLING = ("CarnatorReuse", "CarnatorKSampler", "CarnatorReuseSampler")
NOT_FOUND = "matched on conditioning only"
TEXT = "a fox running through fresh snow"


def _node(class_type: str, **inputs) -> dict:
    return {"class_type": class_type, "inputs": inputs}


def _encode(text, clip: str = "clip") -> dict:
    return _node("CLIPTextEncode", text=text, clip=[clip, 0])


def _wan(positive=None, **extra) -> dict:
    """The Wan 2.1 template: UNETLoader -> ModelSamplingSD3 -> CarnatorReuse -> KSampler."""
    graph = {
        "clip": _node("CLIPLoader", clip_name="umt5.safetensors", type="wan"),
        "unet": _node("UNETLoader", unet_name="wan.safetensors", weight_dtype="default"),
        "shift": _node("ModelSamplingSD3", model=["unet", 0], shift=8.0),
        "reuse": _node("CarnatorReuse", model=["shift", 0], prompt="", mode="balanced"),
        "pos": _encode(TEXT),
        "neg": _encode("blurry, static"),
        "latent": _node("EmptyHunyuanLatentVideo", width=832, height=480, length=33, batch_size=1),
        "sampler": _node("KSampler", model=["reuse", 0], seed=1, steps=20, cfg=6.0, sampler_name="uni_pc",
                         scheduler="simple", positive=[positive or "pos", 0], negative=["neg", 0],
                         latent_image=["latent", 0], denoise=1.0),
    }
    graph.update(extra)
    return graph


def _found(graph: dict, node_id: str = "reuse") -> PromptText:
    result = find_prompt_text(graph, node_id)
    assert result.found, result.note
    assert result.note.startswith("prompt text read from the graph")
    return result


def _not_found(graph, node_id="reuse") -> str:
    result = find_prompt_text(graph, node_id)
    assert result.text == "" and not result.found and result.sources == ()
    assert result.note.startswith("prompt text not found in the graph") and result.note.endswith(NOT_FOUND)
    return result.note


# ---------------------------------------------------------------------- found


def test_clip_text_encode_literal():
    result = _found(_wan())
    assert result.text == TEXT and result.sources == ("pos",) and result.locations == (("pos", "text"),)
    assert result.note == f"prompt text read from the graph (node pos CLIPTextEncode): {TEXT!r}"


def test_text_of_a_primitive_string_node():
    graph = _wan(text=_node("PrimitiveStringMultiline", value=TEXT))
    graph["pos"]["inputs"]["text"] = ["text", 0]
    assert _found(graph).text == TEXT and _found(graph).locations == (("text", "value"),)
    graph["text"] = _node("PrimitiveString", value=["outer", 0])  # a primitive fed by another pack's value node
    graph["outer"] = _node("Text Multiline", text=TEXT)
    assert _found(graph).text == TEXT and _found(graph).locations == (("outer", "text"),)


def test_text_of_a_string_concatenation():
    graph = _wan(a=_node("PrimitiveString", value="a fox"), b=_node("PrimitiveStringMultiline", value="in snow"),
                 join=_node("StringConcatenate", string_a=["a", 0], string_b=["b", 0], delimiter=", "))
    graph["pos"]["inputs"]["text"] = ["join", 0]
    assert _found(graph).text == "a fox, in snow"
    assert _found(graph).locations == (("a", "value"), ("join", "delimiter"), ("b", "value"))


def test_conditioning_combine_joins_both_texts_in_input_order():
    graph = _wan(positive="combine", subject=_encode("a fox"), scene=_encode("fresh snow, morning light"),
                 combine=_node("ConditioningCombine", conditioning_1=["subject", 0], conditioning_2=["scene", 0]))
    result = _found(graph)
    assert result.text == "a fox fresh snow, morning light" and result.sources == ("subject", "scene")
    assert result.locations == (("subject", "text"), ("scene", "text"))
    assert "nodes subject CLIPTextEncode, scene CLIPTextEncode, joined" in result.note


def test_conditioning_nodes_on_the_way_are_followed():
    graph = _wan(positive="area", twice=_node("ConditioningConcat", conditioning_to=["pos", 0],
                                              conditioning_from=["pos", 0]),
                 range=_node("ConditioningSetTimestepRange", conditioning=["twice", 0], start=0.0, end=1.0),
                 area=_node("ConditioningSetAreaPercentage", conditioning=["range", 0], width=1.0, height=1.0,
                            x=0.0, y=0.0, strength=1.0))
    assert _found(graph).text == TEXT  # one encoder reached twice is one text


def test_encoders_of_current_models_and_their_preferred_text():
    for encoder, expected in (
        (_node("TextEncodeHunyuanVideo_ImageToVideo", clip=["clip", 0], clip_vision_output=["vision", 0],
               prompt=TEXT, image_interleave=2), TEXT),
        (_node("TextEncodeQwenImageEdit", clip=["clip", 0], prompt=TEXT, vae=["vae", 0]), TEXT),
        (_node("CLIPTextEncodeFlux", clip=["clip", 0], clip_l="fox", t5xxl=TEXT, guidance=3.5), TEXT),
        (_node("CLIPTextEncodeSD3", clip=["clip", 0], clip_l="", clip_g="", t5xxl=TEXT, empty_padding="none"), TEXT),
        (_node("CLIPTextEncodeSDXL", clip=["clip", 0], text_g=TEXT, text_l="fox", width=1024, height=1024), TEXT),
        (_node("CLIPTextEncodeHunyuanDiT", clip=["clip", 0], bert="fox", mt5xl=TEXT), TEXT),
        (_node("CLIPTextEncodeLumina2", clip=["clip", 0], system_prompt="superior", user_prompt=TEXT), TEXT),
        (_node("CLIPTextEncodeFlux", clip=["clip", 0], clip_l=TEXT, t5xxl=""), TEXT),  # one filled: that one
        (_node("CarnatorDemoTextEncode", text=TEXT), TEXT),
    ):
        assert _found(_wan(pos=encoder)).text == expected, encoder["class_type"]


def test_expanded_subgraph_nodes():
    """A frontend subgraph is flattened into ids "outer:inner"; links cross its boundary directly."""
    graph = _wan()
    graph["pos"] = _encode(["57:4", 0])
    graph["57:4"] = _node("PrimitiveStringMultiline", value=TEXT)
    graph["57:12"] = _node("ConditioningCombine", conditioning_1=["pos", 0], conditioning_2=["57:13", 0])
    graph["57:13"] = _encode(TEXT)
    graph["60:2"] = graph.pop("reuse")
    graph["60:3"] = _node("LoraLoaderModelOnly", model=["60:2", 0], lora_name="l.safetensors", strength_model=1.0)
    graph["sampler"]["inputs"].update(model=["60:3", 0], positive=["57:12", 0])
    result = _found(graph, "60:2")
    assert result.text == TEXT and result.sources == ("pos", "57:13")


def test_wan22_two_experts_share_one_encoder():
    """The Wan 2.2 14B template: two experts, UNETLoader -> ModelSamplingSD3 -> CarnatorReuse -> KSamplerAdvanced,
    both sampling on one positive CLIPTextEncode."""
    graph = _wan()
    del graph["sampler"]
    for expert in ("high", "low"):
        graph[f"{expert}_unet"] = _node("UNETLoader", unet_name=f"{expert}.safetensors", weight_dtype="default")
        graph[f"{expert}_shift"] = _node("ModelSamplingSD3", model=[f"{expert}_unet", 0], shift=5.0)
        graph[f"{expert}_reuse"] = _node("CarnatorReuse", model=[f"{expert}_shift", 0], prompt="")
        graph[f"{expert}_sampler"] = _node("KSamplerAdvanced", model=[f"{expert}_reuse", 0], positive=["pos", 0],
                                           negative=["neg", 0], latent_image=["latent", 0] if expert == "high"
                                           else ["high_sampler", 0], add_noise="enable", noise_seed=1, steps=4)
    for expert in ("high", "low"):
        assert _found(graph, f"{expert}_reuse").text == TEXT


def test_one_node_feeding_two_samplers():
    graph = _wan(second=_node("KSampler", model=["reuse", 0], positive=["pos", 0], negative=["neg", 0],
                              latent_image=["sampler", 0]))
    assert _found(graph).text == TEXT
    graph["other"] = _encode("a cat asleep")
    graph["second"]["inputs"]["positive"] = ["other", 0]
    assert "samplers sampler KSampler, second KSampler have different prompts" in _not_found(graph)


def test_sampler_custom_advanced_with_guiders():
    graph = _wan()
    sampler = graph.pop("sampler")
    graph.update(
        guider=_node("CFGGuider", model=["reuse", 0], positive=["pos", 0], negative=["neg", 0], cfg=6.0),
        select=_node("KSamplerSelect", sampler_name="euler"),
        scheduler=_node("BasicScheduler", model=["reuse", 0], scheduler="simple", steps=20, denoise=1.0),
        noise=_node("RandomNoise", noise_seed=1),
        sampler=_node("SamplerCustomAdvanced", noise=["noise", 0], guider=["guider", 0], sampler=["select", 0],
                      sigmas=["scheduler", 0], latent_image=sampler["inputs"]["latent_image"]),
    )
    assert _found(graph).text == TEXT
    # HunyuanVideo: BasicGuider on FluxGuidance, and the SAMPLER wrapped by CarnatorReuseSampler
    graph["guider"] = _node("BasicGuider", model=["shift", 0], conditioning=["flux", 0])
    graph["flux"] = _node("FluxGuidance", conditioning=["pos", 0], guidance=6.0)
    graph["wrap"] = _node("CarnatorReuseSampler", sampler=["select", 0], prompt="")
    graph["sampler"]["inputs"]["sampler"] = ["wrap", 0]
    assert _found(graph, "wrap").text == TEXT


def test_carnator_ksampler_and_reuse_sampler_into_sampler_custom():
    graph = _wan()
    graph["sampler"]["class_type"] = "CarnatorKSampler"
    graph["sampler"]["inputs"].update(model=["shift", 0], prompt="")
    assert _found(graph, "sampler").text == TEXT
    graph["select"] = _node("KSamplerSelect", sampler_name="euler")
    graph["wrap"] = _node("CarnatorReuseSampler", sampler=["select", 0], prompt="")
    graph["custom"] = _node("SamplerCustom", model=["shift", 0], add_noise=True, noise_seed=1, cfg=3.0,
                            positive=["pos", 0], negative=["neg", 0], sampler=["wrap", 0], sigmas=["sigmas", 0],
                            latent_image=["latent", 0])
    assert _found(graph, "wrap").text == TEXT


def test_ltxv_conditioning_follows_the_output_taken():
    """LTXVConditioning passes positive and negative through as outputs 0 and 1: only the positive is the prompt."""
    graph = _wan(positive="ltxv", ltxv=_node("LTXVConditioning", positive=["pos", 0], negative=["neg", 0],
                                             frame_rate=25.0))
    graph["sampler"]["inputs"]["negative"] = ["ltxv", 1]
    assert _found(graph).text == TEXT
    graph["sampler"]["inputs"]["positive"] = ["ltxv", 1]  # a graph that samples on the negative text
    assert _found(graph).text == "blurry, static"
    # LTX-2: the upscale stage's guider takes LTXVCropGuides' positive, fed by the LTXVConditioning
    graph["crop"] = _node("LTXVCropGuides", positive=["ltxv", 0], negative=["ltxv", 1], latent=["latent", 0])
    graph["sampler"]["inputs"].update(positive=["crop", 0], negative=["crop", 1])
    assert _found(graph).text == TEXT


def test_a_lora_loader_with_clip_passes_the_model_on():
    graph = _wan(lora=_node("LoraLoader", model=["reuse", 0], clip=["clip", 0], lora_name="l.safetensors",
                            strength_model=1.0, strength_clip=1.0))
    graph["pos"]["inputs"]["clip"] = ["lora", 1]
    graph["sampler"]["inputs"]["model"] = ["lora", 0]
    assert _found(graph).text == TEXT


# ---------------------------------------------------------------------- not found: conditioning only


@pytest.mark.parametrize("change, reason", [
    (lambda g: g.update(pos=_encode(["builder", 0]),
                        builder=_node("CustomPromptBuilder", subject="fox", style="photo", seed=3)),
     "the text of node pos CLIPTextEncode comes from node builder CustomPromptBuilder, which Carnator cannot read"),
    (lambda g: g.update(pos=_node("CustomConditioning", model_name="x", subject="fox")),
     "the conditioning comes from node pos CustomConditioning, which holds no prompt text"),
    (lambda g: g.update(pos=_encode(["a fox", "a cat"])), "the text of node pos CLIPTextEncode is a list"),
    (lambda g: g.update(pos=_encode(["gen", 0]), gen=_node("TextGenerate", clip=["clip", 0], prompt="describe")),
     "comes from node gen TextGenerate, which Carnator cannot read before it runs"),
    (lambda g: g.update(pos=_encode(["gone", 0])), "node gone is missing or malformed"),
    (lambda g: g["sampler"]["inputs"].update(positive=["gone", 0]), "node gone is missing or malformed"),
    (lambda g: g.update(pos=_encode("  ")), "the positive prompt's text is empty"),
    (lambda g: g["sampler"]["inputs"].update(model=["shift", 0]), "no sampler found downstream of node reuse"),
    (lambda g: g.update(pos=_node("CLIPTextEncode", text=TEXT, clip=None)), "holds no prompt text"),
])
def test_text_that_cannot_be_read_for_certain(change, reason):
    graph = _wan()
    change(graph)
    assert reason in _not_found(graph)


def test_cycles_end():
    graph = _wan(loop=_node("ConditioningCombine", conditioning_1=["loop", 0], conditioning_2=["pos", 0]))
    graph["sampler"]["inputs"]["positive"] = ["loop", 0]
    assert _found(graph).text == TEXT  # the cycle adds nothing; the encoder on it is read
    graph["loop"]["inputs"]["conditioning_2"] = ["loop", 0]
    assert "no text encoder upstream of the positive conditioning" in _not_found(graph)  # nothing but itself
    graph = _wan(a=_node("ModelSamplingSD3", model=["b", 0]), b=_node("ModelSamplingSD3", model=["a", 0]))
    graph["reuse"]["inputs"]["model"] = ["a", 0]
    graph["a"]["inputs"]["model"] = ["reuse", 0]
    graph["sampler"]["inputs"]["model"] = ["b", 0]
    assert _found(graph).text == TEXT
    graph = _wan(text=_node("PrimitiveString", value=["text", 0]))  # a string fed by itself
    graph["pos"]["inputs"]["text"] = ["text", 0]
    assert "linked too deep" in _not_found(graph)


def test_hostile_graphs_never_raise():
    for graph, node_id in [(None, "reuse"), ([], "reuse"), ("graph", "reuse"), ({}, "reuse"), (_wan(), None),
                           (_wan(), ["reuse", 0]), ({"reuse": "CarnatorReuse"}, "reuse"),
                           ({"reuse": {"class_type": 3, "inputs": {}}}, "reuse"),
                           ({"reuse": {"class_type": "CarnatorReuse", "inputs": []}}, "reuse")]:
        _not_found(graph, node_id)
    chain = {str(i): _node("ModelSamplingSD3", model=[str(i - 1), 0]) for i in range(1, MAX_NODES + 10)}
    chain["0"] = _node("CarnatorReuse", prompt="")
    assert "graph too large" in _not_found(chain, "0")
    rng = random.Random(0)
    garbage = [None, 3, 2.5, True, "x", [], ["pos"], ["pos", "0"], ["pos", -1], ["pos", 7], ["nowhere", 0], [1, 0],
               {"a": 1}, ["reuse", 0], ["sampler", 0], ["pos", 0.0], [["pos", 0], 0]]
    for _ in range(2000):
        graph = _wan(positive="combine", combine=_node("ConditioningCombine", conditioning_1=["pos", 0],
                                                       conditioning_2=["neg", 0]))
        for _ in range(rng.randint(1, 4)):
            node = graph[rng.choice(list(graph))]
            name = rng.choice(list(node["inputs"]) + ["text", "clip", "guider", "positive"])
            node["inputs"][name] = rng.choice(garbage)
        result = find_prompt_text(graph, rng.choice(["reuse", "sampler", "pos", "missing"]))
        assert isinstance(result, PromptText) and isinstance(result.text, str) and result.note


# ---------------------------------------------------------------------- the shipped workflows


def _upstream(graph: dict, link: list) -> set[str]:
    """Every node a link depends on; through a node passing positive and negative on as outputs 0 and 1, only the
    side taken."""
    followed, pending = set(), [tuple(link)]
    while pending:
        node_id, output = link = pending.pop()
        if link in followed:
            continue
        followed.add(link)
        links = {name: value for name, value in graph[node_id]["inputs"].items()
                 if is_link(value)}
        if {"positive", "negative"} <= set(links) and output in (0, 1):
            links = {("positive", "negative")[output]: links[("positive", "negative")[output]]}
        pending += [tuple(value) for value in links.values()]
    return {node_id for node_id, _ in followed}


def _shipped_positive_encoder(graph: dict) -> str:
    """The one encoder on the sampler's positive side and on no negative side."""
    positive, negative = set(), set()
    for node in graph.values():
        for name, value in node["inputs"].items():
            if name in ("positive", "conditioning") and is_link(value):
                positive |= _upstream(graph, value)
            elif name == "negative" and is_link(value):
                negative |= _upstream(graph, value)
    encoders = [i for i in positive - negative if graph[i]["class_type"] in ("CLIPTextEncode", "CarnatorDemoTextEncode")]
    assert len(encoders) == 1, encoders
    return encoders[0]


def _shipped_positive_literal(graph: dict) -> tuple[str, str]:
    """Where the positive encoder's text is written: its `text`, or the value of the primitive linked there."""
    encoder = _shipped_positive_encoder(graph)
    text = graph[encoder]["inputs"]["text"]
    return (text[0], "value") if is_link(text) else (encoder, "text")


@pytest.mark.parametrize("path", sorted(WORKFLOWS.glob("*.json")), ids=lambda path: path.stem)
def test_every_carnator_node_of_a_shipped_workflow_finds_its_positive_prompt(path):
    graph = json.loads(path.read_text())
    node_id, name = _shipped_positive_literal(graph)
    expected = graph[node_id]["inputs"][name]
    nodes = [node_id for node_id, node in graph.items() if node["class_type"] in CARNATOR_SAMPLING]
    assert nodes and expected.strip()
    for node_id in nodes:
        assert find_prompt_text(copy.deepcopy(graph), node_id).text == expected, node_id


@pytest.mark.parametrize("path", sorted(WORKFLOWS.glob("*.json")), ids=lambda path: path.stem)
def test_the_queue_writes_each_prompt_where_the_positive_text_is_read(path):
    """The batch runner's text target is the positive encoder's literal, which every Carnator node reads."""
    graph = json.loads(path.read_text())
    target = _shipped_positive_literal(graph)
    assert Workflow(copy.deepcopy(graph)).text_target == target
    assert find_text_inputs(graph) == [target]
    for node_id in [node_id for node_id, node in graph.items() if node["class_type"] in CARNATOR_SAMPLING]:
        assert find_text_inputs(graph, node_id) == [target], node_id


# ---------------------------------------------------------------------- where the text is written


def test_text_inputs_from_the_samplers_when_no_node_is_named():
    graph = _wan()
    del graph["reuse"]
    graph["sampler"]["inputs"]["model"] = ["shift", 0]
    assert find_text_inputs(graph) == [("pos", "text")] == find_text_inputs(graph, "sampler")
    # a conditioning node on the negative side, first in id order, is no sampler
    graph["0"] = _node("ConditioningSetTimestepRange", conditioning=["neg", 0], start=0.0, end=1.0)
    graph["sampler"]["inputs"]["negative"] = ["0", 0]
    assert find_text_inputs(graph) == [("pos", "text")]
    graph["pos"]["inputs"]["text"] = ""  # a workflow left blank for the batch to fill
    assert find_text_inputs(graph) == [("pos", "text")] and not find_prompt_text(graph, "sampler").found


def test_text_inputs_of_a_guider_graph_and_of_joined_texts():
    graph = _wan()
    sampler = graph.pop("sampler")
    graph.update(guider=_node("BasicGuider", model=["reuse", 0], conditioning=["flux", 0]),
                 flux=_node("FluxGuidance", conditioning=["pos", 0], guidance=6.0),
                 sampler=_node("SamplerCustomAdvanced", guider=["guider", 0], latent_image=sampler["inputs"]["latent_image"]))
    assert find_text_inputs(graph) == [("pos", "text")] == find_text_inputs(graph, "reuse")
    graph.update(subject=_encode("a fox"), combine=_node("ConditioningCombine", conditioning_1=["subject", 0],
                                                          conditioning_2=["pos", 0]))
    graph["flux"]["inputs"]["conditioning"] = ["combine", 0]
    assert find_text_inputs(graph) == [("subject", "text"), ("pos", "text")]
    graph["subject"]["inputs"]["text"] = ["pos_text", 0]  # one primitive behind both encoders: one place
    graph["pos"]["inputs"]["text"] = ["pos_text", 0]
    graph["pos_text"] = _node("PrimitiveStringMultiline", value=TEXT)
    assert find_text_inputs(graph) == [("pos_text", "value")]


def test_no_text_inputs_where_the_text_cannot_be_read():
    graph = _wan(pos=_encode(["builder", 0]), builder=_node("CustomPromptBuilder", subject="fox", seed=3))
    assert find_text_inputs(graph) == [] == find_text_inputs(graph, "reuse")
    for hostile in (None, [], {}, {"1": None}, {"1": {"class_type": "KSampler", "inputs": {"positive": ["1", 0]}}}):
        assert find_text_inputs(hostile) == [] and text_node_inputs(hostile, "1") == []
    chain = {str(i): _node("ConditioningSetTimestepRange", conditioning=[str(i - 1), 0]) for i in range(1, MAX_NODES)}
    chain["0"] = _encode(TEXT)
    chain["k"] = _node("KSampler", positive=[str(MAX_NODES - 1), 0])
    assert find_text_inputs(chain) == []  # too deep to follow


def test_text_node_inputs_of_a_named_node():
    graph = _wan(text=_node("PrimitiveStringMultiline", value=TEXT))
    graph["pos"]["inputs"]["text"] = ["text", 0]
    assert text_node_inputs(graph, "pos") == [("text", "value")] == text_node_inputs(graph, "text")
    assert text_node_inputs(graph, "neg") == [("neg", "text")]
    assert text_node_inputs(graph, "sampler") == [] == text_node_inputs(graph, "missing")


def test_one_link_predicate():
    assert link_source(["6", 0]) == ("6", 0) and link_source(["57:4", 1.0]) == ("57:4", 1)
    for literal in ("6", ["6"], ["6", "0"], ["6", True], [6, 0], ["a", "b", 0], None):
        assert link_source(literal) is None and not is_link(literal)
    assert is_link(["6", 0]) and is_link(["57:4", 1.0])


def test_the_queue_keeps_its_fallback_and_says_why_it_cannot_tell():
    graph = _wan(positive="combine", subject=_encode("a fox"),
                 combine=_node("ConditioningCombine", conditioning_1=["subject", 0], conditioning_2=["pos", 0]))
    with pytest.raises(WorkflowError, match=r"cannot tell which node holds the prompt text \(the positive prompt is "
                                            r"read from several text inputs: subject.text, pos.text\); name it with "
                                            r"--text-node ID"):
        Workflow(graph)
    assert Workflow(graph, "subject").text_target == ("subject", "text")
    graph = _wan(pos=_encode(["builder", 0]), builder=_node("CustomPromptBuilder", text="a fox", seed=3))
    del graph["neg"], graph["sampler"]["inputs"]["negative"]
    assert Workflow(graph).text_target == ("builder", "text")  # the search reads none: the one literal `text`
    del graph["builder"]["inputs"]["text"]
    with pytest.raises(WorkflowError, match="no sampler's positive conditioning leads to a text input"):
        Workflow(graph)
    graph = _wan(join=_node("StringConcatenate", string_a="a fox", string_b="in snow", delimiter=", "))
    graph["pos"]["inputs"]["text"] = ["join", 0]
    with pytest.raises(WorkflowError, match="takes its text from several inputs"):
        Workflow(graph, "pos")


# ---------------------------------------------------------------------- the note in the run report


def _run(tmp_path, prompt: str, prompt_note: str) -> ReuseRun:
    return ReuseRun(settings=ReuseSettings(prompt=prompt, prompt_note=prompt_note),
                    store=ReuseStore(str(tmp_path / "store")), hard_key=HardKey("model", (2, 4, 4), "schedule"),
                    latent_shape=(1, 16, 2, 8, 8), noise_fingerprint="noise", cond_vector=torch.ones(256),
                    sigmas=[1 - s / 10 for s in range(11)], cfg=5.0, seed=3)


def test_the_report_says_where_the_text_came_from_or_why_there_is_none(tmp_path):
    found = "prompt text read from the graph (node 6 CLIPTextEncode): 'a fox'"
    run = _run(tmp_path, "a fox", found)
    run.match = Match(store_location="store", request=None, candidates=[], notes=["lookup note"])
    assert run.report(elapsed=1.0).notes == [found, "lookup note"]
    missing = "prompt text not found in the graph (node 9 is missing or malformed): matched on conditioning only"
    run = _run(tmp_path, "", missing)
    run.match = Match(store_location="store", request=None, candidates=[],
                      notes=["no prompt text given: matched on conditioning only"])
    assert run.report(elapsed=1.0).notes == [missing]  # the graph's account replaces the lookup's
    run = _run(tmp_path, "", "")
    run.match = Match(store_location="store", request=None, candidates=[],
                      notes=["no prompt text given: matched on conditioning only"])
    assert run.report(elapsed=1.0).notes == ["no prompt text given: matched on conditioning only"]

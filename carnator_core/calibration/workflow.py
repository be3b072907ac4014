"""The user's own workflow made into the runs calibration needs: plain, recorded donor, and forced resumes.

Calibration samples with whatever model the graph loads and the graph's own sampler settings; it changes only what
it must, on a copy of the graph per run:

- the prompt text, where the queue runner writes it (`carnator_core.queue.Workflow`);
- the Carnator reuse node of the first sampler (inserted in front of it when the graph has none): its mode,
  verification, recording and sparse attention off, so plain runs are bit-identical to the stock sampler. A graph
  whose samplers run one after another (Wan 2.2 14B's two experts, LTX-2's refinement) calibrates its first stage:
  the later stages' reuse nodes sample plain and record nothing, and the clip compared is the last stage's;
- a `CarnatorStore` of the pair's own, so each forced resume can only take the pair's earlier prompt as donor;
- `SaveLatent` on the sampler's output, and `PreviewImage` on the node that decodes it where one does, so clips
  are compared on decoded frames where the graph decodes, on latents otherwise; an audio+video latent (LTX-2) is
  saved as the graph's `LTXVSeparateAVLatent` unpacks it, its video as above and its audio beside it;
- a `CarnatorCompatibilityLookup` reads the pair's store too, and a `CarnatorSparseAttention` node is bypassed;
- the graph's other output nodes are left out (their files are not needed, and they cost time);
- for plain at fewer steps, the step count where the graph sets it: the sampler's `steps` (KSampler, CarnatorKSampler,
  KSamplerAdvanced, whose stage boundaries scale with it), or that of the scheduler node a custom sampler takes its
  sigmas from (BasicScheduler, LTXVScheduler, ...); later stages of the same step count are lowered with it. A graph
  whose first sampler's steps are set nowhere calibration can lower (a fixed sigma list, steps from a link) runs no
  fewer-steps runs, and `steps_note` says why.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import PurePath

from carnator_core.judging.clip_oracles import ClipOracle, oracle_for
from carnator_core.lookup.prompt_text import is_link
from carnator_core.queue import Workflow, WorkflowError
from carnator_core.workflow_graph import AV_SEPARATOR, REUSE_NODES, SAMPLERS, complete, feeds, links_to, stage_chain

STORE_READERS = (*REUSE_NODES, "CarnatorCompatibilityLookup")  # every node that reads donors from a store
SPARSE_ATTENTION_NODE = "CarnatorSparseAttention"  # bypassed: calibration compares against plain attention
KEPT_OUTPUTS = ("CarnatorReport",)
STORE_NODE = "carnator_calibration_store"
STORE_INFO_NODE = "carnator_calibration_store_info"
LATENT_NODE = "carnator_calibration_latent"
AUDIO_NODE = "carnator_calibration_audio"
FRAMES_NODE = "carnator_calibration_frames"
INSERTED_REUSE_NODE = "carnator_calibration_reuse"
MODEL_FILE_INPUTS = ("unet_name", "ckpt_name", "model_name")  # loaders' file inputs
CUSTOM_SAMPLERS = ("SamplerCustom", "SamplerCustomAdvanced")  # take their sigmas from another node
STAGE_BOUNDARIES = ("start_at_step", "end_at_step")  # KSamplerAdvanced's: steps of the whole schedule


@dataclass
class CalibrationWorkflow:
    """Where calibration changes the user's graph; `oracle` where one is registered for its decoder (the demo
    model's: `carnator_core.judging.clip_oracles`)."""

    workflow: Workflow
    object_info: dict
    sampler: str  # the sampler calibrated: the first of the graph's samplers
    reuse_node: str
    decoder: str | None
    oracle: ClipOracle | None
    user_store: str | None  # the node id of the CarnatorStore the reuse node reads (None: the default store)
    output: str = ""  # the sampler whose latent is the request's: the last one (the calibrated one when alone)
    later_reuse_nodes: tuple[str, ...] = ()  # the reuse nodes of the later stages: plain in every run
    # where the request's audio+video latent is unpacked: (separator node, video output, audio output); None for a
    # latent of one part
    unpacked: tuple[str, int, int] | None = None
    steps: int | None = None  # the calibrated sampler's step count, where calibration can lower it
    step_nodes: tuple[str, ...] = ()  # the nodes whose `steps` input holds it (samplers or schedulers)
    steps_note: str = ""  # why the steps cannot be lowered, where they cannot

    @classmethod
    def prepare(cls, workflow: Workflow, object_info: dict) -> CalibrationWorkflow:
        """Find the one sampler, the reuse node (inserting one) and the decoder; WorkflowError names what is wrong."""
        graph = copy.deepcopy(workflow.graph)
        samplers = [node_id for node_id, node in graph.items() if node["class_type"] in SAMPLERS]
        if not samplers:
            raise WorkflowError(f"the workflow has no sampler node ({', '.join(SAMPLERS)}): nothing to calibrate")
        chain = stage_chain(graph, samplers)
        if chain is None:
            named = ", ".join(f"{node_id} ({graph[node_id]['class_type']})" for node_id in samplers)
            raise WorkflowError(f"the workflow has several samplers that do not run one after another ({named}): "
                                "calibration measures one model over one schedule; export a workflow with one "
                                "sampler, or with stages that each continue the one before")
        sampler, output = chain[0], chain[-1]
        missing = [name for name in (*REUSE_NODES, "SaveLatent", "PreviewImage", "CarnatorStore", "CarnatorStoreInfo")
                   if name not in object_info]
        if missing:
            raise WorkflowError(f"the server lacks nodes calibration needs: {', '.join(missing)} (is Carnator installed "
                                "there?)")
        for node_id in [n for n, node in graph.items() if node["class_type"] == SPARSE_ATTENTION_NODE]:
            _bypass(graph, node_id, "model")
        reuse_nodes = [node_id for node_id, node in graph.items() if node["class_type"] in REUSE_NODES]
        own = [node_id for node_id in reuse_nodes if node_id == sampler or feeds(graph, sampler, node_id)]
        others = [node_id for node_id in reuse_nodes if node_id not in own
                  and not any(feeds(graph, later, node_id) or node_id == later for later in chain[1:])]
        if len(own) > 1:
            raise WorkflowError(f"the workflow has several Carnator reuse nodes in front of its first sampler "
                                f"({', '.join(own)}); keep one")
        if others:
            raise WorkflowError(f"Carnator reuse node {', '.join(others)} feeds none of the workflow's samplers")
        reuse_node = own[0] if own else cls._insert_reuse(graph, sampler)
        graph = complete(graph, object_info)
        user_store = graph[reuse_node]["inputs"].get("store")
        user_store = str(user_store[0]) if isinstance(user_store, list) else None
        separators = [node_id for node_id, node in graph.items() if node["class_type"] == AV_SEPARATOR
                      and links_to(node["inputs"].get("av_latent"), output)]
        unpacked = (separators[0], 0, 1) if separators else None
        video = [separators[0], 0] if separators else [output, 0]
        decoders = [node_id for node_id, node in graph.items()
                    if any(is_link(value) and [str(value[0]), value[1]] == video for value in node["inputs"].values())
                    and "IMAGE" in (object_info.get(node["class_type"], {}).get("output") or [])]
        for node_id in [n for n, node in graph.items()
                        if object_info.get(node["class_type"], {}).get("output_node")
                        and node["class_type"] not in KEPT_OUTPUTS]:
            del graph[node_id]
        decoder = decoders[0] if decoders else None
        oracle = oracle_for(graph[decoder]["class_type"]) if decoder is not None else None
        steps, step_nodes, steps_note = step_inputs(graph, chain)
        return cls(workflow=Workflow(graph, workflow.text_target[0] if workflow.text_target else None),
                   object_info=object_info, sampler=sampler, reuse_node=reuse_node, decoder=decoder,
                   oracle=oracle, user_store=user_store, output=output,
                   later_reuse_nodes=tuple(n for n in reuse_nodes if n not in own), unpacked=unpacked, steps=steps,
                   step_nodes=step_nodes, steps_note=steps_note)

    @staticmethod
    def _insert_reuse(graph: dict, sampler: str) -> str:
        """A CarnatorReuse between the sampler (or its guider) and the model it samples with."""
        holder = sampler
        if "model" not in graph[sampler]["inputs"] and is_link(graph[sampler]["inputs"].get("guider")):
            holder = str(graph[sampler]["inputs"]["guider"][0])
        model = graph[holder]["inputs"].get("model")
        if not is_link(model):
            raise WorkflowError(f"cannot find the model node {sampler} ({graph[sampler]['class_type']}) samples "
                                "with: put a Carnator Reuse node in front of it")
        graph[INSERTED_REUSE_NODE] = {"class_type": "CarnatorReuse", "inputs": {"model": model}}
        graph[holder]["inputs"]["model"] = [INSERTED_REUSE_NODE, 0]
        return INSERTED_REUSE_NODE

    def graph_for(self, prompt: str, store_path: str, *, verification: str = "model", record: bool = False,
                  prefix: str = "carnator_calibration/run", steps: int | None = None, mode: str | None = None) -> dict:
        """The graph of one calibration run: `prompt` sampled with the pair's store at `store_path`, its latent (and
        decoded frames) saved under `prefix`. `record` keeps it as the pair's donor; a forced `verification`
        resumes from that donor; a `mode` runs the engine as that mode runs it (its own judgement); otherwise the
        run is plain (mode safe, sparse attention off), at `steps` steps where given (`self.steps` must be set)."""
        graph = self.workflow.for_prompt(prompt, "fixed", random.Random(0))
        if steps is not None:
            self.lower_steps(graph, steps)
        reuse = graph[self.reuse_node]["inputs"]
        reuse.update(mode=mode or ("fast" if verification != "model" else "safe"), verification=verification,
                     record=record,
                     sparse_attention="off", store=[STORE_NODE, 0])
        for node_id in self.later_reuse_nodes:
            graph[node_id]["inputs"].update(mode="safe", verification="model", record=False, sparse_attention="off")
        for node in graph.values():
            if node["class_type"] in STORE_READERS:
                node["inputs"]["store"] = [STORE_NODE, 0]
        graph[STORE_NODE] = {"class_type": "CarnatorStore", "inputs": {"path": store_path, "size_limit_gb": 1.0}}
        graph[STORE_INFO_NODE] = {"class_type": "CarnatorStoreInfo", "inputs": {"store": [STORE_NODE, 0]}}
        if self.unpacked is None:
            graph[LATENT_NODE] = {"class_type": "SaveLatent", "inputs": {"samples": [self.output or self.sampler, 0],
                                                                         "filename_prefix": prefix}}
        else:
            separator, video, audio = self.unpacked
            graph[LATENT_NODE] = {"class_type": "SaveLatent", "inputs": {"samples": [separator, video],
                                                                         "filename_prefix": prefix}}
            graph[AUDIO_NODE] = {"class_type": "SaveLatent", "inputs": {"samples": [separator, audio],
                                                                        "filename_prefix": f"{prefix}-audio"}}
        if self.decoder is not None:
            graph[FRAMES_NODE] = {"class_type": "PreviewImage", "inputs": {"images": [self.decoder, 0]}}
        return graph

    def lower_steps(self, graph: dict, steps: int) -> None:
        """Every node holding the graph's step count set to `steps`; a KSamplerAdvanced's stage boundaries inside
        the schedule scale with it (a first stage keeps at least one step)."""
        if self.steps is None:
            raise ValueError(f"the steps of this graph cannot be lowered: {self.steps_note}")
        for node_id in self.step_nodes:
            inputs = graph[node_id]["inputs"]
            inputs["steps"] = steps
            for name in STAGE_BOUNDARIES:
                value = inputs.get(name)
                if isinstance(value, int) and 0 < value < self.steps:
                    inputs[name] = max(1, value * steps // self.steps)

    def digest(self) -> str:
        """Names what a calibration measures: the graph with the prompt text left out (model, settings, seed)."""
        text = json.dumps(self.graph_for("", ""), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def model_name(self) -> str | None:
        """The stem of the first model file the graph loads, to name a profile by where none is given."""
        for node in self.workflow.graph.values():
            for name in MODEL_FILE_INPUTS:
                value = node["inputs"].get(name)
                if isinstance(value, str) and value:
                    return PurePath(value.replace("\\", "/")).stem
        return None

    def store_graph(self) -> dict:
        """A graph that opens the store the user's reuse node reads (the default store when none is connected) and
        describes it: its location is where the fitted profile goes."""
        graph: dict = {STORE_INFO_NODE: {"class_type": "CarnatorStoreInfo", "inputs": {}}}
        if self.user_store is not None:
            graph[self.user_store] = copy.deepcopy(self.workflow.graph[self.user_store])
            graph[STORE_INFO_NODE]["inputs"]["store"] = [self.user_store, 0]
        return graph


def step_inputs(graph: dict, chain: list[str]) -> tuple[int | None, tuple[str, ...], str]:
    """The first sampler's step count, the nodes that hold it (its own and the later stages' of the same count), and
    where it cannot be lowered, None, no nodes and why (one line)."""
    holders = []
    for node_id in chain:
        holder, why = _step_holder(graph, node_id)
        if holder is None:
            if node_id == chain[0]:
                return None, (), why
            continue
        holders.append(holder)
    steps = graph[holders[0]]["inputs"]["steps"]
    return steps, tuple(h for h in holders if graph[h]["inputs"]["steps"] == steps), ""


def _step_holder(graph: dict, sampler: str) -> tuple[str | None, str]:
    """The node whose literal `steps` input sets the sampler's step count, or None and why there is none."""
    node = graph[sampler]
    named = f"sampler {sampler} ({node['class_type']})"
    holder = sampler
    if node["class_type"] in CUSTOM_SAMPLERS:
        sigmas = node["inputs"].get("sigmas")
        if not is_link(sigmas) or str(sigmas[0]) not in graph:
            return None, f"{named} has no sigmas node"
        holder = str(sigmas[0])
        if "steps" not in graph[holder]["inputs"]:
            return None, (f"{named} takes a fixed sigma list from node {holder} ({graph[holder]['class_type']}), "
                          "which has no steps to lower")
        named = f"node {holder} ({graph[holder]['class_type']}), the sigmas of {named},"
    value = graph[holder]["inputs"].get("steps")
    if isinstance(value, bool) or not isinstance(value, int):
        return None, f"{named} takes its steps from another node ({value!r}), not a number calibration can lower"
    return holder, ""


def _bypass(graph: dict, node_id: str, through: str) -> None:
    """Take `node_id` out of the graph: whatever read its first output reads its `through` input instead."""
    source = graph.pop(node_id)["inputs"].get(through)
    for node in graph.values():
        for name, value in node["inputs"].items():
            if links_to(value, node_id) and value[1] == 0:
                node["inputs"][name] = source

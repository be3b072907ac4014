"""Nodes that make a sampler reuse earlier generations, and the report of what happened."""

from __future__ import annotations

import json

from comfy_api.latest import io

from carnator_core.lookup.prompt_text import find_prompt_text
from carnator_core.reuse.report import RunReport
from carnator_core.reuse.settings import MODES, SEED_POLICIES, VERIFICATIONS, ReuseSettings, input_default, input_range

from .attention_node import ATTENTION, attention_choice_input, attention_settings, min_tokens_input, recall_inputs
from .reports import reports_for
from .reuse_hooks import install
from .types import StoreType, advanced_input


def _setting(name: str) -> dict:
    """Schema default, min and max of the numeric reuse input `name`, as `ReuseSettings` defines them."""
    return {"default": input_default(name), **input_range(name)}


def reuse_inputs() -> list[io.Input]:
    """The Carnator options shared by every reuse entry point (one definition, several nodes)."""
    return [
        StoreType.Input("store", optional=True, tooltip="Reuse store; the default store when not connected."),
        io.String.Input("prompt", default=input_default("prompt"), multiline=True, optional=True,
                        tooltip="Prompt text of this request, for text similarity and the store listing. Leave "
                                "empty to read it from the text encoder feeding the sampler's positive conditioning; "
                                "where the graph does not say, matching uses the conditioning tensor alone."),
        io.Combo.Input("mode", options=list(MODES), default=input_default("mode"),
                       tooltip="safe: borrow attention masks only. balanced: also resume from a verified donor "
                               "state up to half-way. fast: resume up to 80% of the way."),
        io.Combo.Input("seed_policy", options=list(SEED_POLICIES), default=input_default("seed_policy"),
                       tooltip="same-noise: resume only from donors with identical initial noise (same seed), the "
                               "prompt-editing loop. serving: any compatible donor (throughput first)."),
        io.Int.Input("top_k", **advanced_input(), **_setting("top_k"), tooltip="Candidates shortlisted by similarity."),
        io.Float.Input("min_similarity", **advanced_input(), **_setting("min_similarity"), step=0.01,
                       tooltip="Candidates below this prompt/conditioning cosine similarity are not considered."),
        io.Int.Input("max_probes", **advanced_input(), **_setting("max_probes"),
                     tooltip="Most probe calls per run; each is one model evaluation (of up to probe_batch donor "
                             "states). A call that passes nothing ends probing, so a miss costs at most one. Not "
                             "counted: the step-0 check of same-seed donors, which is the run's own first step."),
        io.Float.Input("structure_threshold", **advanced_input(), **_setting("structure_threshold"), step=0.01,
                       tooltip="Structure agreement (layout and motion, appearance removed) a donor state needs "
                               "at depth 0; rises with depth by depth_slope. Left at its default it is auto: the "
                               "model's calibration profile in the store decides where there is one."),
        io.Float.Input("guidance_threshold", **advanced_input(), **_setting("guidance_threshold"), step=0.01,
                       tooltip="Cosine between the new and the donor guidance direction (cond - uncond) needed "
                               "at depth 0 (CFG only); rises with depth by depth_slope. Auto at its default, as "
                               "structure_threshold."),
        io.Float.Input("depth_slope", **advanced_input(), **_setting("depth_slope"), step=0.01,
                       tooltip="How much stricter both thresholds get per unit of depth (fraction of steps "
                               "skipped). Auto at its default, as structure_threshold."),
        io.Float.Input("guidance_boost", **advanced_input(), **_setting("guidance_boost"), step=0.05,
                       tooltip="Extra CFG (as a fraction of cfg) for the first steps after a resume. 0 = off."),
        io.Int.Input("guidance_boost_steps", **advanced_input(), **_setting("guidance_boost_steps"),
                     tooltip="How many steps after a resume get the guidance boost."),
        io.Boolean.Input("record", default=input_default("record"),
                         tooltip="Record this run in the store so later requests can reuse it."),
        io.Combo.Input("verification", **advanced_input(), options=list(VERIFICATIONS), default=input_default("verification"),
                       optional=True,
                       tooltip="model: verify donors with the model before resuming (Carnator). text-only: skip "
                               "depth from prompt similarity alone, unverified (a baseline for comparison). forced "
                               "N%: resume the most similar donor at N% of the steps whatever the model says, "
                               "recording its signals (what calibration measures; not for production)."),
    ]


def exact_repeats_input() -> io.Input:
    """Last of every reuse node's inputs (saved workflows hold widget values by position)."""
    return io.Boolean.Input("exact_repeats", **advanced_input(), default=input_default("exact_repeats"),
                            optional=True,
                            tooltip="A run whose every sampler input matches a stored run (model, conditioning, "
                                    "noise, sampler, sigmas, cfg) and whose first model prediction is that run's bit "
                                    "for bit returns the stored output after that one call: what sampling would give. "
                                    "Off: such a run resumes like any other.")


def probe_batch_input() -> io.Input:
    """After every other reuse input (saved workflows hold widget values by position, so inputs added later go last:
    a model-level node's `min_tokens` follows it)."""
    return io.Int.Input("probe_batch", **advanced_input(), **_setting("probe_batch"), optional=True,
                        tooltip="Donor states probed in one model call (other donors' checkpoints at the same "
                                "step). 0 = auto: as many as fit in free GPU memory, up to 4; 1 on CPU, where a "
                                "batched call costs as much as the separate ones it replaces.")


def settings_from_inputs(store=None, **inputs) -> ReuseSettings:
    """The `ReuseSettings` of a reuse node's inputs (`store` is the connected store, if any)."""
    return ReuseSettings.from_inputs(store_location=store.location if store is not None else "", **inputs)


# What a reuse node reads of the queued graph: the prompt text when its `prompt` input is empty.
GRAPH_HIDDEN = [io.Hidden.prompt, io.Hidden.unique_id]


def with_graph_prompt(node: type[io.ComfyNode], options: dict) -> dict:
    """A reuse node's inputs with the prompt text read from the queued graph where its `prompt` is empty, and a
    note saying where the text came from or why there is none. Unchanged outside a queued graph."""
    if (options.get("prompt") or "").strip():
        return options
    graph, node_id = getattr(node.hidden, "prompt", None), getattr(node.hidden, "unique_id", None)
    if graph is None or node_id is None:
        return options
    found = find_prompt_text(graph, node_id)
    return {**options, "prompt": found.text, "prompt_note": found.note}


def graph_prompt_fingerprint() -> str:
    """The text this node reads from the graph now, as its `fingerprint_inputs`: the text node is no input of it,
    so without this ComfyUI would serve its cached output, holding the previous prompt's text."""
    try:
        from comfy_execution.progress import get_progress_state
        from comfy_execution.utils import get_executing_context

        context, registry = get_executing_context(), get_progress_state()
        graph = registry.dynprompt.get_original_prompt()
    except (ImportError, AttributeError):  # a host without them: the node runs as cached as any other
        return ""
    if context is None or registry.prompt_id != context.prompt_id:
        return ""
    found = find_prompt_text(graph, context.node_id)
    return f"{found.text}\n{found.note}"


def model_level_inputs() -> list[io.Input]:
    """Reuse options plus the attention patch, for nodes that see the model (not a bare SAMPLER)."""
    return reuse_inputs() + [attention_choice_input("borrowed")] + recall_inputs() + [probe_batch_input(),
                                                                                       min_tokens_input(),
                                                                                       exact_repeats_input()]


def install_from_inputs(model, sparse_attention: str, enter_recall: float, exit_recall: float,
                        min_tokens: int = ATTENTION.min_tokens, **options):
    """The model patched for reuse (and sparse attention unless 'off') from a node's inputs."""
    attention = attention_settings(sparse_attention, enter_recall=enter_recall, exit_recall=exit_recall,
                                   min_tokens=min_tokens)
    return install(model, settings_from_inputs(**options), attention)


class CarnatorReuse(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorReuse",
            display_name="Carnator Reuse",
            category="Carnator/reuse",
            description="Insert between the model chain and any sampler (KSampler, SamplerCustom, "
                        "SamplerCustomAdvanced): the sampler then reuses compatible earlier generations, "
                        "verified by the model itself, and records this one for later requests.",
            inputs=[io.Model.Input("model", tooltip="The model after LoRAs and other patches.")] + model_level_inputs(),
            outputs=[io.Model.Output(display_name="model")],
            hidden=GRAPH_HIDDEN,
        )

    @classmethod
    def fingerprint_inputs(cls, **inputs) -> str:
        return graph_prompt_fingerprint()

    @classmethod
    def execute(cls, model, **options) -> io.NodeOutput:
        return io.NodeOutput(install_from_inputs(model, **with_graph_prompt(cls, options)))


class CarnatorReport(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorReport",
            display_name="Carnator Report",
            category="Carnator/reuse",
            description="What Carnator did in this prompt's sampling runs: hit or miss and why, the donor, "
                        "steps skipped, attention density, time saved.",
            is_output_node=True,
            not_idempotent=True,
            inputs=[io.Latent.Input("samples", tooltip="Output of the sampler to report on (orders this node "
                                                       "after it).")],
            outputs=[io.String.Output(display_name="text"), io.String.Output(display_name="json")],
        )

    @classmethod
    def execute(cls, samples) -> io.NodeOutput:
        from comfy_execution.utils import get_executing_context

        context = get_executing_context()
        reports = reports_for(context.prompt_id if context else None)
        text = "\n".join(RunReport.from_dict(report).text() for report in reports)
        text = text or "Carnator: no Carnator sampling run yet."
        data = json.dumps(reports, default=str)
        # the JSON also goes into the UI output, so API clients find it in /history next to the text
        return io.NodeOutput(text, data, ui={"text": [text], "carnator_report": [data]})


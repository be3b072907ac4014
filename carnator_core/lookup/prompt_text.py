"""The positive prompt's text, read from a queued ComfyUI graph (API format) when a reuse node is given none.

Why: the text only serves text similarity and the store listing, and users wire it to the sampler's text encoder,
not to Carnator. So a reuse node follows its sampler's positive conditioning upstream to the text node(s) itself.
What it cannot read for certain (a prompt built by a custom node, a list, several samplers with different
prompts) it leaves empty: the lookup then matches on the conditioning tensor alone, and the note says why.
The batch runner (carnator_core.queue) writes each prompt where this search reads the text (`find_text_inputs`),
so both agree on which text is the prompt.

The graph is `{node_id: {"class_type": str, "inputs": {name: literal | [source_id, output_index]}}}`; nodes of
expanded subgraphs ("57:12") are ordinary entries. Any input may be malformed or hostile: nothing here raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Text inputs of text encoders, the prompt as written first: where an encoder takes several texts (SDXL, SD3, Flux,
# HiDream, HunyuanDiT), the long-form one is the user's prompt and the CLIP-L one often a copy or empty.
TEXT_INPUTS = ("text", "prompt", "user_prompt", "t5xxl", "llama", "qwen25_7b", "mt5xl", "text_g", "clip_g",
               "clip_l", "text_l", "bert", "caption")
# Text encoders without a `clip` input (every other one takes the text encoder model as `clip`).
CLIPLESS_ENCODERS = frozenset({"CarnatorDemoTextEncode"})
# Inputs of a sampler or guider that carry the conditioning to follow (DualCFGGuider has two).
POSITIVE_INPUTS = ("positive", "conditioning", "cond1", "cond2")
# String nodes whose output is their `value` input.
VALUE_NODES = frozenset({"PrimitiveString", "PrimitiveStringMultiline"})
MAX_NODES = 4096  # nodes one search may visit: a bound on hostile graphs, far above any real workflow
SHOWN_CHARS = 80  # of the text, in the note


Location = tuple[str, str]  # (node id, input name) of a literal in the graph


@dataclass(frozen=True)
class PromptText:
    """The text found (empty when none could be read for certain), a note for the run report, the text nodes, and
    the literals the text was read from (to write a new prompt in their place)."""

    text: str
    note: str
    sources: tuple[str, ...] = ()
    locations: tuple[Location, ...] = ()

    @property
    def found(self) -> bool:
        return bool(self.text)


class _Unreadable(Exception):
    """Why the text cannot be read for certain; caught at the top, never leaves this module."""


def find_prompt_text(graph: Any, node_id: Any) -> PromptText:
    """The positive prompt text of the sampler(s) that node `node_id` serves in `graph`.

    `node_id` is a sampler itself (CarnatorKSampler), or feeds a MODEL or SAMPLER that reaches one downstream
    (CarnatorReuse, CarnatorReuseSampler). Texts of combined or concatenated conditionings are joined in input
    order; several samplers must agree on the text, or none is taken.
    """
    try:
        return _Search(graph).prompt_text(str(node_id))
    except _Unreadable as reason:
        return PromptText("", f"prompt text not found in the graph ({reason}): matched on conditioning only")
    except Exception as error:  # a graph no search foresaw must not fail the user's prompt
        return PromptText("", f"prompt text not found in the graph (unreadable: {type(error).__name__}): "
                              "matched on conditioning only")


def find_text_inputs(graph: Any, start_node_id: Any = None) -> list[Location]:
    """Where the positive prompt's text is written: (node id, input name) of each literal it is read from.

    From `start_node_id` as `find_prompt_text` searches; without one, from the graph's samplers (nodes taking a
    positive conditioning that no node takes as conditioning) in id order, the first whose text inputs are found.
    An empty text has its places too: a workflow left blank for a batch to fill. Empty when the text cannot be read.
    """
    try:
        search = _Search(graph)
        starts = [str(start_node_id)] if start_node_id is not None else search.graph_samplers()
        for start in starts:
            try:
                locations = search.read(start)[1]
            except _Unreadable:
                continue
            if locations:
                return list(_flat(locations))
    except Exception:  # a graph no search foresaw has no place to write to
        pass
    return []


def text_node_inputs(graph: Any, node_id: Any) -> list[Location]:
    """Where the text of one text node is written: an encoder's prompt input (as the search picks it) or a string
    node's `value` or `string`, followed through primitives to the literals; empty for a node without text. For a
    text node the user names (the queue's --text-node) where the search finds none or the wrong one."""
    try:
        search = _Search(graph)
        _, inputs = search.node(str(node_id))
        return list(search.encoder_text(str(node_id), inputs, TEXT_INPUTS + ("value", "string"))[1])
    except Exception:  # an unreadable node has no text
        return []


def is_link(value: Any) -> bool:
    """Whether an API-format input value is a link to another node's output, `[source node id, output index]`,
    as ComfyUI tells one from a literal: a two-item list, a string id, a number (not a bool) for the index.
    The one such test of the pack; `link_source` gives the link's two parts."""
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and \
        isinstance(value[1], (int, float)) and not isinstance(value[1], bool)


def link_source(value: Any) -> tuple[str, int] | None:
    """(source node id, output index) when `value` is a link (`is_link`), else None."""
    return (value[0], int(value[1])) if is_link(value) else None


def _flat(locations: dict[str, tuple[Location, ...]]) -> tuple[Location, ...]:
    """The literals of several text nodes, each once (one primitive may feed several encoders)."""
    return tuple(dict.fromkeys(place for places in locations.values() for place in places))


def _shorten(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 1] + "…"


class _Search:
    def __init__(self, graph: Any):
        if not isinstance(graph, dict):
            raise _Unreadable("no graph")
        self.graph = graph
        self.visits = 0
        self._consumers: dict[str, list[str]] | None = None

    def node(self, node_id: str) -> tuple[str, dict]:
        """The class type and inputs of a node that is in the graph and well formed."""
        self.visits += 1
        if self.visits > MAX_NODES:
            raise _Unreadable("graph too large")
        node = self.graph.get(node_id)
        inputs = node.get("inputs") if isinstance(node, dict) else None
        class_type = node.get("class_type") if isinstance(node, dict) else None
        if not isinstance(inputs, dict) or not isinstance(class_type, str):
            raise _Unreadable(f"node {node_id} is missing or malformed")
        return class_type, inputs

    def label(self, node_id: str) -> str:
        node = self.graph.get(node_id)
        class_type = node.get("class_type") if isinstance(node, dict) else None
        return f"{node_id} {class_type}" if isinstance(class_type, str) else node_id

    # ------------------------------------------------------------------ the samplers served
    def prompt_text(self, node_id: str) -> PromptText:
        text, locations = self.read(node_id)
        if not text.strip():
            raise _Unreadable("the positive prompt's text is empty")
        sources = tuple(locations)
        what = ", ".join(self.label(source) for source in sources) + (", joined" if len(sources) > 1 else "")
        return PromptText(text, f"prompt text read from the graph (node{'s' * (len(sources) > 1)} {what}): "
                                f"{_shorten(text)!r}", sources, _flat(locations))

    def read(self, node_id: str) -> tuple[str, dict[str, tuple[Location, ...]]]:
        """The text and, by text node, the literals it is read from: of the nodes with text, or of all when the
        text is empty. Several samplers must agree on the text; their text nodes are all listed."""
        samplers = self.samplers(node_id)
        if not samplers:
            raise _Unreadable(f"no sampler found downstream of node {node_id}")
        found = {}
        for sampler, links in samplers.items():
            texts: dict[str, tuple[str, tuple[Location, ...]]] = {}
            for link in links:
                self.conditioning(link, texts, set())
            found[sampler] = texts
        if len({self.joined(texts) for texts in found.values()}) > 1:
            raise _Unreadable(f"samplers {', '.join(map(self.label, found))} have different prompts")
        reads = {source: read for texts in found.values() for source, read in texts.items()}
        if not reads:
            raise _Unreadable("no text encoder upstream of the positive conditioning")
        written = {source: places for source, (text, places) in reads.items() if text.strip()}
        return self.joined(next(iter(found.values()))), written or {source: read[1] for source, read in reads.items()}

    @staticmethod
    def joined(texts: dict[str, tuple[str, Any]]) -> str:
        """One text from several encoders' (a combine or concat): distinct non-empty texts in order, space-joined."""
        distinct = list(dict.fromkeys(text for text, _ in texts.values() if text.strip()))
        return distinct[0] if len(distinct) == 1 else " ".join(text.strip() for text in distinct)

    def graph_samplers(self) -> list[str]:
        """Nodes that sample on a positive conditioning, in id order: they take one (directly or through a guider)
        and no node takes their output as conditioning (which a guider's, LTXVConditioning's or FluxGuidance's is)."""
        fed, takers = set(), []
        for node_id, node in self.graph.items():
            inputs = node.get("inputs") if isinstance(node, dict) else None
            if not isinstance(inputs, dict):
                continue
            if any(link_source(inputs.get(name)) for name in POSITIVE_INPUTS + ("guider",)):
                takers.append(str(node_id))
            fed.update(link[0] for name, value in inputs.items() if (link := link_source(value)) is not None
                       and (name in POSITIVE_INPUTS + ("negative", "guider") or "conditioning" in str(name)))
        return sorted(node_id for node_id in takers if node_id not in fed)

    def samplers(self, start: str) -> dict[str, list[tuple[str, int]]]:
        """Sampler or guider nodes served by `start`, each with its positive conditioning links.

        Walks downstream from `start`'s first output through the nodes that take it as their `model` or
        `sampler` (LoRAs, patches, ModelSamplingSD3, other Carnator nodes) to the first node with a positive
        input (KSampler, SamplerCustom, CFGGuider, BasicGuider ...), or with a guider (SamplerCustomAdvanced).
        """
        found: dict[str, list[tuple[str, int]]] = {}
        queue, seen = [start], {start}
        self.node(start)
        while queue:
            node_id = queue.pop(0)
            _, inputs = self.node(node_id)
            links = self.positive_links(inputs)
            if links:
                found[node_id] = links
                continue
            for consumer in self.consumers().get(node_id, []):
                if consumer not in seen:
                    seen.add(consumer)
                    queue.append(consumer)
        return found

    def consumers(self) -> dict[str, list[str]]:
        """Node id -> the nodes taking its first output as their `model` or `sampler`; built once per search."""
        if self._consumers is None:
            self._consumers = {}
            for node_id, node in self.graph.items():
                inputs = node.get("inputs") if isinstance(node, dict) else None
                for name, value in (inputs.items() if isinstance(inputs, dict) else ()):
                    link = link_source(value)
                    if link is not None and link[1] == 0 and str(name).lower() in ("model", "sampler"):
                        self._consumers.setdefault(link[0], []).append(str(node_id))
        return self._consumers

    def positive_links(self, inputs: dict, depth: int = 0) -> list[tuple[str, int]]:
        """The positive conditioning links of a sampler or guider; through a `guider` link for a sampler that
        takes one. Empty for a node that is neither."""
        links = [link for name in POSITIVE_INPUTS if (link := link_source(inputs.get(name))) is not None]
        if links or depth > 8:
            return links
        guider = link_source(inputs.get("guider"))
        if guider is None:
            return []
        # a guider of another pack, without a positive input: its conditioning is what the note names
        return self.positive_links(self.node(guider[0])[1], depth + 1) or [guider]

    # ------------------------------------------------------------------ upstream to the text
    def conditioning(self, link: tuple[str, int], texts: dict[str, tuple[str, tuple[Location, ...]]],
                     seen: set) -> None:
        """Add the texts behind a conditioning link to `texts` (node id -> text and its literals), in input order."""
        if link in seen:
            return
        seen.add(link)
        node_id, output = link
        class_type, inputs = self.node(node_id)
        if class_type in CLIPLESS_ENCODERS or (link_source(inputs.get("clip")) is not None and
                                               any(name in inputs for name in TEXT_INPUTS)):
            texts.setdefault(node_id, self.encoder_text(node_id, inputs))
            return
        if "positive" in inputs:  # a node with positive and negative outputs (LTXVConditioning, WanImageToVideo ...)
            names = ["negative" if output == 1 and "negative" in inputs else "positive"]
        else:
            names = [name for name in inputs if isinstance(name, str) and "conditioning" in name]
        links = [link for name in names if (link := link_source(inputs[name])) is not None]
        if not links:
            raise _Unreadable(f"the conditioning comes from node {self.label(node_id)}, which holds no prompt text "
                              "Carnator can read")
        for upstream in links:
            self.conditioning(upstream, texts, seen)

    def encoder_text(self, node_id: str, inputs: dict, names: tuple[str, ...] = TEXT_INPUTS
                     ) -> tuple[str, tuple[Location, ...]]:
        """An encoder's prompt and its literals: its first text input in `names` order that holds any text, else
        the first one it has (empty, still the place the prompt is written)."""
        first = None
        for name in names:
            if name in inputs:
                places: list[Location] = []
                text = self.string(inputs[name], f"the text of node {self.label(node_id)}", 0, (node_id, name), places)
                if text.strip():
                    return text, tuple(places)
                first = first or (text, tuple(places))
        return first or ("", ())

    def string(self, value: Any, what: str, depth: int, place: Location, places: list[Location]) -> str:
        """A string input's value (at `place`): a literal, or a value, primitive or concatenation node's. Adds the
        literals read to `places`."""
        if isinstance(value, str):
            places.append(place)
            return value
        link = link_source(value)
        if link is None:
            raise _Unreadable(f"{what} is a {type(value).__name__}, not a string")
        if depth > 32:
            raise _Unreadable(f"{what} is linked too deep")
        node_id, output = link
        class_type, inputs = self.node(node_id)
        source = f"{what} comes from node {self.label(node_id)}"
        if output == 0 and class_type in VALUE_NODES and "value" in inputs:
            return self.string(inputs["value"], source, depth + 1, (node_id, "value"), places)
        if output == 0 and class_type == "StringConcatenate":
            parts = [self.string(inputs.get(name), source, depth + 1, (node_id, name), places)
                     for name in ("string_a", "delimiter", "string_b")]
            return parts[1].join((parts[0], parts[2]))
        if output == 0 and len(inputs) == 1 and isinstance(next(iter(inputs.values())), str):
            (name, text), = inputs.items()  # a value node of another pack: its one input is its text
            places.append((node_id, name))
            return text
        raise _Unreadable(f"{source}, which Carnator cannot read before it runs")

"""A queued prompt's text starts embedding when it is queued (`carnator_core.lookup.prompt_vectors`).

ComfyUI hands every prompt posted to /prompt to its on-prompt handlers before queueing it. This one reads the text
each Carnator node that looks donors up will embed (its `prompt` input, else, for the nodes that do so, the text they
read from the graph) and gives the texts to the prefetch thread, so the lookup finds the vector ready. It returns the
prompt unchanged and never raises: what it cannot read, the node embeds when it runs.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from carnator_core import process_state
from carnator_core.lookup.prompt_text import find_prompt_text
from carnator_core.lookup.prompt_vectors import prompt_vectors

from .host import prompt_server

log = logging.getLogger("carnator")

# Nodes that embed their `prompt` input, and, where it is empty, the text they read from the graph (`with_graph_prompt`).
GRAPH_PROMPT_NODES = frozenset({"CarnatorReuse", "CarnatorKSampler", "CarnatorReuseSampler"})
# Nodes that embed their `prompt` input alone.
PROMPT_INPUT_NODES = frozenset({"CarnatorCompatibilityLookup"})


def queued_texts(graph: Any) -> list[str]:
    """The distinct prompt texts the Carnator nodes of an API-format `graph` will embed."""
    texts: list[str] = []
    if not isinstance(graph, dict):
        return texts
    for node_id, node in graph.items():
        kind = node.get("class_type") if isinstance(node, dict) else None
        if kind not in GRAPH_PROMPT_NODES and kind not in PROMPT_INPUT_NODES:
            continue
        inputs = node.get("inputs")
        given = inputs.get("prompt") if isinstance(inputs, dict) else None
        if isinstance(given, str) and given.strip():
            texts.append(given)
        elif kind in GRAPH_PROMPT_NODES:
            texts.append(find_prompt_text(graph, node_id).text)
    return [text for text in dict.fromkeys(texts) if text]


def prefetch_queued_prompt(json_data: Any) -> Any:
    """The on-prompt handler: start embedding the prompt's texts; `json_data` goes on unchanged."""
    try:
        texts = queued_texts(json_data.get("prompt") if isinstance(json_data, dict) else None)
        if texts:
            prompt_vectors().prefetch(texts)
    except Exception:  # queueing must never fail for it: the lookup embeds when it runs
        log.debug("Carnator: no prompt text prefetch", exc_info=True)
    return json_data


def register_prefetch() -> None:
    """Add the handler to ComfyUI's server, once per server; a no-op when ComfyUI runs without one."""
    server = prompt_server()
    registered: weakref.WeakSet = process_state.one("servers with the prompt prefetch", weakref.WeakSet)
    if server is None or server in registered or not hasattr(server, "add_on_prompt_handler"):
        return
    registered.add(server)
    server.add_on_prompt_handler(prefetch_queued_prompt)

"""What calibration, the stages benchmark and the queue runner read from an API-format graph: which nodes sample and
which reuse, what feeds what, and the order of samplers that continue one another (Wan 2.2's two experts, LTX-2's
refinement).

Below all three (`carnator_core.calibration.workflow`, `carnator_core.bench.stages`, `carnator_core.queue`), so that
each finds a graph's nodes and stages the same way and calibration and the benchmarks need not import each other.
"""

from __future__ import annotations

import copy

from carnator_core.lookup.prompt_text import is_link

SAMPLERS = ("KSampler", "KSamplerAdvanced", "SamplerCustom", "SamplerCustomAdvanced", "CarnatorKSampler")
REUSE_NODES = ("CarnatorReuse", "CarnatorKSampler", "CarnatorReuseSampler")
AV_SEPARATOR = "LTXVSeparateAVLatent"  # unpacks an LTX-2 audio+video latent: the video (output 0) and the audio (1)


def links_to(value: object, node_id: str) -> bool:
    """Whether an input value is a link to an output of `node_id`."""
    return is_link(value) and str(value[0]) == node_id


def feeds(graph: dict, node_id: str, target: str) -> bool:
    """Whether `target` feeds `node_id`, through any chain of links."""
    seen, frontier = set(), [node_id]
    while frontier:
        for value in graph[frontier.pop()]["inputs"].values():
            if is_link(value) and str(value[0]) in graph and str(value[0]) not in seen:
                if str(value[0]) == target:
                    return True
                seen.add(str(value[0]))
                frontier.append(str(value[0]))
    return False


def stage_chain(graph: dict, samplers: list[str]) -> list[str] | None:
    """The samplers in the order they run when each one continues the one before (its input comes from it), else
    None."""
    ordered = sorted(samplers, key=lambda node_id: sum(feeds(graph, node_id, other) for other in samplers))
    if all(feeds(graph, later, earlier) for earlier, later in zip(ordered, ordered[1:], strict=False)):
        return ordered
    return None


def complete(graph: dict, object_info: dict) -> dict:
    """`graph` with every required widget input it leaves out set to the node's default (from /object_info).

    Graph builders (the demo's, the benchmarks', calibration's) set only what they mean to set; /prompt rejects missing required inputs, and taking the
    defaults from the server keeps the graphs right when a node gains an input.
    """
    graph = copy.deepcopy(graph)
    for node in graph.values():
        info = object_info.get(node["class_type"], {}).get("input", {}).get("required", {})
        for name, spec in info.items():
            if name in node["inputs"] or not isinstance(spec, (list, tuple)) or not spec:
                continue
            options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            if "default" in options:
                node["inputs"][name] = options["default"]
            elif isinstance(spec[0], list) and spec[0]:
                node["inputs"][name] = spec[0][0]
            elif options.get("options"):
                node["inputs"][name] = options["options"][0]
    return graph

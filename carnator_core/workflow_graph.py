"""What calibration, the stages benchmark and the queue runner read from an API-format graph: which nodes sample and
which reuse, what feeds what, and the order of samplers that continue one another (Wan 2.2's two experts, LTX-2's
refinement).

Below all three (`carnator_core.calibration.workflow`, `carnator_core.bench.stages`, `carnator_core.queue`), so that
each finds a graph's nodes and stages the same way and calibration and the benchmarks need not import each other.
"""

from __future__ import annotations

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

"""Carnator nodes spliced into the template-shaped test graphs, by the product's own builders
(`carnator_core.demo.graphs`, which the demo and the benchmarks use).

The builders set only what a test means to set: every other input of the Carnator nodes takes the node's
default, which the test hosts fill in from ComfyUI's /object_info when the graph is queued
(`InProcessComfy.complete`, `ComfyServer.complete`), as the demo and the benchmarks do.
"""

from __future__ import annotations

from carnator_core.demo import graphs
from support.t2v_graphs import SAMPLER


def with_reuse(graph: dict, store_path: str, prompt: str = "", **options) -> dict:
    """CarnatorStore -> CarnatorReuse in front of whatever takes the model (the guider of a SamplerCustomAdvanced
    graph, else the sampler), plus a CarnatorReport on the sampler. Exact repeats are off unless `options` turn them
    on: the tests built on this helper measure resumes, and queue an identical request to get one."""
    consumer = "guider" if "guider" in graph else SAMPLER
    return graphs.with_reuse(graph, store_path, prompt, consumer=consumer, **{"exact_repeats": False, **options})


def with_expert_reuse(graph: dict, store_path: str, prompt: str = "", experts: tuple[str, ...] = (graphs.HIGH_NOISE,
                      SAMPLER), **options) -> dict:
    """One CarnatorReuse per expert chain of a two-expert graph (`wan22_14b_t2v`), in front of each sampler named in
    `experts`, sharing one store, plus a report node on the last sampler (exact repeats off, as `with_reuse`)."""
    return graphs.with_expert_reuse(graph, store_path, prompt, experts=experts, **{"exact_repeats": False, **options})

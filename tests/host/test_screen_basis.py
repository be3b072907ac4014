"""What the step-0 screen judges a donor on, inside real ComfyUI (in-process) on the demo model.

With CFG the screen judges the two requests' conditional branches, recovered from the outputs on the assumption that
both share their unconditional branch: the same negative prompt, the same CFG scale, the output uncond + cfg x
(cond - uncond). With another CFG scale, another negative prompt or a CFG function in the model chain the assumption
does not hold, and the screen judges the guided output itself. The report says which, per screened donor.
"""

from __future__ import annotations

import itertools
import json

import pytest

from carnator_core.demo.graphs import MODEL_CHAIN, NEGATIVE, REPORT, SAMPLER, base_graph, with_reuse
from carnator_core.reuse.probe import CONDITIONAL_BRANCHES
from carnator_core.reuse.recording import entry_writer

DEMO_WEIGHTS = "carnator_demo_wan21_t2v.safetensors"
DONOR = "a red circle moving left on a black background"
REQUEST = "a red ball moving to the left on a black background"
STEPS, CFG, SEED = 6, 6.0, 9
_stores = itertools.count()


def _screened_on(comfy, store: str, prompt: str, cfg: float = CFG, negative: str = "",
                 patch: str | None = None) -> list[str]:
    graph = base_graph(DEMO_WEIGHTS, prompt, seed=SEED, steps=STEPS, cfg=cfg)
    graph[NEGATIVE]["inputs"]["text"] = negative
    if patch is not None:
        graph["patch"] = {"class_type": patch, "inputs": {"model": [MODEL_CHAIN, 0]}}
        graph[SAMPLER]["inputs"]["model"] = ["patch", 0]
    run = comfy.run_prompt(comfy.complete(with_reuse(graph, store, "", sparse_attention="off")))
    entry_writer().flush()
    [report] = json.loads(run.output(REPORT, 1))
    return [probe.get("screened_on", "") for probe in report["probes"] if probe["step"] == 0]


@pytest.mark.parametrize(("change", "request_inputs", "expected"), [
    ("nothing", {}, CONDITIONAL_BRANCHES),
    ("the CFG scale", {"cfg": 5.0}, "output (the donor's negative prompt, CFG scale or CFG function differs)"),
    ("the negative prompt", {"negative": "a blue square"},
     "output (the donor's negative prompt, CFG scale or CFG function differs)"),
    ("a CFG function", {"patch": "RescaleCFG"}, "output (a CFG function or the guider shapes the output)"),
])
def test_the_screen_judges_the_conditional_branches_only_where_both_share_the_unconditional_branch(
        comfy, change, request_inputs, expected):
    store = f"stores/screen-basis-{next(_stores)}"
    assert _screened_on(comfy, store, DONOR) == []  # the donor: nothing to screen
    screened = _screened_on(comfy, store, REQUEST, **request_inputs)
    assert screened == [expected], (change, screened)


def test_a_donor_recorded_with_a_cfg_function_is_screened_on_the_output(comfy):
    """The donor's own output was shaped by a CFG function: its unconditional branch is not known to be shared."""
    store = f"stores/screen-basis-{next(_stores)}"
    _screened_on(comfy, store, DONOR, patch="RescaleCFG")
    assert _screened_on(comfy, store, REQUEST) == [
        "output (the donor's unconditional branch is unknown)"]

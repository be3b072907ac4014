"""The stages benchmark's reading of a staged workflow: its stages in order, each with a Carnator reuse node of its
own, and where the first stage's guidance scale is."""

from __future__ import annotations

import pytest
from support.reuse_graphs import with_expert_reuse
from support.t2v_graphs import HIGH_NOISE, LOW_NOISE, POSITIVE, wan22_14b_t2v

from carnator_core.bench.stages import STAGED_GRAPHS, WORKFLOWS_DIR, StagedWorkflow
from carnator_core.queue import Workflow, WorkflowError


def _workflow(experts: tuple[str, ...]) -> Workflow:
    graph = with_expert_reuse(wan22_14b_t2v("high.safetensors", "low.safetensors", cfg=3.5), "stores/x", experts=experts)
    return Workflow(graph, POSITIVE)


def test_the_stages_run_in_order_each_with_its_own_reuse_node():
    staged = StagedWorkflow.prepare(_workflow((HIGH_NOISE, LOW_NOISE)), {})
    assert staged.stages == [HIGH_NOISE, LOW_NOISE]
    assert staged.outputs == {HIGH_NOISE: [("latent", [HIGH_NOISE, 0])], LOW_NOISE: [("latent", [LOW_NOISE, 0])]}
    assert staged.cfg_inputs(staged.workflow.graph)["cfg"] == 3.5


def test_a_stage_without_a_reuse_node_of_its_own_is_named():
    with pytest.raises(WorkflowError, match=f"stage {LOW_NOISE} \\(KSamplerAdvanced\\) has no Carnator reuse node"):
        StagedWorkflow.prepare(_workflow((HIGH_NOISE,)), {})


@pytest.mark.parametrize("name", sorted(STAGED_GRAPHS))
def test_each_shipped_staged_graph_reads_as_stages(name):
    """`--graph NAME` takes a shipped API workflow whose samplers run one after another, each with its own reuse
    node, and whose prompt node the workflow names."""
    workflow = Workflow.load(WORKFLOWS_DIR / STAGED_GRAPHS[name])
    staged = StagedWorkflow.prepare(workflow, {})
    assert len(staged.stages) >= 2 and staged.workflow.text_target is not None

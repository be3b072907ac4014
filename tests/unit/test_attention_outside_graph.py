"""Sparse attention under a host's model compiler: every tensor of a sparse call is made under the host's context
that steps out of its malloc graph; where the host has no way out, the run goes dense from the first call inside its
graph, said once in the log and in the report.

Each tensor operation is seen by a TorchDispatchMode, which tells whether it ran inside the step-out context."""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from carnator_core.attention.sparse_attention import GRAPHED_DENSE, SparseAttentionRun, SparseAttentionSettings
from carnator_core.reuse.report import RunReport


class _Operations(TorchDispatchMode):
    """The tensor operations run meanwhile, each with whether it ran outside the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.outside = False
        self.seen: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append((str(func), self.outside))
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def step_out(self):
        self.outside = True
        try:
            yield
        finally:
            self.outside = False


def _run(**fields) -> SparseAttentionRun:
    settings = SparseAttentionSettings(dense_fraction=0.0, dense_first_blocks=1, dense_last_blocks=0, min_tokens=0,
                                       dense_above=1.0, tau=0.5, min_density=0.1, max_density=0.5)
    return SparseAttentionRun(settings=settings, video_tokens=256, first_frame_tokens=64, num_layers=4, total_steps=4,
                              **fields)


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return tuple(torch.randn(1, 2, 256, 64, generator=generator) for _ in range(3))


def test_every_tensor_of_a_sparse_call_is_made_outside_the_graph():
    q, k, v = _qkv()
    operations = _Operations()
    run = _run(outside_graph=operations.step_out)
    valid = torch.ones(256, dtype=torch.bool)
    valid[-16:] = False  # padded keys: the call that drops them makes tensors of its own
    with operations:
        sparse = run.attend(q, k, v, 2, layer=2, step=0)
        masked = run.attend(q, k, v, 2, layer=3, step=0, key_valid=valid)
        dense = run.attend(q, k, v, 2, layer=0, step=0)  # a dense-first block: no tensor of Carnator's at all
    assert sparse is not None and masked is not None and dense is None and run.sparse_calls == 2
    assert operations.seen and all(outside for _, outside in operations.seen), [
        name for name, outside in operations.seen if not outside]


def test_inside_a_graph_without_a_way_out_the_run_goes_dense_says_so_once_and_reports_it(caplog):
    q, k, v = _qkv()
    operations = _Operations()
    run = _run(in_unpausable_graph=lambda: True)
    with caplog.at_level(logging.WARNING, logger="carnator.attention"), operations:
        assert run.attend(q, k, v, 2, layer=2, step=0) is None
        assert run.attend(q, k, v, 2, layer=3, step=1) is None
    assert operations.seen == [] and run.sparse_calls == 0 and run.dense_calls == 2
    assert [record.getMessage() for record in caplog.records] == [f"Carnator: {GRAPHED_DENSE}"]
    assert run.inactive == GRAPHED_DENSE and run.summary()["inactive"] == GRAPHED_DENSE
    assert RunReport.of_sparse_attention(run, 0.0).reason == GRAPHED_DENSE
    assert _run(in_unpausable_graph=lambda: False).attend(q, k, v, 2, layer=2, step=0) is not None

"""Carnator's attention under the model compiler's malloc graph (`comfy.model_prefetch`, 0.38.x), on a stand-in of each
stored variant: `pause_malloc_graph` over `MALLOC_GRAPHS`, and `ACTIVE_MALLOC_GRAPHS` whose graphs carry `pause` and
`resume` (LTX-2's av_model begins one around all its blocks).

- every tensor of a sparse call, the host-side ones included (step lookup, head views, key validity, the text rolled
  behind the video and back, the output layout), is made while the graph is paused;
- a graph with no way out turns the run dense at its first call inside it and gives the attention back to the host at
  once: Carnator's override leaves this evaluation's options and the run's, and the report says why.

Each tensor operation is seen by a TorchDispatchMode, which tells whether the stand-in graph was recording it.
"""

from __future__ import annotations

import threading
from types import ModuleType, SimpleNamespace

import pytest
import torch
from support.comfy_host import pack_module
from torch.utils._python_dispatch import TorchDispatchMode

from carnator_core.attention.sparse_attention import GRAPHED_DENSE, SparseAttentionRun, SparseAttentionSettings
from carnator_core.reuse.report import RunReport

VIDEO, TEXT, HEADS = 256, 64, 2


class _Graph:
    """A malloc graph that records while begun and not paused; `pause`/`resume` as upstream's graphs offer them."""

    def __init__(self) -> None:
        self._comfy_active = True
        self.paused = 0

    @property
    def recording(self) -> bool:
        return self._comfy_active and self.paused == 0

    def pause(self, sync: bool = False) -> None:
        self.paused += 1

    def resume(self, sync: bool = False) -> None:
        self.paused -= 1


class _GraphWithoutPause:
    """A malloc graph with no way out."""

    recording = True


class _PauseMallocGraph:
    """`pause_malloc_graph()` of the variant that keeps graphs in `MALLOC_GRAPHS`."""

    def __init__(self, graphs: dict) -> None:
        self.graphs = graphs

    def __enter__(self) -> None:
        graph = self.graphs.get(threading.get_ident())
        if graph is not None and graph._comfy_active:
            graph.pause()

    def __exit__(self, *exc) -> None:
        graph = self.graphs.get(threading.get_ident())
        if graph is not None and graph._comfy_active:
            graph.resume()


def _prefetch(variant: str, graph) -> ModuleType:
    """A stand-in `comfy.model_prefetch` of one variant, its graph begun on this thread."""
    module = ModuleType("comfy.model_prefetch")
    graphs = {threading.get_ident(): graph}
    if variant == "pause_malloc_graph":
        module.MALLOC_GRAPHS = graphs
        module.pause_malloc_graph = lambda sync=False: _PauseMallocGraph(graphs)
    else:
        module.ACTIVE_MALLOC_GRAPHS = graphs
    return module


class _Operations(TorchDispatchMode):
    """The tensor operations run meanwhile, each with whether the graph was recording it."""

    def __init__(self, graph) -> None:
        super().__init__()
        self.graph = graph
        self.recorded: list[str] = []
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        if self.graph.recording:
            self.recorded.append(str(func))
        return func(*args, **kwargs or {})


def _run(monkeypatch, prefetch: ModuleType) -> SparseAttentionRun:
    """A run whose calls at layers 1 and 2 go sparse, opened (as a sampling run opens it) on a host with `prefetch`."""
    monkeypatch.setitem(__import__("sys").modules, "comfy.model_prefetch", prefetch)
    outside_graph, in_unpausable_graph = pack_module("host").malloc_graph_exit()
    settings = SparseAttentionSettings(dense_fraction=0.0, dense_first_blocks=1, dense_last_blocks=1, min_tokens=0,
                                       dense_above=1.0, tau=0.5, min_density=0.1, max_density=0.5)
    return SparseAttentionRun(settings=settings, video_tokens=VIDEO, first_frame_tokens=64, num_layers=4,
                              total_steps=4, outside_graph=outside_graph, in_unpausable_graph=in_unpausable_graph)


def _run_options(run: SparseAttentionRun, previous=None) -> dict:
    """The run's transformer_options with Carnator's hooks installed (chained to `previous`, the host's own
    override), text first, and the guider sampling with them."""
    hooks, keys = pack_module("attention_hooks"), pack_module("keys")
    carnator = pack_module("run_state").CarnatorRun(attention=run)
    options = {keys.RUN_KEY: carnator}
    if previous is not None:
        options["optimized_attention_override"] = previous
    guider = SimpleNamespace(model_options={"transformer_options": options})
    hooks._hook_into_run(options, carnator, torch.nn.Module(), guider)
    options[keys.TEXT_FIRST_KEY] = True
    return options


def _evaluation(options: dict, step: int, layer: int) -> dict:
    """One model evaluation's options, as the host copies them for a call, at a sampling step and block."""
    schedule = torch.linspace(1.0, 0.0, 5)
    return {**options, "sample_sigmas": schedule, "sigmas": schedule[step:step + 1].clone(),
            "block_index": layer}


def _tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of a joint text+video call, (B, N, H*D) with the text first, and a positional key mask."""
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, TEXT + VIDEO, HEADS * 64, generator=generator) for _ in range(3))
    mask = torch.ones(1, TEXT + VIDEO, dtype=torch.bool)
    mask[:, TEXT - 8:TEXT] = False  # padded text
    return q, k, v, mask


@pytest.mark.usefixtures("comfy")
@pytest.mark.parametrize("variant", ["pause_malloc_graph", "ACTIVE_MALLOC_GRAPHS"])
def test_every_tensor_of_a_sparse_call_is_made_while_the_graph_is_paused(monkeypatch, variant):
    attention = pytest.importorskip("comfy.ldm.modules.attention")
    graph = _Graph()
    run = _run(monkeypatch, _prefetch(variant, graph))
    options = _run_options(run)
    q, k, v, mask = _tokens()
    evaluation = _evaluation(options, 2, 2)
    operations = _Operations(graph)
    with operations:
        out = attention.optimized_attention(q, k, v, HEADS, mask, transformer_options=evaluation)
    assert run.sparse_calls == 1 and out.shape == q.shape and graph.paused == 0
    assert operations.count and operations.recorded == []


@pytest.mark.usefixtures("comfy")
@pytest.mark.parametrize("host_override", [False, True])
def test_a_graph_without_a_way_out_gives_the_runs_attention_back_at_once(monkeypatch, host_override):
    attention = pytest.importorskip("comfy.ldm.modules.attention")
    reached = []

    def previous(func, *args, **kwargs):
        reached.append(args[0].shape[1])
        return func(*args, **kwargs)

    expected = previous if host_override else None
    run = _run(monkeypatch, _prefetch("ACTIVE_MALLOC_GRAPHS", _GraphWithoutPause()))
    options = _run_options(run, expected)
    q, k, v, mask = _tokens()
    evaluation = _evaluation(options, 2, 1)
    attention.optimized_attention(q, k, v, HEADS, mask, transformer_options=evaluation)
    assert run.sparse_calls == 0 and run.inactive == GRAPHED_DENSE
    assert reached == ([TEXT + VIDEO] if host_override else [])  # the call itself: the host's attention
    # the rest of this evaluation, and every later one (read from the guider's options): the host's override or none
    assert evaluation.get("optimized_attention_override") is expected
    assert options.get("optimized_attention_override") is expected
    assert RunReport.of_sparse_attention(run, 0.0).reason == GRAPHED_DENSE

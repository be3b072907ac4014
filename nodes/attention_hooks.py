"""ComfyUI side of block-sparse attention: the attention override, block indices, per-run state.

- An OUTER_SAMPLE wrapper creates the run's `SparseAttentionRun` on a clone of the model
  options and drops it in `finally`. Only a run in which Carnator's attention can act (enough
  video tokens, no ComfyUI sparse attention on the model, no setup error) gets the two hooks
  below, on that clone: every other run samples with the model's attention exactly as the
  host would, its own override (if any) on the hook and its layers' preferred attention kept.
- `transformer_options["optimized_attention_override"]` routes every attention call of the
  diffusion model through `carnator_attention_override`; calls Carnator leaves dense go to
  the override that was there before (SageAttention and similar patch nodes) or to the function
  the model called. Where the host passes q, k and v in `AttentionTensorContainer`s and the override
  before Carnator's takes them (`container_function`), Carnator's takes them only for a sparse call
  and hands a dense one on in its containers; otherwise `wrap_attn` hands Carnator tensors.
- A sparse call makes every tensor of its own outside the host's malloc graph; a run inside a graph
  with no way out, or one a Carnator error turned dense, gives its attention back to the host at
  once (the override off the evaluation's and the run's options), layers' own attention included.
- Wan, HunyuanVideo and LTX-Video do not tell attention which block it is in, so every block
  gets a `patches_replace["dit"]` entry that sets the index (chaining to an existing entry).
- The engine takes joint text+video attention video first; for a model that puts the text
  first (HunyuanVideo's double and single blocks on newer hosts) the override moves the text
  behind the video for the call and the output back.

An error of Carnator's own code (`nodes.fault_boundary`) in the sparse path turns that call and the rest of the run
dense through the attention the host would have used; one while setting up leaves the run's attention dense.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time

import comfy.ldm.modules.attention
import comfy.patcher_extension
import torch

from carnator_core.attention.donor_masks import load_donor_masks
from carnator_core.attention.sparse_attention import (
    COMFYUI_SPARSE_ATTENTION,
    INACTIVE,
    SparseAttentionRun,
    SparseAttentionSettings,
)
from carnator_core.reuse.packed_latent import packed_shapes
from carnator_core.reuse.report import RunReport

from .fault_boundary import CarnatorFault, carnator_code, fault_of
from .host import (
    comfyui_sparse_attention,
    joint_attention_text_first,
    malloc_graph_exit,
    missing_hooks,
    note_bypassed_attention,
    outer_sample_arguments,
    patch_size,
    per_run_options,
    steps_of,
    store_at,
    unsupported_latent,
    video_token_grid,
)
from .keys import ATTENTION_DONOR_KEY, ATTENTION_SETTINGS_KEY, ATTENTION_WRAPPER_KEY, REUSE_SETTINGS_KEY, TEXT_FIRST_KEY
from .reports import publish
from .run_state import CarnatorRun, carnator_run, run_state

log = logging.getLogger("carnator")


def _block_lists(diffusion_model) -> list[tuple[str, int]]:
    """The ("double_block" | "single_block", i) keys of the model's transformer blocks, in execution order."""
    for attribute in ("blocks", "transformer_blocks"):  # Wan, LTX-Video
        if hasattr(diffusion_model, attribute):
            return [("double_block", i) for i in range(len(getattr(diffusion_model, attribute)))]
    keys = [("double_block", i) for i in range(len(getattr(diffusion_model, "double_blocks", [])))]
    return keys + [("single_block", i) for i in range(len(getattr(diffusion_model, "single_blocks", [])))]


def _index_patch(index: int, previous):
    def set_block_index(args, extra):
        carnator = run_state(args["transformer_options"])
        held = carnator.block if carnator is not None else None
        if carnator is not None:
            carnator.block = index
        try:
            return previous(args, extra) if previous is not None else extra["original_block"](args)
        finally:
            if carnator is not None:
                carnator.block = held

    return set_block_index


def install_sparse_attention(model, settings: SparseAttentionSettings, donor: tuple[str, str] | None = None):
    """A clone of `model` whose video self-attention runs block-sparse under `settings`, in the runs where it can."""
    model = model.clone()
    if missing_hooks():
        return model
    options = model.model_options["transformer_options"]
    options[ATTENTION_SETTINGS_KEY] = settings
    options[TEXT_FIRST_KEY] = joint_attention_text_first(model.get_model_object("diffusion_model"))
    if donor is not None:
        options[ATTENTION_DONOR_KEY] = donor
    model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, ATTENTION_WRAPPER_KEY, attention_outer_sample)
    return model


def _hook_into_run(options: dict, carnator: CarnatorRun, diffusion_model, guider) -> None:
    """Put Carnator's override and block indices into one run's cloned options, chaining to what is there."""
    note_bypassed_attention(diffusion_model)
    previous = options.get("optimized_attention_override")
    if previous is not None and previous not in CARNATOR_OVERRIDES:
        carnator.previous_override = previous
    takes_containers = hasattr(carnator.previous_override, "container_function")
    options["optimized_attention_override"] = (carnator_container_override if takes_containers
                                               else carnator_attention_override)
    carnator.withdraw = functools.partial(_withdraw_from_guider, guider)
    dit = options.setdefault("patches_replace", {}).setdefault("dit", {})
    for index, key in enumerate(_block_lists(diffusion_model)):
        dit[key] = _index_patch(index, dit.get(key))


def withdraw_sparse_attention(options: dict) -> None:
    """Give a run's attention back to the host: the override that was on the hook before Carnator's, or none."""
    if options.get("optimized_attention_override") not in CARNATOR_OVERRIDES:
        return
    carnator = run_state(options)
    previous = carnator.previous_override if carnator is not None else None
    if previous is None:
        options.pop("optimized_attention_override")
    else:
        options["optimized_attention_override"] = previous


def _withdraw_from_guider(guider) -> None:
    """`withdraw_sparse_attention` on the options the guider samples with now: the innermost run's clone (the reuse
    wrapper clones the attention wrapper's), which every later model evaluation of the run reads."""
    withdraw_sparse_attention(guider.model_options["transformer_options"])


def attention_outer_sample(executor, *args, **kwargs):
    """Create the run's attention state, sample, report; arguments the host adds later are passed on untouched."""
    guider = executor.class_obj
    call = outer_sample_arguments(args, kwargs)
    with per_run_options(guider) as options, carnator_run(options) as carnator:
        if carnator.sampling_plain_again:  # the run samples again plain after a Carnator error
            return executor(*args, **kwargs)
        patcher = guider.model_patcher
        try:
            with carnator_code("setting up sparse attention"):
                run, reason = _open_attention_run(options, patcher, call)
        except CarnatorFault as fault:
            fault.log_once("attention stays dense")
            run, reason = None, fault.line
        if run is None:  # attention stays dense; the reuse wrapper, when there is one, reports the run
            if REUSE_SETTINGS_KEY not in options:
                log.warning("Carnator: dense attention for this run: %s", reason)
                publish(RunReport.plain(f"attention/{options[ATTENTION_SETTINGS_KEY].source}", reason,
                                        steps_of(call["sigmas"]), 0, 0.0))
            return executor(*args, **kwargs)
        held = (carnator.attention, carnator.previous_override, carnator.withdraw)
        carnator.attention = run
        try:
            if not run.inactive:
                _hook_into_run(options, carnator, patcher.get_model_object("diffusion_model"), guider)
            started = time.perf_counter()
            output = executor(*args, **kwargs)
            try:
                with carnator_code("reporting sparse attention"):
                    settle(run, patcher)
                    if run.reports_itself:
                        publish(RunReport.of_sparse_attention(run, time.perf_counter() - started))
            except CarnatorFault as fault:
                fault.log_once("the run's attention is not reported; its output is unaffected")
            return output
        finally:
            carnator.attention, carnator.previous_override, carnator.withdraw = held


def _open_attention_run(options: dict, patcher, call: dict) -> tuple[SparseAttentionRun | None, str]:
    """The run's attention state, or None and why its attention stays dense."""
    reason = unsupported_latent(call)
    grid, reason = (None, reason) if reason else video_token_grid(call, patch_size(patcher))
    if grid is None:
        return None, reason
    outside_graph, in_unpausable_graph = malloc_graph_exit()
    run = SparseAttentionRun(settings=options[ATTENTION_SETTINGS_KEY], video_tokens=math.prod(grid),
                             first_frame_tokens=math.prod(grid[1:]) if len(grid) > 1 else 0,
                             joint_tokens=packed_shapes(call.get("latent_shapes")) is None,
                             num_layers=len(_block_lists(patcher.get_model_object("diffusion_model"))),
                             total_steps=steps_of(call["sigmas"]), outside_graph=outside_graph,
                             in_unpausable_graph=in_unpausable_graph)
    if not run.inactive and comfyui_sparse_attention(patcher, options):
        run.go_dense(COMFYUI_SPARSE_ATTENTION)
        log.info("Carnator: %s", COMFYUI_SPARSE_ATTENTION)
    donor = options.get(ATTENTION_DONOR_KEY)
    if donor is not None and not run.inactive:
        run.lend(load_donor_masks(store_at(donor[0]), donor[1]))
    return run, ""


def settle(run: SparseAttentionRun, patcher) -> None:
    """At the end of a sampling run: if no video self-attention reached the override, say who took it (once)."""
    if run.self_attention_calls == 0 and run.total_steps > 0 and not run.inactive:
        run.go_dense(INACTIVE.format(attention_patcher(patcher.get_model_object("diffusion_model"))))
        log.warning("Carnator: %s", run.inactive)


def attention_patcher(diffusion_model) -> str:
    """Who took video self-attention away from the override: the module of a replaced `forward` inside the model
    (a memory-efficient Sage patch of Wan's self-attention, say), else of a replaced optimized_attention."""
    for module in diffusion_model.modules():
        forward = module.__dict__.get("forward")  # set on the instance: a patch
        if forward is None and not type(module).__module__.startswith(("comfy.", "torch.")):
            forward = type(module).forward  # a module class swapped in from outside ComfyUI
        origin = getattr(getattr(forward, "__func__", forward), "__module__", None)
        if origin:
            return os.path.basename(origin)  # ComfyUI names a custom node pack's module by its directory
    optimized = getattr(comfy.ldm.modules.attention, "optimized_attention", None)
    origin = getattr(optimized, "__module__", "") or ""
    return os.path.basename(origin) if origin and not origin.startswith("comfy.") else "a patch outside the hook"


def _step_index(options: dict, run: SparseAttentionRun) -> int:
    """The sampling step of this call (`SparseAttentionRun.step_of`); 0 where the host passes no schedule."""
    sigma, schedule = options.get("sigmas"), options.get("sample_sigmas")
    if not isinstance(sigma, torch.Tensor) or not isinstance(schedule, torch.Tensor) or schedule.numel() == 0:
        return 0
    return run.step_of(sigma, schedule)


def _key_validity(mask, n_tokens: int) -> torch.Tensor | None | bool:
    """(N,) bool of keys that may receive attention, None for no mask, False for a mask we cannot honour."""
    if mask is None:
        return None
    if mask.shape[-1] != n_tokens or math.prod(mask.shape[:-1]) != 1:
        return False  # per-query or per-batch masks: leave the call dense
    flat = mask.reshape(-1)
    return flat if flat.dtype == torch.bool else flat > torch.finfo(flat.dtype).min / 2


def _block_index(options: dict, carnator: CarnatorRun) -> int | None:
    """The transformer block of this attention call: the host's own `block_index` where the model sets it (Wan and
    HunyuanVideo on newer hosts), else the one Carnator's block patches set."""
    return options.get("block_index") if carnator.block is None else carnator.block


# ComfyUI's attention functions' leading parameters, in order: a caller may pass any of them by position (core
# `CrossAttention` passes the mask so).
_ATTENTION_PARAMETERS = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape")


def _by_name(args: tuple, kwargs: dict) -> dict:
    """An attention call's arguments by name."""
    return {**kwargs, **dict(zip(_ATTENTION_PARAMETERS, args, strict=False))}


def _is_video_self_attention(run: SparseAttentionRun, queries: int, keys: int, mask) -> bool:
    """Whether a call attends the video's tokens among themselves: queries and keys alike, or a slice of the queries
    against all keys under a mask over them (LTX's guide-mask attention splits the queries so)."""
    if keys < run.video_tokens:
        return False
    if queries == keys:
        return True
    return queries < keys and isinstance(mask, torch.Tensor) and mask.shape[-1] == keys


def _give_back_attention(options: dict, carnator: CarnatorRun) -> None:
    """Once the run cannot act: Carnator's override off this evaluation's options (the calls still to come in it) and
    off the run's (every later evaluation), so the layers' own attention is theirs again."""
    withdraw_sparse_attention(options)
    if carnator.withdraw is not None:
        carnator.withdraw()


def _sparse_or_none(carnator: CarnatorRun | None, options: dict, args: tuple,
                    kwargs: dict) -> torch.Tensor | None:
    """The call's sparse attention, or None where it runs dense; a run that cannot act (a Carnator error, a malloc
    graph with no way out) is dense from here, its attention given back to the host."""
    run = carnator.attention if carnator is not None else None
    if run is None or carnator.sampling_plain_again:
        return None
    out = None
    try:
        if not run.inactive:
            out = _sparse_attention(run, carnator, options, args, kwargs)
    except Exception as error:
        fault = fault_of("running sparse attention", error)
        if fault is None:
            raise
        fault.log_once("this call and the rest of the run use dense attention")
        run.go_dense(f"dense attention: {fault.line}")
    if run.inactive:
        _give_back_attention(options, carnator)
    return out


def carnator_attention_override(func, *args, **kwargs):
    """The run's attention: a sparse call's block-sparse result; a dense one goes to the override before Carnator's,
    else to `func`, the function the model called."""
    options = kwargs.get("transformer_options") or {}
    carnator = run_state(options)
    out = _sparse_or_none(carnator, options, args, kwargs)
    if out is not None:
        return out
    previous = carnator.previous_override if carnator is not None else None
    return previous(func, *args, **kwargs) if previous is not None else func(*args, **kwargs)


def carnator_container_override(func, *args, **kwargs):
    """`carnator_attention_override` where the override before Carnator's takes q, k and v in the host's
    `AttentionTensorContainer`s (its `container_function`): `wrap_attn` then hands containers to this override's
    `container_function`, `_containers_to_previous`."""
    return carnator_attention_override(func, *args, **kwargs)


def _containers_to_previous(*args, **kwargs):
    """A sparse call takes the containers; a dense one goes in them to the previous override's `container_function`,
    as `wrap_attn` would hand it without Carnator's override."""
    options = kwargs.get("transformer_options") or {}
    carnator = run_state(options)
    tensors = tuple(container.peek() for container in args[:3])
    out = _sparse_or_none(carnator, options, tensors + args[3:], kwargs)
    if out is None:
        return carnator.previous_override.container_function(*args, **kwargs)
    for container in args[:3]:
        container.take()
    return out


carnator_container_override.container_function = _containers_to_previous
# Carnator's overrides. `carnator_attention_override` has no `container_function`, so `wrap_attn` hands it q, k and v
# as tensors together with the function the model called, which a dense call keeps.
CARNATOR_OVERRIDES = (carnator_attention_override, carnator_container_override)


def _sparse_attention(run: SparseAttentionRun, carnator: CarnatorRun, options: dict, args: tuple,
                      kwargs: dict) -> torch.Tensor | None:
    """The call's block-sparse attention in the layout the caller asked for, or None where it runs dense."""
    call = _by_name(args, kwargs)
    q, k, v = call.get("q"), call.get("k"), call.get("v")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None
    token_axis = 2 if call.get("skip_reshape", False) else 1
    queries, keys = q.shape[token_axis], k.shape[token_axis]
    if _is_video_self_attention(run, queries, keys, call.get("mask")):
        run.self_attention_calls += 1
    if call.get("enable_gqa", False) or call.get("low_precision_attention", True) is False:
        # grouped key/value heads (the sparse path takes one per query head), or a caller that asks for attention
        # as exact as the host's own
        return None
    layer = _block_index(options, carnator)
    # Cheap exits first: every call of a sampling run passes here, most of them dense (cross-attention,
    # early steps, edge blocks), and a miss should cost as little as possible over plain sampling.
    if queries != keys or not run.may_be_sparse(queries, layer, _step_index(options, run)) or call.get("heads") is None:
        run.dense_calls += 1
        return None
    if not run.can_step_out():
        run.dense_calls += 1
        return None
    with run.outside_graph():
        return _sparse_outside_graph(run, options, call, token_axis, layer)


def _sparse_outside_graph(run: SparseAttentionRun, options: dict, call: dict, token_axis: int,
                          layer: int) -> torch.Tensor | None:
    """`_sparse_attention` for a call that may be sparse, under the run's step-out of the host's malloc graph: every
    tensor made here (head views, key validity, the text rolled behind the video and back, the output layout) is
    Carnator's, none the graph's.

    The engine takes (B, H, N, D) tensors with the video tokens first; the text of a model that puts it first is
    rolled behind the video for the call and the output rolled back."""
    heads, step = call["heads"], _step_index(options, run)
    if token_axis == 2:
        q, k, v = call["q"], call["k"], call["v"]
    else:
        q, k, v = (x.view(x.shape[0], x.shape[1], heads, -1).transpose(1, 2) for x in (call["q"], call["k"], call["v"]))
    key_valid = _key_validity(call.get("mask"), k.shape[2])
    if key_valid is False:
        run.dense_calls += 1
        return None
    text = q.shape[2] - run.video_tokens if options.get(TEXT_FIRST_KEY) else 0
    if text > 0:
        q, k, v = (x.roll(-text, dims=2) for x in (q, k, v))
        key_valid = None if key_valid is None else key_valid.roll(-text)
    out = run.attend_outside_graph(q, k, v, heads, layer, step, key_valid, call.get("scale"))
    if out is None:
        return None
    if text > 0:
        out = out.roll(text, dims=2)
    if call.get("skip_output_reshape", False):
        return out
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)

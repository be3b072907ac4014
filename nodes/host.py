"""The bridge from ComfyUI objects to the plain data carnator_core works on.

Everything that needs to know how a ModelPatcher, a LATENT or a CONDITIONING is laid out
lives here, so the engine stays host-agnostic.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import comfy.ldm.modules.attention
import comfy.model_patcher
import comfy.patcher_extension
import folder_paths
import torch

from carnator_core import process_state
from carnator_core.lookup.fingerprint import (
    FingerprintError,
    StoredWeight,
    model_fingerprint,
    schedule_fingerprint,
    token_grid,
)
from carnator_core.reuse.packed_latent import PackedShapes, packed_shapes, packing_error
from carnator_core.store.entry import HardKey
from carnator_core.store.fleet_config import SETTINGS_FILE, configured_store_url
from carnator_core.store.location import open_store, resolve_store_location
from carnator_core.store.reuse_store import ReuseStore

from .fault_boundary import CarnatorFault, carnator_code

log = logging.getLogger("carnator")

_HOOKS = {
    "OUTER_SAMPLE / SAMPLER_SAMPLE / PREDICT_NOISE / CALC_COND_BATCH wrappers": lambda: all(
        hasattr(comfy.patcher_extension.WrappersMP, name)
        for name in ("OUTER_SAMPLE", "SAMPLER_SAMPLE", "PREDICT_NOISE", "CALC_COND_BATCH")),
    "ModelPatcher.add_wrapper_with_key / set_model_patch_replace": lambda: all(
        hasattr(comfy.model_patcher.ModelPatcher, name) for name in ("add_wrapper_with_key", "set_model_patch_replace")),
    "model options cloning": lambda: hasattr(comfy.model_patcher, "create_model_options_clone"),
    "the attention override (optimized_attention_override)": lambda: hasattr(comfy.ldm.modules.attention, "wrap_attn"),
}


def missing_hooks() -> tuple[str, ...]:
    """The supported hooks Carnator needs that this host lacks; found and logged once per process (`process_state`).
    Without them Carnator nodes pass the model on unchanged, so a host too new (or too old) samples plain instead of
    failing a prompt."""
    return process_state.one("missing hooks", _find_missing_hooks)


def _find_missing_hooks() -> tuple[str, ...]:
    missing = tuple(name for name, present in _HOOKS.items() if not present())
    if missing:
        log.error("Carnator: this ComfyUI lacks %s; Carnator nodes sample plain (no reuse, no recording)",
                  ", ".join(missing))
    return missing


def note_bypassed_attention(diffusion_model: torch.nn.Module) -> None:
    """Say once when a model's layers carry attention functions of their own (a host's per-layer `comfy_attention`,
    e.g. a quantized kernel): ComfyUI's `wrap_attn` drops a layer's `preferred_attention` before it calls an installed
    attention override, so in a run where Carnator's sparse attention acts, those layers' dense calls run ComfyUI's
    default attention. Runs where it does not act carry no override of Carnator's and keep them."""
    told: set[str] = process_state.one("host notes told", set)
    if "layer attention" in told:
        return
    if any(getattr(getattr(module, "comfy_attention", None), "function", None) is not None
           for module in diffusion_model.modules()):
        told.add("layer attention")
        log.warning("Carnator: this model's layers have attention functions of their own; in runs where Carnator's "
                    "sparse attention acts, their dense calls use ComfyUI's default attention instead")


# The key of the ON_PREPARE_STATE callback with which ComfyUI's "Model Sparse Attention" node
# (comfy_extras/nodes_sparse_attention.py) puts its attention override back on top every step.
COMFYUI_SPARSE_ATTENTION_KEY = "block_sparse_attention"


def comfyui_sparse_attention(model_patcher, transformer_options: dict) -> bool:
    """Whether the model carries ComfyUI's own block-sparse attention: that node's callback on the patcher, or its
    override on the hook."""
    prepare_state = getattr(comfy.patcher_extension.CallbacksMP, "ON_PREPARE_STATE", None)
    callbacks = getattr(model_patcher, "callbacks", None) or {}
    if prepare_state is not None and callbacks.get(prepare_state, {}).get(COMFYUI_SPARSE_ATTENTION_KEY):
        return True
    override = transformer_options.get("optimized_attention_override")
    return (getattr(override, "__module__", None) or "").rpartition(".")[2] == "nodes_sparse_attention"


def prompt_server():
    """ComfyUI's running server (`PromptServer.instance`), None where ComfyUI runs as a library without one."""
    try:
        from server import PromptServer
    except ImportError:
        return None
    return getattr(PromptServer, "instance", None)


def default_store_directory() -> str:
    """`<ComfyUI user directory>/carnator/store`: shared by every ComfyUI process on this base directory."""
    return os.path.join(folder_paths.get_user_directory(), "carnator", "store")


def configured_store() -> str | None:
    """The fleet store this worker's operator configured (CARNATOR_STORE_URL or the settings file), if any."""
    return configured_store_url(os.path.join(folder_paths.get_user_directory(), "carnator", SETTINGS_FILE))


def store_at(path: str = "", size_limit: int | None = None) -> ReuseStore:
    """Open the store a node asked for: a directory (base-directory rule), a Redis URL, or the default.

    The default is the configured fleet store, else the local directory. Remote stores keep a
    local read-through blob cache under `<user dir>/carnator/blob-cache`.
    """
    return open_store(store_location(path), size_limit,
                      os.path.join(folder_paths.get_user_directory(), "carnator", "blob-cache"))


def store_location(path: str = "") -> str:
    """Where `path` points: a directory (base-directory rule) or URL; empty is the configured, else local, store."""
    configured = configured_store()
    return resolve_store_location(path, folder_paths.base_path, configured or default_store_directory(), configured)


def _first_tensor(value) -> torch.Tensor | None:
    """The first tensor inside a weight patch (LoRA adapters, tuples, lists), for a cheap sample."""
    if isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "weights"):
        value = value.weights
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _stored_weight(name: str, weight: torch.Tensor) -> StoredWeight:
    """A weight as its loader stores it, read only through plain views of the stored data, never dequantized.

    city96's GGUF layers keep the file's blocks in a GGMLTensor (`tensor_type`: the GGUF quantization type) and
    dequantize in their forward; ComfyUI's quantized layers keep a QuantizedTensor's packed data and layout
    parameters (`_qdata`, `_layout_cls`, `_params`: fp8 scaled and mixed-precision checkpoints); every other weight
    is a plain tensor of its dtype. The format's name goes into the fingerprint, so Q8_0, Q4_0 and fp16 files of
    one model are three models.
    """
    quantization = getattr(weight, "tensor_type", None)
    if quantization is not None:
        layout = f"gguf:{getattr(quantization, 'name', quantization)}"
        return StoredWeight(name, layout, tuple(weight.shape), (weight.as_subclass(torch.Tensor),))
    packed = getattr(weight, "_qdata", None)
    if isinstance(packed, torch.Tensor):
        params = getattr(getattr(weight, "_params", None), "__dict__", {})
        scales = tuple(value for _, value in sorted(params.items()) if isinstance(value, torch.Tensor))
        layout = f"{getattr(weight, '_layout_cls', type(weight).__name__)}:{packed.dtype}"
        return StoredWeight(name, layout, tuple(weight.shape), (packed, *scales))
    return StoredWeight(name, str(weight.dtype), tuple(weight.shape), (weight.as_subclass(torch.Tensor),))


def _unpatched_weights(model_patcher) -> Iterator[StoredWeight]:
    """Diffusion-model weights as loaded, even while ComfyUI has a LoRA applied in place.

    Read from the parameters themselves: a layer's state_dict may hold placeholders (city96's GGUF layers save meta
    tensors there, for memory estimates).
    """
    backup = getattr(model_patcher, "backup", {}) or {}
    for name, weight in model_patcher.model.named_parameters():
        if not name.startswith("diffusion_model."):
            continue
        original = backup.get(name)
        yield _stored_weight(name, original.weight if original is not None else weight)


def fingerprint(model_patcher) -> str:
    """Fingerprint of the model as the sampler will run it (stored weights, the ops' fp8 optimisations, LoRAs and
    their strengths); a model whose weights cannot be read raises FingerprintError "model not fingerprinted: ...".

    Memoised per underlying model and patch set: ComfyUI renews `patches_uuid` whenever the
    patches change, so a cached value can never describe another patch set.
    """
    try:
        base_model = model_patcher.model
        memo_key = (id(base_model), str(model_patcher.patches_uuid))
    except AttributeError as error:
        raise FingerprintError(
            f"model not fingerprinted: not a ComfyUI model patcher: {type(model_patcher).__name__}") from error
    fingerprints: dict[tuple[int, str], str] = process_state.one("model fingerprints", dict)
    cached = fingerprints.get(memo_key)
    if cached is not None:
        return cached
    model_config = getattr(base_model, "model_config", None)
    config = dict(getattr(model_config, "unet_config", None) or {})
    optimizations = getattr(model_config, "optimizations", None)
    if optimizations:
        config["carnator.optimizations"] = dict(optimizations)
    patches = []
    for key, entries in model_patcher.patches.items():
        for entry in entries:
            strength_patch, patch, strength_model = entry[0], entry[1], entry[2]
            patches.append((key, float(strength_patch), float(strength_model), _first_tensor(patch)))
    try:
        value = model_fingerprint(type(base_model).__name__, config, _unpatched_weights(model_patcher), patches)
    except FingerprintError as error:
        raise FingerprintError(f"model not fingerprinted: {error}") from error
    except Exception as error:  # a weight Carnator cannot read is a miss, whatever the loader's tensor raised
        raise FingerprintError(f"model not fingerprinted: {type(error).__name__}: {error}") from error
    fingerprints[memo_key] = value
    return value


NOT_FINGERPRINTED = "model not fingerprinted"  # the clean-miss reason's prefix when the model cannot be fingerprinted


def checked_fingerprint(model_patcher) -> str:
    """`fingerprint`, or a FingerprintError "model not fingerprinted: <why>" whatever stopped it: a model whose
    weights Carnator cannot read (a loader's own tensors, weights not materialised) is a clean miss, never a failed
    prompt. An unexpected error is logged with its traceback."""
    try:
        with carnator_code("fingerprinting the model", expected=(FingerprintError,)):
            return fingerprint(model_patcher)
    except CarnatorFault as fault:
        fault.log_once("the run samples plain")
        why = fault.original
        raise FingerprintError(" ".join(f"{NOT_FINGERPRINTED}: {type(why).__name__}: {why}".split())) from why
    except FingerprintError as error:
        if str(error).startswith(NOT_FINGERPRINTED):
            raise
        raise FingerprintError(f"{NOT_FINGERPRINTED}: {error}") from error


def patch_size(model_patcher) -> tuple[int, ...] | int:
    """Patchify size of the diffusion model (Wan/Hunyuan (1, 2, 2); LTX-Video 1 via its patchifier)."""
    diffusion_model = model_patcher.model.diffusion_model
    size = getattr(diffusion_model, "patch_size", None)
    if size is None and hasattr(diffusion_model, "patchifier"):
        size = getattr(diffusion_model.patchifier, "patch_size", None)
    if size is None:
        return 1
    return int(size) if isinstance(size, int) else tuple(int(v) for v in size)


def joint_attention_text_first(diffusion_model) -> bool:
    """Whether the model's joint text+video attention puts the text tokens before the video tokens.

    ComfyUI's flux-style double blocks (HunyuanVideo) concatenate text, then video, unless built `flipped_img_txt`
    (a HunyuanVideo that puts the video first, in its single blocks too). Models without them (Wan, LTX) attend
    the video alone in self-attention.
    """
    blocks = getattr(diffusion_model, "double_blocks", None)
    return bool(blocks) and not getattr(blocks[0], "flipped_img_txt", False)


def hard_key(model_patcher, latent: torch.Tensor, sigmas: torch.Tensor | None = None,
             packed: PackedShapes | None = None, frame_rate: float = 0.0) -> HardKey:
    """Model fingerprint, token grid, frame rate and (when known) schedule of a request. A packed latent's grid is
    every part's grid in turn, so a donor with another audio length, or other video, never matches."""
    patch = patch_size(model_patcher)
    grid = sum((token_grid(shape, patch) for shape in packed), ()) if packed else token_grid(latent.shape, patch)
    return HardKey(model=checked_fingerprint(model_patcher), grid=grid, frame_rate=frame_rate,
                   schedule=schedule_fingerprint(sigmas) if sigmas is not None else "")


def conditioning_frame_rate(entries) -> float:
    """The frame rate an entry of the positive conditioning gives the model (LTXVConditioning sets it), 0 where none
    does. `entries` is a CONDITIONING list ([tensor, options] pairs) or a guider's conds (the options alone)."""
    for entry in entries:
        options = entry[1] if isinstance(entry, list | tuple) and len(entry) > 1 else entry
        value = options.get("frame_rate") if isinstance(options, dict) else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return 0.0


def conditioning_tensor(conditioning) -> torch.Tensor:
    """The cross-attention tensor of the first entry of a ComfyUI CONDITIONING list."""
    if not conditioning or not isinstance(conditioning[0][0], torch.Tensor):
        raise ValueError("positive conditioning is empty or not a ComfyUI CONDITIONING")
    return conditioning[0][0]


_OUTER_SAMPLE_PARAMETERS = ("noise", "latent_image", "sampler", "sigmas", "denoise_mask", "callback", "disable_pbar",
                            "seed")


def outer_sample_arguments(args: tuple, kwargs: dict) -> dict:
    """An OUTER_SAMPLE call's arguments by name, however the host passed them (keywords it added later included)."""
    return {**dict(zip(_OUTER_SAMPLE_PARAMETERS, args, strict=False)), **kwargs}


def unsupported_latent(call: dict) -> str:
    """Why Carnator cannot work on this run's latent ("" when it can). Several latents packed into one (LTX-2's
    audio + video) reach the sampler as a (B, 1, N) tensor with their shapes beside it: Carnator takes them when the
    shapes add up."""
    packed = packed_shapes(call.get("latent_shapes"))
    noise = call.get("noise")
    if packed is not None:
        problem = packing_error(packed, noise) if isinstance(noise, torch.Tensor) else "no noise tensor"
        return f"{problem}: sampled plain" if problem else ""
    if noise is not None and not isinstance(noise, torch.Tensor):  # e.g. a NestedTensor the host did not pack
        return f"latent of type {type(noise).__name__}, not one tensor: sampled plain"
    if isinstance(noise, torch.Tensor) and noise.ndim < 4:
        return f"latent of shape {tuple(noise.shape)} is not an image/video latent: sampled plain"
    return ""


def video_token_grid(call: dict, patch: tuple[int, ...] | int) -> tuple[tuple[int, ...] | None, str]:
    """The token grid of the run's video, which sparse attention takes, or None and why attention stays dense.

    In a packed run (LTX-2) the video is the one 5-D part. Its self-attention is told from the other parts' (the
    audio's) by its token count alone, so every other part must have fewer positions than the video has tokens.
    """
    noise, packed = call["noise"], packed_shapes(call.get("latent_shapes"))
    if packed is None:
        return token_grid(noise.shape, patch), ""
    videos = [shape for shape in packed if len(shape) == 5]
    if len(videos) != 1:
        return None, f"packed latent with {len(videos)} video parts: attention stays dense"
    grid = token_grid(videos[0], patch)
    if any(math.prod(shape[2:]) >= math.prod(grid) for shape in packed if shape is not videos[0]):
        return None, "packed latent whose other part has as many positions as its video has tokens: attention " \
                     "stays dense"
    return grid, ""


# deterministic samplers that take each step with their last few predictions (the cfg++ variants, which also read
# the unconditional prediction of each call, are left out): resumed, they replay the donor's (history_replay)
_MULTISTEP_SAMPLERS = frozenset({
    "sample_unipc", "sample_unipc_bh2", "sample_dpmpp_2m", "sample_deis", "sample_ipndm", "sample_ipndm_v",
    "sample_res_multistep", "sample_gradient_estimation", "sample_lms",
})


def keeps_history(sampler) -> bool:
    """Whether `sampler` (a ComfyUI KSAMPLER) steps with the history of its earlier predictions."""
    return getattr(getattr(sampler, "sampler_function", None), "__name__", None) in _MULTISTEP_SAMPLERS


def steps_of(sigmas: torch.Tensor) -> int:
    """Sampling steps of a sigma schedule."""
    return max(0, sigmas.numel() - 1)


def _outside_no_graph() -> bool:
    return False


def _pausable(graph) -> bool:
    return callable(getattr(graph, "pause", None)) and callable(getattr(graph, "resume", None))


@contextmanager
def _active_graph_paused(active_graphs: dict) -> Iterator[None]:
    """This thread's active malloc graph paused meanwhile, through the graph's own `pause`/`resume` (as the host's
    `prefetch_queue_pop` keeps its own buffers out of it); nothing where no graph is active."""
    graph = active_graphs.get(threading.get_ident())
    if not _pausable(graph):
        yield
        return
    graph.pause()
    try:
        yield
    finally:
        graph.resume()


def _in_graph_without_pause(active_graphs: dict) -> bool:
    graph = active_graphs.get(threading.get_ident())
    return graph is not None and not _pausable(graph)


def malloc_graph_exit() -> tuple[Callable[[], AbstractContextManager], Callable[[], bool]]:
    """How Carnator's tensors inside a model block stay out of the model compiler's malloc graph, as
    (context that steps out, whether this call is inside a graph it cannot step out of).

    `comfy.model_prefetch` (loaded by hosts that have the compiler) offers `pause_malloc_graph` in some versions; in
    others a block's graph is registered in `ACTIVE_MALLOC_GRAPHS` by thread, and Carnator pauses that graph itself.
    A graph there without `pause`/`resume` has no way out. A host without either has no graph.
    """
    prefetch = sys.modules.get("comfy.model_prefetch")
    pause = getattr(prefetch, "pause_malloc_graph", None)
    if callable(pause):
        return pause, _outside_no_graph
    active_graphs = getattr(prefetch, "ACTIVE_MALLOC_GRAPHS", None)
    if isinstance(active_graphs, dict):
        return (functools.partial(_active_graph_paused, active_graphs),
                functools.partial(_in_graph_without_pause, active_graphs))
    return nullcontext, _outside_no_graph


@contextmanager
def per_run_options(guider) -> Iterator[dict]:
    """The guider's model options cloned for one sampling run (as EasyCache does), restored afterwards.

    Yields the clone's transformer_options, where per-run state lives and dies with the run.
    """
    original = guider.model_options
    guider.model_options = comfy.model_patcher.create_model_options_clone(original)
    try:
        yield guider.model_options["transformer_options"]
    finally:
        guider.model_options = original

"""Test-only ComfyUI node pack: stands in for a text encoder and reports latents.

There is no real text encoder at test size, so `HarnessTextConditioning` turns prompt text into
CONDITIONING of the width each tiny model consumes: one seeded vector per word, so prompts that
share words share tokens and their mean-pooled conditioning is similar (which lookup tests need).
`HarnessLatentStats` is an output node that puts a latent's shape and statistics into the
execution history, so a graph run through the real executor or the HTTP API can be checked.
`HarnessNewerHostArgument` stands in for a newer host: its OUTER_SAMPLE and SAMPLER_SAMPLE wrappers add a
keyword argument no released ComfyUI passes (mode "add", outside Carnator's wrappers) and take it off again
(mode "take", inside them), counting what arrived, so a test sees whether the wrappers in between pass it on.
`HarnessBypassAttentionOverride` stands in for packs that replace a model's self-attention (memory-efficient Sage
patches of Wan's self-attention): an object patch of every block's `self_attn.forward` that runs it without the
`optimized_attention_override` hook, as those patches do. `HarnessCountCalls` counts a model's diffusion-model
forwards (`model_calls`, by label), so a test sees which model ran how often without trusting Carnator's own count.
`HarnessAttentionHooks` records the attention override a run samples with, puts another pack's override on the
hook, or installs what ComfyUI's "Model Sparse Attention" node installs (its override, and its ON_PREPARE_STATE
callback under that node's key that puts it back on top every step), declining every call as that node does off CUDA.
`HarnessFailingPostCfg` stands in for a host step that fails once: a post-CFG function that raises at its n-th call
(counted by label) and passes the output through otherwise.
Both are ordinary V3 nodes loaded by ComfyUI's own custom-node loader, next to the Carnator pack.
`CARNATOR_HARNESS_FAULT` ("module:Attribute.path" of a carnator_core function) makes that function raise
`RuntimeError("injected fault")` in a server process, as monkeypatch does in-process (tests/server/test_fault_boundary_server.py).
"""

import functools
import hashlib
import importlib
import os

import torch
from comfy_api.latest import ComfyExtension, io

# Conditioning widths of the text encoders the real models ship with (tests/tiny_models.py matches them).
_TEXT_DIM = 4096  # umt5-xxl (Wan), llama (HunyuanVideo), t5-xxl (LTX-Video)
_POOLED_DIM = 768  # CLIP-L pooled output (HunyuanVideo)
FAMILIES = ["wan", "hunyuan_video", "ltxv"]


def _word_vector(family: str, word: str, seed: int, dim: int, kind: str) -> torch.Tensor:
    digest = hashlib.sha256(f"{family}|{kind}|{seed}|{word}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.randn(dim, generator=generator)


def text_conditioning(text: str, family: str, seed: int = 0) -> list:
    """CONDITIONING for `text`: tokens are per-word seeded vectors (an empty text is one empty token)."""
    words = text.lower().split() or [""]
    tokens = torch.stack([_word_vector(family, w, seed, _TEXT_DIM, "token") for w in words]).unsqueeze(0)
    extras = {}
    if family == "hunyuan_video":
        pooled = torch.stack([_word_vector(family, w, seed, _POOLED_DIM, "pooled") for w in words]).mean(0)
        extras["pooled_output"] = pooled.unsqueeze(0)
    if family == "ltxv":  # LTX-Video's T5 encoder always returns a token mask and the model requires one
        extras["attention_mask"] = torch.ones((1, len(words)), dtype=torch.int64)
    return [[tokens, extras]]


class HarnessTextConditioning(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HarnessTextConditioning",
            category="testing/harness",
            inputs=[
                io.String.Input("text", multiline=True, default="", tooltip="Prompt text; each word is one token."),
                io.Combo.Input("family", options=FAMILIES, tooltip="Model family whose text encoder is imitated."),
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1, tooltip="Seed of the word vectors."),
            ],
            outputs=[io.Conditioning.Output()],
        )

    @classmethod
    def execute(cls, text: str, family: str, seed: int = 0) -> io.NodeOutput:
        return io.NodeOutput(text_conditioning(text, family, seed))


class HarnessLatentStats(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HarnessLatentStats",
            category="testing/harness",
            inputs=[io.Latent.Input("latent", tooltip="Latent to summarise.")],
            outputs=[],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, latent: dict) -> io.NodeOutput:
        samples = latent["samples"].float()
        stats = {
            "shape": list(samples.shape),
            "finite": bool(torch.isfinite(samples).all()),
            "mean": float(samples.mean()),
            "std": float(samples.std()) if samples.numel() > 1 else 0.0,
            "abs_max": float(samples.abs().max()),
        }
        return io.NodeOutput(ui={"latent_stats": [stats]})


NEWER_HOST_KEYWORD = "harness_newer_host_argument"
newer_host_arrivals: dict[str, int] = {"OUTER_SAMPLE": 0, "SAMPLER_SAMPLE": 0}


def _newer_host_wrapper(kind: str, mode: str):
    def wrapper(executor, *args, **kwargs):
        if mode == "add":
            return executor(*args, **kwargs, **{NEWER_HOST_KEYWORD: kind})
        if kwargs.pop(NEWER_HOST_KEYWORD, None) == kind:
            newer_host_arrivals[kind] += 1
        return executor(*args, **kwargs)

    return wrapper


class HarnessNewerHostArgument(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HarnessNewerHostArgument",
            category="testing/harness",
            inputs=[io.Model.Input("model", tooltip="Model to wrap."),
                    io.Combo.Input("mode", options=["add", "take"], tooltip="add: outer wrappers add the keyword; "
                                   "take: inner wrappers remove it and count its arrival.")],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, mode: str) -> io.NodeOutput:
        import comfy.patcher_extension

        model = model.clone()
        for kind in newer_host_arrivals:
            model.add_wrapper_with_key(getattr(comfy.patcher_extension.WrappersMP, kind), f"harness_{mode}",
                                       _newer_host_wrapper(kind, mode))
        return io.NodeOutput(model)


def _without_override(forward):
    def patched_forward(*args, **kwargs):
        options = dict(kwargs.get("transformer_options") or {})
        options.pop("optimized_attention_override", None)
        return forward(*args, **{**kwargs, "transformer_options": options})

    return patched_forward


class HarnessBypassAttentionOverride(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HarnessBypassAttentionOverride",
            category="testing/harness",
            inputs=[io.Model.Input("model", tooltip="A Wan-family model whose self-attention gets replaced.")],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model) -> io.NodeOutput:
        model = model.clone()
        blocks = model.get_model_object("diffusion_model").blocks
        for index, block in enumerate(blocks):
            model.add_object_patch(f"diffusion_model.blocks.{index}.self_attn.forward",
                                   _without_override(block.self_attn.forward))
        return io.NodeOutput(model)


model_calls: dict[str, int] = {}  # forwards of the diffusion model, by HarnessCountCalls label


def _counting_wrapper(label: str):
    def wrapper(executor, *args, **kwargs):
        model_calls[label] = model_calls.get(label, 0) + 1
        return executor(*args, **kwargs)

    return wrapper


class HarnessCountCalls(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HarnessCountCalls",
            category="testing/harness",
            inputs=[io.Model.Input("model", tooltip="Model whose diffusion-model forwards are counted."),
                    io.String.Input("label", tooltip="Name the count is kept under (`model_calls`).")],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, label: str) -> io.NodeOutput:
        import comfy.patcher_extension

        model = model.clone()
        model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, f"harness_count_{label}",
                                   _counting_wrapper(label))
        return io.NodeOutput(model)


# What `HarnessAttentionHooks` saw: the attention override on the hook of every CALC_COND_BATCH call ("probe"), and the
# attention calls of each stand-in override by its name.
seen_overrides: list = []
override_calls: dict[str, int] = {}


def other_pack_override(func, *args, **kwargs):
    """An attention pack's override (SageAttention-style patch nodes): the call, through the function it is given."""
    override_calls["other pack"] = override_calls.get("other pack", 0) + 1
    return func(*args, **kwargs)


def _comfyui_sparse_attention_override(previous):
    """Stands in for the override of ComfyUI's "Model Sparse Attention" (comfy_extras/nodes_sparse_attention.py) off
    CUDA: every call declined ("not on CUDA") and handed on to the override before it, else to ComfyUI's attention."""
    def override(func, *args, **kwargs):
        override_calls["comfyui sparse"] = override_calls.get("comfyui sparse", 0) + 1
        return func(*args, **kwargs) if previous is None else previous(func, *args, **kwargs)

    return override


def _put_on_top(installed: set, transformer_options: dict) -> None:
    """As that node's `install_override`: its override on top of whatever is on the hook, idempotent once there."""
    current = transformer_options.get("optimized_attention_override")
    if current in installed:
        return
    override = _comfyui_sparse_attention_override(current)
    installed.add(override)
    transformer_options["optimized_attention_override"] = override


def _probe(executor, *args, **kwargs):
    model_options = args[4] if len(args) > 4 else kwargs["model_options"]
    seen_overrides.append(model_options.get("transformer_options", {}).get("optimized_attention_override"))
    return executor(*args, **kwargs)


class HarnessAttentionHooks(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HarnessAttentionHooks",
            category="testing/harness",
            inputs=[io.Model.Input("model", tooltip="Model to patch."),
                    io.Combo.Input("hook", options=["probe", "other pack override", "comfyui sparse attention"],
                                   tooltip="probe: record the override on the hook at every CALC_COND_BATCH call; "
                                           "other pack override: put `other_pack_override` on the hook; comfyui "
                                           "sparse attention: what ComfyUI's Model Sparse Attention node installs, "
                                           "its override and its ON_PREPARE_STATE callback under its key.")],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, hook: str) -> io.NodeOutput:
        import comfy.patcher_extension

        model = model.clone()
        options = model.model_options["transformer_options"]
        if hook == "probe":
            model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.CALC_COND_BATCH, "harness_probe", _probe)
        elif hook == "other pack override":
            options["optimized_attention_override"] = other_pack_override
        else:
            installed: set = set()
            _put_on_top(installed, options)

            def on_prepare_state(model_patcher, timestep, model_options=None):  # hosts without model_options: none
                if model_options is not None:
                    _put_on_top(installed, model_options["transformer_options"])

            model.add_callback_with_key(comfy.patcher_extension.CallbacksMP.ON_PREPARE_STATE, "block_sparse_attention",
                                        on_prepare_state)
        return io.NodeOutput(model)


post_cfg_calls: dict[str, int] = {}  # `HarnessFailingPostCfg`'s calls, by label
HOST_GLITCH = "host glitch"


def _failing_post_cfg(label: str, fail_at: int):
    def post_cfg(args: dict):
        post_cfg_calls[label] = post_cfg_calls.get(label, 0) + 1
        if post_cfg_calls[label] == fail_at:
            raise RuntimeError(HOST_GLITCH)
        return args["denoised"]

    return post_cfg


class HarnessFailingPostCfg(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HarnessFailingPostCfg",
            category="testing/harness",
            inputs=[io.Model.Input("model", tooltip="Model whose CFG path gains the post-CFG function."),
                    io.String.Input("label", tooltip="Name its calls are counted under (`post_cfg_calls`)."),
                    io.Int.Input("fail_at", default=0, min=0, tooltip="The call that raises (0: none).")],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, label: str, fail_at: int) -> io.NodeOutput:
        model = model.clone()
        model.set_model_sampler_post_cfg_function(_failing_post_cfg(label, fail_at))
        return io.NodeOutput(model)


INJECTED_FAULT = "injected fault"


def _inject_fault(target: str) -> None:
    """Replace the carnator_core function `target` names ("module:Attribute.path") by one that raises."""
    module_name, _, path = target.partition(":")
    *owners, name = path.split(".")
    owner = functools.reduce(getattr, owners, importlib.import_module(module_name))

    def injected(*args, **kwargs):
        raise RuntimeError(INJECTED_FAULT)

    setattr(owner, name, injected)


if os.environ.get("CARNATOR_HARNESS_FAULT"):
    _inject_fault(os.environ["CARNATOR_HARNESS_FAULT"])


class HarnessExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [HarnessTextConditioning, HarnessLatentStats, HarnessNewerHostArgument, HarnessBypassAttentionOverride,
                HarnessCountCalls, HarnessAttentionHooks, HarnessFailingPostCfg]


async def comfy_entrypoint() -> HarnessExtension:
    return HarnessExtension()

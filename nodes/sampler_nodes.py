"""Sampler-shaped entry points to the same reuse engine: a drop-in KSampler and a SAMPLER wrapper."""

from __future__ import annotations

import logging

import comfy.patcher_extension
import comfy.samplers
import nodes as comfy_nodes
from comfy_api.latest import io

from .host import missing_hooks, per_run_options
from .keys import REUSE_SETTINGS_KEY, REUSE_WRAPPER_KEY
from .model_call_wrappers import calc_cond_batch_wrapper, predict_noise_wrapper
from .reuse_lifecycle import failure_to_sample_again, open_run, reuse_lifecycle, sample_plain_again
from .reuse_nodes import (
    GRAPH_HIDDEN,
    exact_repeats_input,
    graph_prompt_fingerprint,
    install_from_inputs,
    model_level_inputs,
    probe_batch_input,
    reuse_inputs,
    settings_from_inputs,
    with_graph_prompt,
)
from .sampler_preparation import sample_with_run
from .types import MatchType

log = logging.getLogger("carnator")


class CarnatorKSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorKSampler",
            display_name="Carnator KSampler",
            category="Carnator/sampling",
            description="KSampler with Carnator reuse built in: same inputs and output as ComfyUI's KSampler.",
            inputs=[
                io.Model.Input("model", tooltip="The model used for denoising the input latent."),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                             tooltip="The random seed used for creating the noise."),
                io.Int.Input("steps", default=20, min=1, max=10000, tooltip="The number of denoising steps."),
                io.Float.Input("cfg", default=8.0, min=0.0, max=100.0, step=0.1, round=0.01,
                               tooltip="Classifier-free guidance scale."),
                io.Combo.Input("sampler_name", options=comfy.samplers.KSampler.SAMPLERS,
                               tooltip="The sampling algorithm."),
                io.Combo.Input("scheduler", options=comfy.samplers.KSampler.SCHEDULERS,
                               tooltip="How noise is removed over the steps."),
                io.Conditioning.Input("positive", tooltip="What to include in the video."),
                io.Conditioning.Input("negative", tooltip="What to exclude from the video."),
                io.Latent.Input("latent_image", tooltip="The latent to denoise."),
                io.Float.Input("denoise", default=1.0, min=0.0, max=1.0, step=0.01,
                               tooltip="Amount of denoising; below 1 latent reuse is off (sparsity reuse stays)."),
            ] + model_level_inputs(),
            outputs=[io.Latent.Output(display_name="LATENT")],
            hidden=GRAPH_HIDDEN,
        )

    @classmethod
    def execute(cls, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
                denoise=1.0, **options) -> io.NodeOutput:
        reusing = install_from_inputs(model, **with_graph_prompt(cls, options))
        (latent,) = comfy_nodes.common_ksampler(reusing, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                                                latent_image, denoise=denoise)
        return io.NodeOutput(latent)


class ReuseSampler(comfy.samplers.Sampler):
    """A SAMPLER that runs another SAMPLER under Carnator reuse (for SamplerCustom/SamplerCustomAdvanced)."""

    def __init__(self, inner: comfy.samplers.Sampler, settings, match) -> None:
        self.inner, self.settings, self.match = inner, settings, match

    def max_denoise(self, model_wrap, sigmas):
        return self.inner.max_denoise(model_wrap, sigmas)

    def sample(self, guider, sigmas, extra_args, callback, noise, latent_image=None, denoise_mask=None,
               disable_pbar=False):
        model_options = extra_args["model_options"]
        plain = (guider, sigmas, extra_args, callback, noise, latent_image, denoise_mask, disable_pbar)
        if missing_hooks():
            return self.inner.sample(*plain)
        if REUSE_SETTINGS_KEY in model_options.get("transformer_options", {}):
            log.warning("Carnator: the model already goes through a Carnator Reuse node; the reuse sampler defers to it")
            return self.inner.sample(*plain)
        wrappers = comfy.patcher_extension.WrappersMP
        comfy.patcher_extension.add_wrapper_with_key(wrappers.CALC_COND_BATCH, REUSE_WRAPPER_KEY, calc_cond_batch_wrapper,
                                                     model_options, is_model_options=True)
        with per_run_options(guider) as guider_options:
            comfy.patcher_extension.add_wrapper_with_key(wrappers.PREDICT_NOISE, REUSE_WRAPPER_KEY, predict_noise_wrapper,
                                                         guider.model_options, is_model_options=True)
            # packed latents: the guider's model holds their shapes while it samples (CFGGuider.inner_sample)
            call = {"noise": noise, "latent_image": latent_image, "sigmas": sigmas, "denoise_mask": denoise_mask,
                    "seed": extra_args.get("seed"), "sampler": self.inner,
                    "latent_shapes": getattr(getattr(guider, "inner_model", None), "latent_shapes", None)}
            state = open_run(guider, self.settings, call)
            run_options = (guider_options, model_options["transformer_options"])
            with reuse_lifecycle(guider, state, sigmas, *run_options) as carnator:
                if state.run is None:
                    return self.inner.sample(*plain)
                try:
                    return sample_with_run(self.inner.sample, self.inner, carnator, *plain, match=self.match)
                except Exception as error:
                    fault = failure_to_sample_again(carnator, error)
                    if fault is None:
                        raise
                    sample_plain_again(carnator, fault, "sampled again plain from the start", *run_options)
                    return self.inner.sample(*plain)


class CarnatorReuseSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorReuseSampler",
            display_name="Carnator Reuse Sampler",
            category="Carnator/sampling",
            description="Wraps a SAMPLER (e.g. from KSamplerSelect) for SamplerCustom / SamplerCustomAdvanced so it "
                        "reuses compatible earlier generations; takes the candidates of a Carnator Compatibility "
                        "Lookup when connected.",
            inputs=[io.Sampler.Input("sampler", tooltip="The sampler to run under Carnator reuse."),
                    MatchType.Input("match", optional=True,
                                    tooltip="Candidates from Carnator Compatibility Lookup; without it the "
                                            "sampler looks them up itself.")]
                   + reuse_inputs() + [probe_batch_input(), exact_repeats_input()],
            outputs=[io.Sampler.Output(display_name="SAMPLER")],
            hidden=GRAPH_HIDDEN,
        )

    @classmethod
    def fingerprint_inputs(cls, **inputs) -> str:
        return graph_prompt_fingerprint()

    @classmethod
    def execute(cls, sampler, match=None, **options) -> io.NodeOutput:
        settings = settings_from_inputs(**with_graph_prompt(cls, options))
        if match is not None and not settings.store_location:
            settings = settings.replace(store_location=match.store_location)
        return io.NodeOutput(ReuseSampler(sampler, settings, match))

"""Stochastic samplers resumed with the plain run's noise: a resumed run draws what the plain run draws from there on.

ComfyUI's ancestral and SDE samplers draw fresh noise as they go, from a noise sampler they build from the run's seed
and the schedule they are given. Resumed at step k on the schedule's tail, they would build it anew: ancestral
samplers (one draw per step from `default_noise_sampler`) would draw the plain run's first noises instead of those
from step k, and SDE samplers (a Brownian tree spanning the schedule) a tree spanning only the tail. Either way the
remaining steps would differ from the plain run's by more than the resume does. For the samplers whose noise is
known, the resumed run is handed the plain run's own noise sampler instead: the ancestral one advanced by the k draws
the skipped steps made, the tree built on the whole schedule. Any other sampler (deterministic ones need none; an
unknown one is left as it is) samples unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import comfy.k_diffusion.sampling as k_sampling
import comfy.patcher_extension
import torch

# k-diffusion samplers that draw one noise per step from `default_noise_sampler` (the RF variants they hand over to
# for flow models too), before the last step
ONE_DRAW_PER_STEP = frozenset({"sample_euler_ancestral", "sample_dpm_2_ancestral", "sample_dpmpp_2s_ancestral"})
# k-diffusion samplers that build a Brownian tree over the schedule's (smallest positive, largest) sigma, and whether
# they build it on the CPU
BROWNIAN_TREE_ON_CPU = {"sample_dpmpp_sde": True, "sample_dpmpp_2m_sde": True, "sample_dpmpp_2m_sde_heun": True,
                        "sample_dpmpp_3m_sde": True, "sample_dpmpp_sde_gpu": False, "sample_dpmpp_2m_sde_gpu": False,
                        "sample_dpmpp_2m_sde_heun_gpu": False, "sample_dpmpp_3m_sde_gpu": False}


def plain_noise_sampler(sampler, seed: int | None, sigmas: torch.Tensor, skipped: int,
                        like: torch.Tensor) -> Callable | None:
    """The noise sampler the plain run of `sampler` over the whole schedule `sigmas` uses from step `skipped` on, for
    a state shaped like `like`; None where the sampler's noise is unknown, seedless or already chosen by the user."""
    name = getattr(getattr(sampler, "sampler_function", None), "__name__", None)
    options = getattr(sampler, "extra_options", None)
    if seed is None or skipped <= 0 or not isinstance(options, dict) or "noise_sampler" in options:
        return None
    if name in ONE_DRAW_PER_STEP:
        noise_sampler = k_sampling.default_noise_sampler(like, seed=seed)
        for _ in range(skipped):
            noise_sampler(None, None)
        return noise_sampler
    if name in BROWNIAN_TREE_ON_CPU:
        return k_sampling.BrownianTreeNoiseSampler(like, sigmas[sigmas > 0].min(), sigmas.max(), seed=seed,
                                                   cpu=BROWNIAN_TREE_ON_CPU[name])
    return None


def with_plain_noise(sample: Callable, sampler, noise_sampler: Callable) -> Callable:
    """`sample` (the SAMPLER_SAMPLE executor handed to a wrapper, or the sampler's own bound `sample`) running a copy
    of `sampler` whose extra options hand it `noise_sampler`; the sampler itself is left unchanged."""
    resumed = copy.copy(sampler)
    resumed.extra_options = {**sampler.extra_options, "noise_sampler": noise_sampler}
    if isinstance(sample, comfy.patcher_extension.WrapperExecutor):  # the wrappers after this one still run
        executor = comfy.patcher_extension.WrapperExecutor.new_class_executor(resumed.sample, resumed, sample.wrappers,
                                                                             sample.idx + 1)
        return executor.execute
    return resumed.sample

"""The SAMPLER_SAMPLE wrapper: asks the engine with the live model as its evaluation and prepares the sampler from
the outcome (the donor stage's output, a resume with or without a replayed history, or a fresh start), with the step
callback that records the run and the step-cache copies the probes evaluate under."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import comfy.model_management
import torch

from carnator_core.reuse.cached_evaluation import CachedEvaluation
from carnator_core.reuse.decision import Evaluate
from carnator_core.reuse.exact_repeat import ExactRepeat, RepeatConfirmed, RepeatDiffers, prediction_digest
from carnator_core.reuse.outcome import Resume, ServedEvaluation, SkipStage
from carnator_core.reuse.settings import ReuseSettings

from .exact_key import exact_key
from .fault_boundary import CarnatorFault, carnator_code, host_code
from .host import keeps_history
from .noise_continuation import plain_noise_sampler, with_plain_noise
from .reuse_holder import ReuseHolder
from .reuse_lifecycle import active_reuse, sample_plain_again, stop_recording
from .run_state import CarnatorRun, run_state

STEP_CACHE_KEY = "easycache"  # where ComfyUI's EasyCache and LazyCache keep their per-run state


@contextlib.contextmanager
def fresh_step_cache(model_options: dict, guider) -> Iterator[object | None]:
    """Give a probe evaluation its own fresh copy of ComfyUI's EasyCache/LazyCache state; yields the copy.

    Those caches follow the sampler's calls in order and may answer a call with an extrapolation. A probe is
    out of order (a deep state, before step 0), must be a true model evaluation, and a rejected one must leave
    the run's cache as it found it: otherwise a rejected probe at a low sigma followed by step 0 at sigma 1
    breaks EasyCache's bookkeeping (its rate of change is computed from a history the probe emptied). The copy is made
    with the cache's own clone/prepare_timesteps, as its OUTER_SAMPLE wrapper does for every run; the caller
    adopts the accepted probe's copy, whose history is exactly the evaluation the resumed run starts from.
    """
    options = model_options["transformer_options"]
    holder = options.get(STEP_CACHE_KEY)
    if holder is None or not hasattr(holder, "clone") or not hasattr(holder, "prepare_timesteps"):
        yield None
        return
    copy = holder.clone().prepare_timesteps(guider.model_patcher.model.model_sampling)
    options[STEP_CACHE_KEY] = copy
    try:
        yield copy
    finally:
        options[STEP_CACHE_KEY] = holder


def probe_batch_limit(guider, noise: torch.Tensor, settings: ReuseSettings) -> int:
    """Donor states per probe call (`ReuseSettings.probe_batch_limit`), with ComfyUI's own cond-batching memory
    rule: model.memory_required x 1.5 < free memory, free memory as the patcher counts it where it can (hosts with
    dynamic VRAM add what their allocator can release)."""
    model = guider.model_patcher.model

    def fits(states: int) -> bool:
        free_memory = getattr(guider.model_patcher, "get_free_memory", comfy.model_management.get_free_memory)
        shape = [2 * states * noise.shape[0], *noise.shape[1:]]  # cond and uncond of each state
        return model.memory_required(shape) * 1.5 < free_memory(noise.device)

    return settings.probe_batch_limit(noise.device.type == "cpu", fits)


def _start_state(guider, sigma: float, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(noise, latent) that the sampler's own noise scaling turns into `state` at `sigma`.

    Samplers start from model_sampling.noise_scaling(sigma, noise, latent), linear in both:
    a*noise + b*latent. With noise = latent = state / (a + b) the start is `state` (to rounding)
    for flow (a + b = 1) and EPS models alike.
    """
    model_sampling = guider.inner_model.model_sampling
    sigma_t = torch.tensor(sigma, device=state.device, dtype=state.dtype)
    ones = torch.ones_like(state[:1, :1])
    a = model_sampling.noise_scaling(sigma_t, ones, torch.zeros_like(ones))
    b = model_sampling.noise_scaling(sigma_t, torch.zeros_like(ones), ones)
    start = state / (a + b)
    return start, start


def sampler_sample_wrapper(executor, guider, sigmas, extra_args, callback, noise, *args, **kwargs):
    carnator = run_state(extra_args["model_options"]["transformer_options"])
    if active_reuse(extra_args["model_options"]["transformer_options"]) is None or carnator.reuse.run is None:
        return executor(guider, sigmas, extra_args, callback, noise, *args, **kwargs)
    named = {**dict(zip(("latent_image", "denoise_mask", "disable_pbar"), args, strict=False)), **kwargs}
    return sample_with_run(executor, executor.class_obj, carnator, guider, sigmas, extra_args, callback, noise, **named)


def sample_with_run(sample, sampler, carnator: CarnatorRun, guider, sigmas, extra_args, callback, noise,
                    latent_image=None, denoise_mask=None, disable_pbar=False, match=None, **passed_on):
    """Probe, maybe resume, and sample through `sample` (the sampler's own sample call) while recording.
    Arguments a newer host adds (`passed_on`) go to `sample` untouched.

    A Carnator error before sampling starts leaves the run plain: `sample` with the arguments as given. One while
    sampling raises a `CarnatorFault` to the entry point, which samples the run again plain.
    """
    state = carnator.reuse
    try:
        with carnator_code("probing donors"):
            prepared = _prepare_sampling(sample, sampler, carnator, guider, sigmas, extra_args, callback, noise,
                                         latent_image, match, denoise_mask)
    except CarnatorFault as fault:
        sample_plain_again(carnator, fault, "sampled plain", extra_args["model_options"]["transformer_options"],
                           guider.model_options["transformer_options"])
        return sample(guider, sigmas, extra_args, callback, noise, latent_image, denoise_mask, disable_pbar,
                      **passed_on)
    if isinstance(prepared, torch.Tensor):  # the stage is skipped whole: the donor's output
        return prepared
    if isinstance(prepared, ExactRepeat):  # sampled fresh until its first prediction confirms or refutes the repeat
        try:
            return _sample_repeat(prepared, sample, guider, sigmas, extra_args, callback, noise, latent_image,
                                  denoise_mask, disable_pbar, passed_on)
        except RepeatDiffers:  # another bit: the usual decision, from the start (the first call counted)
            prepared = _prepare_sampling(sample, sampler, carnator, guider, sigmas, extra_args, callback, noise,
                                         latent_image, match, denoise_mask, exact=False)
            if isinstance(prepared, torch.Tensor):
                return prepared
    sample, sigmas, noise, latent_image, step_callback = prepared
    output = sample(guider, sigmas, extra_args, step_callback, noise, latent_image, denoise_mask, disable_pbar,
                    **passed_on)
    if state.run is not None:
        try:
            with carnator_code("recording the run's output"):
                state.run.observe_end(float(sigmas[-1]), output)
        except CarnatorFault as fault:
            stop_recording(state, fault)
    return output


def _prepare_sampling(sample, sampler, carnator: CarnatorRun, guider, sigmas, extra_args, callback, noise,
                      latent_image, match, denoise_mask, exact: bool = True):
    """Ask the engine what the run does and install its outcome: the stored run it may repeat exactly (`exact`), the
    donor's output when the stage is skipped whole, else (sample call, sigmas, noise, latent, step callback) for the
    sampler."""
    state, run = carnator.reuse, carnator.reuse.run
    sigma_values = [float(s) for s in sigmas.flatten().tolist()]
    if exact and (run.settings.record or run.settings.exact_repeats):  # the key serves a lookup or an entry only
        step_cache = extra_args["model_options"]["transformer_options"].get(STEP_CACHE_KEY) is not None
        run.exact_key = exact_key(guider, sampler, noise, latent_image, sigmas, denoise_mask, run.hard_key, step_cache)
        repeat = run.exact_repeat()
        if repeat is not None:
            return repeat
    if carnator.attention is not None:
        carnator.attention.defer_report()
    evaluate = _probe_evaluation(state, guider, extra_args, noise)
    outcome = run.decide(_first_state(guider, sampler, sigmas, noise, latent_image), evaluate, match,
                         probe_batch_limit(guider, noise, run.settings), keeps_history(sampler))
    if isinstance(outcome, SkipStage):
        output = outcome.output.to(device=noise.device, dtype=noise.dtype)
        run.observe_end(outcome.sigma, output)
        return output
    start = resumed = 0  # the step the sampler starts at; the step the run resumes at (0: none)
    if outcome.continues_from is not None:
        _adopt_step_cache(state, guider, extra_args, outcome.continues_from)
    state.cached_eval = _cached(state, outcome.served, noise)
    if isinstance(outcome, Resume):
        resumed, state.altered = outcome.step, True
        state.replay, state.boost_sigmas = outcome.replay, set(outcome.boost_sigmas)
        if state.replay is None:  # the sampler starts at the resume state, without history
            start = resumed
            noise, latent_image = _start_state(guider, outcome.sigma, outcome.state.to(device=noise.device,
                                                                                        dtype=noise.dtype))
            noise_sampler = plain_noise_sampler(sampler, extra_args.get("seed"), sigmas, start, noise)
            if noise_sampler is not None:
                sample = with_plain_noise(sample, sampler, noise_sampler)
            sigmas = sigmas[start:]
            if float(sigmas[0]) != run.sigmas[start]:  # a donor state of another schedule: resumed at its sigma
                sigmas = torch.cat([sigmas.new_tensor([run.sigmas[start]]), sigmas[1:]])
        sigma_values = run.sigmas  # the schedule the run samples, the resume's sigma in its step's place
    state.probe_branches = []  # what the sampler is handed is in `cached_eval`: the probes' predictions are dropped
    run.lend_masks(carnator.attention)
    return sample, sigmas, noise, latent_image, _recording_callback(state, extra_args, callback, start, resumed,
                                                                    sigma_values)


def _sample_repeat(repeat: ExactRepeat, sample, guider, sigmas, extra_args, callback, noise, latent_image,
                   denoise_mask, disable_pbar, passed_on: dict) -> torch.Tensor:
    """Sample from step 0 until the step-0 callback: a first prediction equal to the stored run's, bit for bit, ends
    the sampler with the stored output (RepeatConfirmed); any other raises RepeatDiffers."""
    run = run_state(extra_args["model_options"]["transformer_options"]).reuse.run

    def first_step(step, x0, x, total_steps):
        with carnator_code("checking an exact repeat"):
            same = prediction_digest(x0) == repeat.first
        if not same:
            raise RepeatDiffers
        raise RepeatConfirmed

    try:
        sample(guider, sigmas, extra_args, first_step, noise, latent_image, denoise_mask, disable_pbar, **passed_on)
    except RepeatConfirmed:
        run.repeated(repeat)
        output = repeat.output.to(device=noise.device, dtype=noise.dtype)
        if callback is not None:
            callback(len(sigmas) - 2, output, output, len(sigmas) - 1)
        return output
    raise RepeatDiffers  # a sampler that never called back (no step)


def _probe_evaluation(state: ReuseHolder, guider, extra_args: dict, noise: torch.Tensor) -> Evaluate:
    """The live model for the engine's screen and probes: the guider at several states sharing one sigma, each
    call with a fresh step-cache copy; keeps what the sampler may later be handed (predictions per condition, the
    step-cache state) by the state evaluated."""
    batch = noise.shape[0]

    def evaluate(states: list[torch.Tensor], sigma: float) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        x = torch.cat([s.to(device=noise.device, dtype=noise.dtype) for s in states])
        with state.probing(), fresh_step_cache(extra_args["model_options"], guider) as cache:
            if len(states) == 1:
                state.probe_step_caches.append((states[0], cache))
            sigma_batch = torch.full((x.shape[0],), sigma, device=noise.device, dtype=noise.dtype)
            with host_code():
                x0 = guider(x, sigma_batch, model_options=extra_args["model_options"], seed=extra_args.get("seed"))
        guidance = state.probe_done(states, batch)
        return list(zip(x0.split(batch), guidance.split(batch) if guidance is not None else [None] * len(states),
                        strict=True))

    return evaluate


UNSERVED_NOTE = "the probe's evaluation was not handed to the sampler ({}): one model call more"


def _cached(state: ReuseHolder, served: ServedEvaluation | None, like: torch.Tensor) -> CachedEvaluation | None:
    """The evaluation the outcome hands the sampler's next call, on the sampler's device and dtype; None, and a note,
    where the probe's predictions per condition were not kept."""
    if served is None:
        return None
    kept = state.branches_of(served.evaluated)
    if kept is None:
        state.notes.append(UNSERVED_NOTE.format("its guider made no batch evaluation Carnator can see"))
        return None
    conds, branches = kept
    at = served.at.to(device=like.device, dtype=like.dtype) if served.at is not None else None
    return CachedEvaluation(at, served.sigma, conds, branches, served.exact)


def _recording_callback(state: ReuseHolder, extra_args: dict, callback, start: int, resumed: int,
                        sigma_values: list[float]):
    """The sampler's step callback: records the steps the run wants from the resume step on (at the state the model
    really evaluated, with its guidance), then calls the host's own callback."""
    run = state.run

    def step_callback(step, x0, x, total_steps):
        state.last_x0 = x0
        try:
            with carnator_code("recording a step"):
                absolute = start + step
                if absolute == 0:
                    run.observe_first_prediction(x0)
                if absolute >= resumed and run.wants_step(absolute):
                    sigma = sigma_values[absolute]
                    run.observe_step(absolute, sigma, state.model_input_at(sigma, x), x0, state.guidance_at(sigma),
                                     evaluated=not _step_cache_skipped(extra_args["model_options"]))
        except CarnatorFault as fault:
            stop_recording(state, fault)
        if callback is not None:
            callback(step, x0, x, total_steps)

    return step_callback


def _first_state(guider, sampler, sigmas: torch.Tensor, noise: torch.Tensor, latent_image) -> torch.Tensor:
    """The state sampling starts from, computed as ComfyUI's KSAMPLER.sample computes it. Donor and request compute it
    the same way, so it identifies a shared start for any sampler; a sampler whose first model call sees it
    rescaled (uni_pc) is not handed the step-0 check's evaluation (`CachedEvaluation` serves identical states only)
    and evaluates step 0 itself."""
    latent = torch.zeros_like(noise) if latent_image is None else latent_image
    max_denoise = sampler.max_denoise(guider, sigmas) if hasattr(sampler, "max_denoise") else False
    return guider.inner_model.model_sampling.noise_scaling(sigmas[0], noise, latent, max_denoise)


def _adopt_step_cache(state: ReuseHolder, guider, extra_args: dict, evaluated: torch.Tensor) -> None:
    """Let EasyCache/LazyCache continue from the probe call the run continues from. The guider's (per-run) options
    get it too, so the cache's own end-of-run summary and reset see the cache the run actually used."""
    step_cache = state.step_cache_of(evaluated)
    if step_cache is not None:
        for options in (extra_args["model_options"], guider.model_options):
            options["transformer_options"][STEP_CACHE_KEY] = step_cache


def _step_cache_skipped(model_options: dict) -> bool:
    """Whether EasyCache/LazyCache answered the step just taken from its cache instead of the model (its
    holder's flag, reset at the start of every evaluation); False without a step cache."""
    holder = model_options["transformer_options"].get(STEP_CACHE_KEY)
    return bool(getattr(holder, "skip_current_step", False))

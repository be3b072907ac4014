"""ComfyUI sampling wrappers that run a `carnator_core.reuse.run.ReuseRun` around any sampler.

Modelled on ComfyUI's built-in EasyCache: supported `add_wrapper_with_key` hooks only, per-run state
(`nodes.run_state.CarnatorRun`, one key) on a clone of the guider's model options, dropped in `finally`. The engine
decides (`ReuseRun.decide` returns one `Outcome`); the wrappers convert between ComfyUI objects and the engine's, install
what the outcome says, and report.

- OUTER_SAMPLE    opens the run (fingerprints) and samples it under `reuse_lifecycle`, which records and
                  reports it afterwards (the reuse sampler runs its SAMPLER under the same lifecycle)
- SAMPLER_SAMPLE  asks the engine with the loaded model as its evaluation, and installs the outcome: the donor stage's
                  output, a resume (with or without a replayed history), or a fresh start
- PREDICT_NOISE   answers a multistep sampler's calls before the resume step with the donor's predictions
                  (`carnator_core.reuse.history_replay`), counts model calls, applies the optional guidance boost,
                  and hands the run each prediction it records
- CALC_COND_BATCH serves the accepted probe's predictions per condition as the first evaluation after the resume (or,
                  without one, the probing's step-0 evaluation as step 0), so the host's whole CFG path runs on
                  them as on the model's own; keeps a probe's predictions, and cond - uncond where a probe or a
                  checkpoint needs it

Every one of them keeps Carnator's own code inside `nodes.fault_boundary` and the host's calls outside it: an error of
Carnator's before sampling starts leaves the run plain, one in the recording stops the recording, and one after the
run has left the plain path (a resume, a replay) samples the run again plain from the start (`sample_plain_again`).
So does any error the host raises in a run Carnator altered (a served, replayed or skipped call, sparse attention):
the run is sampled again plain, and only where that fails too does the prompt fail, as it would without Carnator.
The report gives the error in one line; interrupts, and the host's errors in a run left plain, pass through untouched.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import comfy.model_management
import comfy.model_patcher
import comfy.patcher_extension
import comfy.samplers
import torch

from carnator_core.attention.sparse_attention import SparseAttentionRun, SparseAttentionSettings
from carnator_core.lookup.embeddings import condition_vector
from carnator_core.lookup.fingerprint import FingerprintError, content_fingerprint, noise_fingerprint
from carnator_core.reuse.applicability import latent_reuse_refusal, starts_from_input
from carnator_core.reuse.cached_evaluation import CachedEvaluation
from carnator_core.reuse.decision import Evaluate
from carnator_core.reuse.outcome import Resume, ServedEvaluation, SkipStage
from carnator_core.reuse.packed_latent import PackedShapes, packed_shapes, unpack
from carnator_core.reuse.report import RunReport
from carnator_core.reuse.run import STORE_UNAVAILABLE, ReuseRun
from carnator_core.reuse.settings import ReuseSettings
from carnator_core.reuse.trajectory import continued_stage
from carnator_core.store.backend import StoreError
from carnator_core.store.thumbnail import PreviewFrame

from .attention_hooks import install_sparse_attention, settle, withdraw_sparse_attention
from .fault_boundary import CarnatorFault, carnator_code, host_code, host_failure_in_altered_run
from .host import (
    conditioning_frame_rate,
    hard_key,
    keeps_history,
    missing_hooks,
    outer_sample_arguments,
    per_run_options,
    steps_of,
    store_at,
    unsupported_latent,
)
from .keys import REUSE_SETTINGS_KEY, REUSE_WRAPPER_KEY
from .noise_continuation import plain_noise_sampler, with_plain_noise
from .reports import publish
from .reuse_holder import ReuseHolder
from .run_state import CarnatorRun, carnator_run, run_state

log = logging.getLogger("carnator")


def install(model, settings: ReuseSettings, attention: SparseAttentionSettings | None = None):
    """A clone of `model` whose sampling runs go through Carnator reuse (and sparse attention, when given)."""
    if missing_hooks():
        return model.clone()
    model = install_sparse_attention(model, attention) if attention is not None else model.clone()
    model.model_options["transformer_options"][REUSE_SETTINGS_KEY] = settings
    wrappers = comfy.patcher_extension.WrappersMP
    model.add_wrapper_with_key(wrappers.OUTER_SAMPLE, REUSE_WRAPPER_KEY, outer_sample_wrapper)
    model.add_wrapper_with_key(wrappers.SAMPLER_SAMPLE, REUSE_WRAPPER_KEY, sampler_sample_wrapper)
    model.add_wrapper_with_key(wrappers.PREDICT_NOISE, REUSE_WRAPPER_KEY, predict_noise_wrapper)
    model.add_wrapper_with_key(wrappers.CALC_COND_BATCH, REUSE_WRAPPER_KEY, calc_cond_batch_wrapper)
    return model


def _positive_tensor(guider, name: str) -> torch.Tensor | None:
    """The first tensor named `name` in the guider's positive conditioning (`cross_attn`, `concat_latent_image`)."""
    for cond in guider.conds.get("positive", []) if hasattr(guider, "conds") else []:
        tensor = cond.get(name)
        if isinstance(tensor, torch.Tensor):
            return tensor
    return None


def guidance_form(guider) -> str | None:
    """The identity of the guided output's unconditional branch (negative conditioning and CFG scale) where the output
    is uncond + cfg x (cond - uncond): the host's own CFG guider, no CFG function, no pre- or post-CFG function. None
    otherwise: the step-0 screen then judges the output itself (`carnator_core.reuse.probe.screen_basis`)."""
    if type(guider).predict_noise is not comfy.samplers.CFGGuider.predict_noise:
        return None
    options = getattr(guider, "model_options", {})
    if any(options.get(name) for name in CFG_PATH_OPTIONS if name != "disable_cfg1_optimization"):
        return None
    negative = [cond.get("cross_attn") for cond in getattr(guider, "conds", {}).get("negative", None) or []]
    parts = [f"cfg={float(getattr(guider, 'cfg', 1.0))!r}"]
    parts += [content_fingerprint(tensor) if isinstance(tensor, torch.Tensor) else repr(tensor) for tensor in negative]
    return ";".join(parts)


def build_run(guider, settings: ReuseSettings, noise, latent_image, sigmas, denoise_mask, seed,
              latent_shapes=None) -> ReuseRun:
    store = store_at(settings.store_location)
    cross_attn = _positive_tensor(guider, "cross_attn")
    if cross_attn is None:
        raise ValueError("the positive conditioning carries no cross-attention tensor")
    sigma_list = [float(s) for s in sigmas.flatten().tolist()]
    packed = packed_shapes(latent_shapes)
    key = hard_key(guider.model_patcher, noise, sigmas, packed,
                   conditioning_frame_rate(guider.conds.get("positive", []) if hasattr(guider, "conds") else []))
    sigma_max = float(guider.model_patcher.get_model_object("model_sampling").sigma_max)
    refusal, continues, input_latent, input_note = latent_reuse_refusal(denoise_mask), None, None, ""
    if not refusal and starts_from_input(latent_image, sigma_list[0], sigma_max):
        if isinstance(latent_image, torch.Tensor):
            continues, refusal, input_note = continued_stage(latent_image, noise, sigma_list[0])
        if continues is None:  # not a stage handed over here: a run from an input, reusing from its own kind
            input_latent = latent_image if isinstance(latent_image, torch.Tensor) else torch.zeros_like(noise)
    # an image the conditioning carries (image-to-video, super-resolution); a stage handed over was matched on it
    guide = _positive_tensor(guider, "concat_latent_image") if continues is None else None
    return ReuseRun(settings=settings, store=store, hard_key=key, latent_shape=tuple(noise.shape),
                    noise_fingerprint=noise_fingerprint(noise), cond_vector=condition_vector(cross_attn),
                    sigmas=sigma_list, cfg=float(getattr(guider, "cfg", 1.0)), seed=seed,
                    guidance_form=guidance_form(guider),
                    latent_reuse_refusal=refusal, continues=continues, packed=packed, input_latent=input_latent,
                    input_note=input_note, guide_image=guide)


def open_run(guider, settings: ReuseSettings, call: dict) -> ReuseHolder:
    """The holder of one sampling run, for the model wrapper and the reuse sampler alike: with its ReuseRun, or
    without one and why (it then samples plain and reports that)."""
    notes = None
    try:
        with carnator_code("opening the run", expected=(StoreError, ValueError)):
            reason = unsupported_latent(call)
            if not reason:
                run = build_run(guider, settings, call["noise"], call["latent_image"], call["sigmas"],
                                call.get("denoise_mask"), call.get("seed"), call.get("latent_shapes"))
                return ReuseHolder(settings, run)
    except StoreError as error:
        reason, notes = STORE_UNAVAILABLE, [f"store unavailable, generating without reuse: {error}"]
    except (FingerprintError, ValueError) as error:
        reason = str(error)
    except CarnatorFault as fault:
        fault.log_once("the run samples plain")
        reason = fault.line
    log.warning("Carnator: plain sampling for this run (clean miss): %s", notes[0] if notes else reason)
    return ReuseHolder(settings, None, reason, notes)


@contextlib.contextmanager
def reuse_lifecycle(guider, state: ReuseHolder, sigmas: torch.Tensor, *run_options: dict) -> Iterator[CarnatorRun]:
    """One sampling run under Carnator, for the model wrapper and the reuse sampler alike; yields the run's state.

    While the body samples, the hooks find `state` as the reuse part of the run's state in `run_options` (the run's
    own transformer options); afterwards the attention is settled and the run recorded and reported, once: this is the
    one place that publishes a reuse run's report. What the run's state held before is put back in `finally`, so an
    aborted run leaves nothing behind and reports nothing.
    """
    with carnator_run(*run_options) as carnator:
        held, carnator.reuse = carnator.reuse, state
        started = time.perf_counter()
        try:
            yield carnator
            try:
                with carnator_code("recording the run"):
                    attention = carnator.attention
                    if attention is not None:
                        settle(attention, guider.model_patcher)
                        attention.defer_report()
                    report = _finish(state, guider, steps_of(sigmas), time.perf_counter() - started, attention)
            except CarnatorFault as fault:
                fault.log_once("the run is not recorded; its output is unaffected")
                report = RunReport.plain(state.settings.mode, fault.line, steps_of(sigmas), state.sampler_calls,
                                         time.perf_counter() - started)
            publish(report)
        finally:
            carnator.reuse = held


def _finish(state: ReuseHolder, guider, total_steps: int, elapsed: float,
            attention: SparseAttentionRun | None) -> RunReport:
    """Record the run and return its report (with the errors it survived); without a ReuseRun, the plain run's
    report."""
    if state.run is None:
        return RunReport.plain(state.settings.mode, state.plain_reason, total_steps, state.sampler_calls, elapsed,
                               attention.summary() if attention is not None else None, state.plain_notes)
    report = state.run.finish(state.sampler_calls, attention, preview_frame(guider, state.last_x0, state.run.packed))
    report.notes.extend(line for line in state.faults + state.notes if line not in report.notes)
    return report


def _stop_recording(state: ReuseHolder, fault: CarnatorFault) -> None:
    """After a Carnator error in the recording: the run records nothing more and samples on as it was (its output is
    unaffected); the report notes the error."""
    fault.log_once("recording stopped; the output is unaffected")
    state.faults.append(fault.line)
    if state.run is not None:
        state.run.stop_recording()


def sample_plain_again(carnator: CarnatorRun, fault: CarnatorFault, consequence: str, *transformer_options: dict) -> None:
    """Hand the run back to plain sampling after a Carnator error: from now on every Carnator hook of the run passes
    through and its attention is the host's (Carnator's override off the run's `transformer_options`), so the caller's
    plain sampling with the arguments as given is the plain sampler's output, bit for bit. The report gives the
    error as its reason."""
    fault.log_once(consequence)
    state = carnator.reuse
    state.run, state.plain_reason, state.plain_notes = None, f"{fault.line} ({consequence})", None
    state.sampling_plain_again = True
    state.replay, state.cached_eval, state.serving, state.capture_guidance = None, None, None, False
    state.boost_sigmas = set()
    for options in transformer_options:
        withdraw_sparse_attention(options)
    attention = carnator.attention
    if attention is not None:
        attention.go_dense(f"dense attention: {fault.line}")
        attention.defer_report()


def failure_to_sample_again(carnator: CarnatorRun, error: Exception) -> CarnatorFault | None:
    """The fault for which a run is sampled again plain from the start: a Carnator error, or any error the host raised
    in a run Carnator altered (a call served, replayed or skipped, or attention computed sparse: what Carnator handed
    it may be what it failed on); None for an error that fails the prompt as it would without Carnator (an interrupt,
    the host's error in a run still plain)."""
    if isinstance(error, CarnatorFault):
        return error
    attention, state = carnator.attention, carnator.reuse
    changed = state.altered or (attention is not None and attention.sparse_calls > 0)
    if state.active and changed:
        return host_failure_in_altered_run(error)
    return None


def outer_sample_wrapper(executor, *args, **kwargs):
    """Open the run and sample under its lifecycle; arguments the host adds later are passed on untouched."""
    guider = executor.class_obj
    call = outer_sample_arguments(args, kwargs)
    with per_run_options(guider) as transformer_options:
        state = open_run(guider, transformer_options[REUSE_SETTINGS_KEY], call)
        with reuse_lifecycle(guider, state, call["sigmas"], transformer_options) as carnator:
            try:
                output = executor(*args, **kwargs)
            except Exception as error:
                fault = failure_to_sample_again(carnator, error)
                if fault is None:
                    raise
                sample_plain_again(carnator, fault, "sampled again plain from the start", transformer_options)
                return executor(*args, **kwargs)
            if state.run is not None and state.run.hands_over and isinstance(output, torch.Tensor):
                try:
                    with carnator_code("recording the stage's output"):
                        state.run.observe_output(output)
                except CarnatorFault as fault:
                    _stop_recording(state, fault)
            return output


def preview_frame(guider, x0: torch.Tensor | None, packed: PackedShapes | None = None) -> PreviewFrame | None:
    """The final prediction's middle frame (of the first latent of a packed one: the video) and the model's
    latent-preview factors, if it has them: the entry's preview, encoded by the recorder's thread."""
    latent_format = getattr(guider.model_patcher.model, "latent_format", None)
    factors = getattr(latent_format, "latent_rgb_factors", None)
    if x0 is not None and packed is not None:
        x0 = unpack(x0, packed)[0]
    if x0 is None or factors is None or x0.ndim not in (4, 5):
        return None
    frame = x0[0, :, x0.shape[2] // 2] if x0.ndim == 5 else x0[0]
    return PreviewFrame(frame.detach().to("cpu", torch.float32, copy=True), factors,
                        getattr(latent_format, "latent_rgb_factors_bias", None))


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


def _active_reuse(transformer_options: dict) -> ReuseHolder | None:
    """The run's reuse holder while its hooks take part; None outside a reuse run or once it samples plain again."""
    carnator = run_state(transformer_options)
    state = carnator.reuse if carnator is not None else None
    return state if state is not None and state.active else None


def sampler_sample_wrapper(executor, guider, sigmas, extra_args, callback, noise, *args, **kwargs):
    carnator = run_state(extra_args["model_options"]["transformer_options"])
    if _active_reuse(extra_args["model_options"]["transformer_options"]) is None or carnator.reuse.run is None:
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
                                         latent_image, match)
    except CarnatorFault as fault:
        sample_plain_again(carnator, fault, "sampled plain", extra_args["model_options"]["transformer_options"],
                           guider.model_options["transformer_options"])
        return sample(guider, sigmas, extra_args, callback, noise, latent_image, denoise_mask, disable_pbar,
                      **passed_on)
    if isinstance(prepared, torch.Tensor):  # the stage is skipped whole: the donor's output
        return prepared
    sample, sigmas, noise, latent_image, step_callback = prepared
    output = sample(guider, sigmas, extra_args, step_callback, noise, latent_image, denoise_mask, disable_pbar,
                    **passed_on)
    if state.run is not None:
        try:
            with carnator_code("recording the run's output"):
                state.run.observe_end(float(sigmas[-1]), output)
        except CarnatorFault as fault:
            _stop_recording(state, fault)
    return output


def _prepare_sampling(sample, sampler, carnator: CarnatorRun, guider, sigmas, extra_args, callback, noise,
                      latent_image, match):
    """Ask the engine what the run does and install its outcome: the donor's output when the stage is skipped whole,
    else (sample call, sigmas, noise, latent, step callback) for the sampler."""
    state, run = carnator.reuse, carnator.reuse.run
    sigma_values = [float(s) for s in sigmas.flatten().tolist()]
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
    state.probe_branches = []  # what the sampler is handed is in `cached_eval`: the probes' predictions are dropped
    run.lend_masks(carnator.attention)
    return sample, sigmas, noise, latent_image, _recording_callback(state, extra_args, callback, start, resumed,
                                                                    sigma_values)


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
                if absolute >= resumed and run.wants_step(absolute):
                    sigma = sigma_values[absolute]
                    run.observe_step(absolute, sigma, state.model_input_at(sigma, x), x0, state.guidance_at(sigma),
                                     evaluated=not _step_cache_skipped(extra_args["model_options"]))
        except CarnatorFault as fault:
            _stop_recording(state, fault)
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


def _first_sigma(timestep) -> float:
    return float(timestep.flatten()[0]) if isinstance(timestep, torch.Tensor) else float(timestep)


def predict_noise_wrapper(executor, x, timestep, *args, **kwargs):
    model_options = args[0] if args else kwargs.get("model_options", {})
    state = _active_reuse(model_options.get("transformer_options", {}))
    if state is None or state.capture_guidance:  # not a reuse run's, or the run's own probe call
        return executor(x, timestep, *args, **kwargs)
    with carnator_code("answering the sampler from the donor"):
        sigma = _first_sigma(timestep)
        state.model_input = (sigma, x)
        replayed = _replayed_prediction(state, executor.class_obj, model_options, x, sigma)
        offered = state.next_offer(replayed is not None)  # for this call's batch evaluation only, served or not
    x0 = replayed
    if x0 is None:
        with state.offering(offered):
            x0 = _model_prediction(state, executor, x, timestep, sigma, *args, **kwargs)
        if offered is not None and not state.served_call:
            with carnator_code("answering the sampler from the donor"):
                state.notes.append(UNSERVED_NOTE.format("the sampler's call evaluates other conditions"))
    if state.run is not None:
        try:
            with carnator_code("recording a prediction"):
                state.run.observe_prediction(sigma, x0)
        except CarnatorFault as fault:
            _stop_recording(state, fault)
    return x0


# what a sampler may add to the guider's CFG path for its own steps (CFG++ samplers read the unconditional prediction)
CFG_PATH_OPTIONS = ("sampler_cfg_function", "sampler_pre_cfg_function", "sampler_post_cfg_function",
                    "sampler_calc_cond_batch_function", "disable_cfg1_optimization")


def _replayed_prediction(state: ReuseHolder, guider, model_options: dict, x: torch.Tensor,
                         sigma: float) -> torch.Tensor | None:
    """The donor's prediction for one of the sampler's calls before the resume step; None for the model to answer.

    A replay hands over guided outputs: a sampler that adds its own step to the CFG path (one that reads the
    unconditional prediction) cannot be given them, so such a run is sampled again plain (the error says why)."""
    replayed = state.replay.answer(sigma) if state.replay is not None else None
    if replayed is None:
        return None
    run_options = getattr(guider, "model_options", {})
    added = [name for name in CFG_PATH_OPTIONS if model_options.get(name) != run_options.get(name)]
    if added:
        raise ValueError(f"the sampler adds {', '.join(added)} to the CFG path, which a replayed history cannot feed")
    state.altered = True
    return replayed.to(device=x.device, dtype=x.dtype)


def _model_prediction(state: ReuseHolder, executor, x, timestep, sigma: float, *args, **kwargs):
    """The host's prediction for one of the sampler's calls, with the guidance boost where it applies; counted as a
    model call unless its batch evaluation was served (`calc_cond_batch_wrapper`)."""
    guider = executor.class_obj
    try:
        if sigma in state.boost_sigmas and hasattr(guider, "cfg"):
            original_cfg = guider.cfg
            guider.cfg = original_cfg * (1.0 + state.settings.guidance_boost)
            try:
                return executor(x, timestep, *args, **kwargs)
            finally:
                guider.cfg = original_cfg
        return executor(x, timestep, *args, **kwargs)
    finally:
        if not state.served_call:
            state.sampler_calls += 1


def calc_cond_batch_wrapper(executor, model, conds, x_in, timestep, model_options, *args, **kwargs):
    state = _active_reuse(model_options.get("transformer_options", {}))
    if state is None:
        return executor(model, conds, x_in, timestep, model_options, *args, **kwargs)
    served = None
    if state.serving is not None:  # only the offered call's batch evaluation asks; every other passes straight on
        with carnator_code("answering the sampler from the donor"):
            served = state.serve(x_in, _first_sigma(timestep), conds)
    output = served if served is not None else executor(model, conds, x_in, timestep, model_options, *args, **kwargs)
    try:
        with carnator_code("keeping the guidance"):
            state.keep_batch(output, conds, _first_sigma(timestep))
    except CarnatorFault as fault:
        if state.capture_guidance:  # a probe's: the probing fails and the run samples plain
            raise
        _stop_recording(state, fault)
    return output


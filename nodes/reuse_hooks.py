"""ComfyUI sampling wrappers that run a `carnator_core.reuse.run.ReuseRun` around any sampler.

Modelled on ComfyUI's built-in EasyCache: supported `add_wrapper_with_key` hooks only,
per-run state created in OUTER_SAMPLE on a clone of the guider's model options and dropped
in `finally`. The wrappers translate between ComfyUI objects and the engine; every decision
is made in carnator_core.

- OUTER_SAMPLE    opens the run (fingerprints) and samples it under `reuse_lifecycle`, which records and
                  reports it afterwards (the reuse sampler runs its SAMPLER under the same lifecycle)
- SAMPLER_SAMPLE  probes donors with the loaded model, resumes from the accepted state
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
from carnator_core.reuse.cached_evaluation import Branches, CachedEvaluation, branches_of_state, same_sigma
from carnator_core.reuse.decision import Decision
from carnator_core.reuse.history_replay import HistoryReplay
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
from .keys import ATTENTION_RUN_KEY, PLAIN_RETRY_KEY, REUSE_KEY, REUSE_WRAPPER_KEY
from .noise_continuation import plain_noise_sampler, with_plain_noise
from .reports import publish

log = logging.getLogger("carnator")


def install(model, settings: ReuseSettings, attention: SparseAttentionSettings | None = None):
    """A clone of `model` whose sampling runs go through Carnator reuse (and sparse attention, when given)."""
    if missing_hooks():
        return model.clone()
    model = install_sparse_attention(model, attention) if attention is not None else model.clone()
    model.model_options["transformer_options"][REUSE_KEY] = ReuseHolder(settings)
    wrappers = comfy.patcher_extension.WrappersMP
    model.add_wrapper_with_key(wrappers.OUTER_SAMPLE, REUSE_WRAPPER_KEY, outer_sample_wrapper)
    model.add_wrapper_with_key(wrappers.SAMPLER_SAMPLE, REUSE_WRAPPER_KEY, sampler_sample_wrapper)
    model.add_wrapper_with_key(wrappers.PREDICT_NOISE, REUSE_WRAPPER_KEY, predict_noise_wrapper)
    model.add_wrapper_with_key(wrappers.CALC_COND_BATCH, REUSE_WRAPPER_KEY, calc_cond_batch_wrapper)
    return model


class ReuseHolder:
    """Carnator's one object in `transformer_options` (as EasyCache keeps its holder): on the patched model it holds
    the settings; each sampling run gets its own, opened for it (`open_run`), with the run's ReuseRun (or why it
    samples plain), its tensors on the device and its counters, and dropped when the run ends."""

    def __init__(self, settings: ReuseSettings, run: ReuseRun | None = None, plain_reason: str = "",
                 plain_notes: list[str] | None = None, opened: bool = False) -> None:
        self.settings = settings
        self.run = run
        self.opened = opened  # a run's own holder, not the model's template
        # without a run: why the run samples plain, and the report's notes when other than the reason
        self.plain_reason = plain_reason
        self.plain_notes = plain_notes
        self.model_calls = 0
        # a probe's predictions per condition, for the sampler's next call (`predict_noise_wrapper`); while that call
        # runs, `serving` holds them for its batch evaluation (`calc_cond_batch_wrapper`), which sets `served_call`
        self.cached_eval: CachedEvaluation | None = None
        self.serving: CachedEvaluation | None = None
        self.served_call = False
        # the predictions per condition of every state a probe evaluated, by that state, and the batch evaluations of
        # the probe call under way (with which conditions each evaluated)
        self.probe_branches: list[tuple[torch.Tensor, list, Branches]] = []
        self.probe_outputs: list[tuple[list[torch.Tensor], list]] = []
        # whether Carnator changed what the host computes in this run: a call served or replayed, steps skipped
        self.altered = False
        self.notes: list[str] = []  # what the report says of the run beyond the decision
        self.replay: HistoryReplay | None = None  # a multistep sampler's calls before the resume step, answered
        self.capture_guidance = False
        self.last_guidance: tuple[float, torch.Tensor] | None = None
        self.checkpoint_sigmas: set[float] = set()
        self.attention: SparseAttentionRun | None = None
        self.last_x0: torch.Tensor | None = None
        self.boost_sigmas: set[float] = set()
        # (sigma, state) of the sampler's latest model call. A checkpoint records the state the model was given:
        # samplers that keep their own scaled state (uni_pc divides it by sqrt(1 + sigma^2)) report that one in
        # their step callback, and a probe or a resume must see the model's own.
        self.model_input: tuple[float, torch.Tensor] | None = None
        # EasyCache state of every single-state probe call, by the state it evaluated: the run adopts the one of the
        # call it continues from (the resumed probe, or the step-0 screen), not of any other call at that sigma.
        self.probe_step_caches: list[tuple[torch.Tensor, object | None]] = []
        self.sampling_plain_again = False  # a Carnator error handed the run back to plain sampling
        self.faults: list[str] = []  # Carnator errors the run survived (recording stopped), for its report

    @property
    def active(self) -> bool:
        """Whether the run's hooks take part: a run's own holder that has not been handed back to plain sampling."""
        return self.opened and not self.sampling_plain_again

    def step_cache_of(self, evaluated: torch.Tensor) -> object | None:
        return next((cache for x, cache in self.probe_step_caches if x is evaluated), None)

    def branches_of(self, evaluated: torch.Tensor) -> tuple[list, Branches] | None:
        """The conditions and predictions per condition of the first batch evaluation of the probe at the state
        `evaluated`; None where its guider made none (then nothing of that probe is handed to the sampler)."""
        return next(((conds, branches) for x, conds, branches in self.probe_branches if x is evaluated), None)

    @property
    def changed_the_run(self) -> bool:
        """Whether the host's sampling of this run differs from the plain sampler's: a call served, replayed or
        skipped, or attention computed sparse."""
        attention = self.attention
        return self.altered or (attention is not None and attention.sparse_calls > 0)


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
                return ReuseHolder(settings, run, opened=True)
    except StoreError as error:
        reason, notes = STORE_UNAVAILABLE, [f"store unavailable, generating without reuse: {error}"]
    except (FingerprintError, ValueError) as error:
        reason = str(error)
    except CarnatorFault as fault:
        fault.log_once("the run samples plain")
        reason = fault.line
    log.warning("Carnator: plain sampling for this run (clean miss): %s", notes[0] if notes else reason)
    return ReuseHolder(settings, None, reason, notes, opened=True)


@contextlib.contextmanager
def reuse_lifecycle(guider, state: ReuseHolder, sigmas: torch.Tensor, run_options: dict,
                    *shared_options: dict) -> Iterator[None]:
    """One sampling run under Carnator, for the model wrapper and the reuse sampler alike.

    While the body samples, the hooks find `state` in `run_options` (the run's own transformer options) and in
    `shared_options`; afterwards the attention is settled and the run recorded and reported, once: this is the one
    place that publishes a reuse run's report. What the options held before is put back in `finally`, so an aborted
    run leaves nothing behind and reports nothing.
    """
    holders = [(options, options.get(REUSE_KEY)) for options in (run_options, *shared_options)]
    for options, _ in holders:
        options[REUSE_KEY] = state
    started = time.perf_counter()
    try:
        yield
        try:
            with carnator_code("recording the run"):
                attention: SparseAttentionRun | None = run_options.get(ATTENTION_RUN_KEY)
                if attention is not None:
                    settle(attention, guider.model_patcher)
                    attention.defer_report()
                report = _finish(state, guider, steps_of(sigmas), time.perf_counter() - started, attention)
        except CarnatorFault as fault:
            fault.log_once("the run is not recorded; its output is unaffected")
            report = RunReport.plain(state.settings.mode, fault.line, steps_of(sigmas), state.model_calls,
                                     time.perf_counter() - started)
        publish(report)
    finally:
        for options, held in holders:
            if held is None:
                options.pop(REUSE_KEY, None)
            else:
                options[REUSE_KEY] = held


def _finish(state: ReuseHolder, guider, total_steps: int, elapsed: float,
            attention: SparseAttentionRun | None) -> RunReport:
    """Record the run and return its report (with the errors it survived); without a ReuseRun, the plain run's
    report."""
    if state.run is None:
        return RunReport.plain(state.settings.mode, state.plain_reason, total_steps, state.model_calls, elapsed,
                               attention.summary() if attention is not None else None, state.plain_notes)
    report = state.run.finish(state.model_calls, state.attention, preview_frame(guider, state.last_x0, state.run.packed))
    report.notes.extend(line for line in state.faults + state.notes if line not in report.notes)
    return report


def _stop_recording(state: ReuseHolder, fault: CarnatorFault) -> None:
    """After a Carnator error in the recording: the run records nothing more and samples on as it was (its output is
    unaffected); the report notes the error."""
    fault.log_once("recording stopped; the output is unaffected")
    state.faults.append(fault.line)
    state.checkpoint_sigmas = set()
    if state.run is not None:
        state.run.stop_recording()


def sample_plain_again(state: ReuseHolder, fault: CarnatorFault, consequence: str, *transformer_options: dict) -> None:
    """Hand the run back to plain sampling after a Carnator error: from now on every Carnator hook of the run passes
    through (`transformer_options` are the run's, where the hooks look) and its attention is the host's, so the caller's
    plain sampling with the arguments as given is the plain sampler's output, bit for bit. The report gives the
    error as its reason."""
    fault.log_once(consequence)
    state.run, state.plain_reason, state.plain_notes = None, f"{fault.line} ({consequence})", None
    state.sampling_plain_again = True
    state.replay, state.cached_eval, state.serving, state.capture_guidance = None, None, None, False
    state.boost_sigmas, state.checkpoint_sigmas = set(), set()
    for options in transformer_options:
        options[PLAIN_RETRY_KEY] = fault.line
        withdraw_sparse_attention(options)
        attention: SparseAttentionRun | None = options.get(ATTENTION_RUN_KEY)
        if attention is not None:
            attention.inactive = attention.inactive or f"dense attention: {fault.line}"
            attention.defer_report()


def failure_to_sample_again(state: ReuseHolder, error: Exception) -> CarnatorFault | None:
    """The fault for which a run is sampled again plain from the start: a Carnator error, or any error the host raised
    in a run Carnator altered (what Carnator handed it may be what it failed on); None for an error that fails the
    prompt as it would without Carnator (an interrupt, the host's error in a run still plain)."""
    if isinstance(error, CarnatorFault):
        return error
    if state.active and state.changed_the_run:
        return host_failure_in_altered_run(error)
    return None


def outer_sample_wrapper(executor, *args, **kwargs):
    """Open the run and sample under its lifecycle; arguments the host adds later are passed on untouched."""
    guider = executor.class_obj
    call = outer_sample_arguments(args, kwargs)
    with per_run_options(guider) as transformer_options:
        state = open_run(guider, transformer_options[REUSE_KEY].settings, call)
        with reuse_lifecycle(guider, state, call["sigmas"], transformer_options):
            try:
                output = executor(*args, **kwargs)
            except Exception as error:
                fault = failure_to_sample_again(state, error)
                if fault is None:
                    raise
                sample_plain_again(state, fault, "sampled again plain from the start", transformer_options)
                return executor(*args, **kwargs)
            if state.run is not None and state.run.hands_over and isinstance(output, torch.Tensor):
                try:
                    with carnator_code("recording the stage's output"):
                        state.run.output_fingerprint = content_fingerprint(output)
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


def sampler_sample_wrapper(executor, guider, sigmas, extra_args, callback, noise, *args, **kwargs):
    state: ReuseHolder | None = extra_args["model_options"]["transformer_options"].get(REUSE_KEY)
    if state is None or state.run is None or not state.active:
        return executor(guider, sigmas, extra_args, callback, noise, *args, **kwargs)
    named = {**dict(zip(("latent_image", "denoise_mask", "disable_pbar"), args, strict=False)), **kwargs}
    return sample_with_run(executor, executor.class_obj, state, guider, sigmas, extra_args, callback, noise, **named)


def sample_with_run(sample, sampler, state: ReuseHolder, guider, sigmas, extra_args, callback, noise, latent_image=None,
                    denoise_mask=None, disable_pbar=False, match=None, **passed_on):
    """Probe, maybe resume, and sample through `sample` (the sampler's own sample call) while recording.
    Arguments a newer host adds (`passed_on`) go to `sample` untouched.

    A Carnator error before sampling starts leaves the run plain: `sample` with the arguments as given. One while
    sampling raises a `CarnatorFault` to the entry point, which samples the run again plain.
    """
    try:
        with carnator_code("probing donors"):
            prepared = _prepare_sampling(sample, sampler, state, guider, sigmas, extra_args, callback, noise,
                                         latent_image, match)
    except CarnatorFault as fault:
        sample_plain_again(state, fault, "sampled plain", extra_args["model_options"]["transformer_options"],
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


def _prepare_sampling(sample, sampler, state: ReuseHolder, guider, sigmas, extra_args, callback, noise, latent_image,
                      match):
    """Plan and probe, and set the run up for what was decided: the donor's output when the stage is skipped whole,
    else (sample call, sigmas, noise, latent, step callback) for the sampler."""
    run = state.run
    sigma_values = [float(s) for s in sigmas.flatten().tolist()]
    batch_limit = probe_batch_limit(guider, noise, state.settings)
    run.start_state = _first_state(guider, sampler, sigmas, noise, latent_image)
    targets = run.plan(match, batch_limit)
    state.attention = extra_args["model_options"]["transformer_options"].get(ATTENTION_RUN_KEY)
    if state.attention is not None:
        state.attention.defer_report()
    state.checkpoint_sigmas = run.checkpoint_sigmas
    multistep = keeps_history(sampler)
    if multistep:
        run.keep_history()
    batch = noise.shape[0]

    def evaluate(states: list[torch.Tensor], sigma: float) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        x = torch.cat([s.to(device=noise.device, dtype=noise.dtype) for s in states])
        state.capture_guidance, state.last_guidance, state.probe_outputs = True, None, []
        try:
            with fresh_step_cache(extra_args["model_options"], guider) as cache:
                if len(states) == 1:
                    state.probe_step_caches.append((states[0], cache))
                sigma_batch = torch.full((x.shape[0],), sigma, device=noise.device, dtype=noise.dtype)
                with host_code():
                    x0 = guider(x, sigma_batch, model_options=extra_args["model_options"], seed=extra_args.get("seed"))
        finally:
            state.capture_guidance = False
        if state.probe_outputs:  # the guider's first batch evaluation, which the sampler's call makes first too
            outputs, conds = state.probe_outputs[0]
            state.probe_branches.extend((s, conds, branches_of_state(outputs, conds, index, batch))
                                        for index, s in enumerate(states))
        state.probe_outputs = []
        guidance = state.last_guidance[1] if state.last_guidance is not None else None
        return list(zip(x0.split(batch), guidance.split(batch) if guidance is not None else [None] * len(states),
                        strict=True))

    start, resumed = 0, 0  # the step the sampler starts at; the step the run resumes at (0: none)
    if targets:
        decision = run.decide(targets, evaluate, batch_limit)
        if decision is not None and decision.end is not None:  # the stage is skipped whole: the donor's output
            output = decision.end.latent.to(device=noise.device, dtype=noise.dtype)
            run.observe_end(decision.end.sigma, output)
            return output
        if decision is not None:
            resumed = decision.target.step
            state.altered = True
            state.replay = run.history_replay() if multistep else None
            resume_state = _resume_from(state, guider, extra_args, decision, noise, sigma_values)
            if state.replay is None:  # the sampler starts at the resume state, without history
                start = resumed
                noise, latent_image = resume_state
                noise_sampler = plain_noise_sampler(sampler, extra_args.get("seed"), sigmas, start, noise)
                if noise_sampler is not None:
                    sample = with_plain_noise(sample, sampler, noise_sampler)
                sigmas = sigmas[start:]
        elif run.start_evaluation is not None:
            _adopt_step_cache(state, guider, extra_args, run.start_state)
            state.cached_eval = _cached(state, run.start_state, run.start_state, sigma_values[0], exact=True)

    state.probe_branches = []  # what the sampler is handed is in `cached_eval`: the probes' predictions are dropped
    run.lend_masks(state.attention)
    return sample, sigmas, noise, latent_image, _recording_callback(state, extra_args, callback, start, resumed,
                                                                    sigma_values)


def _resume_from(state: ReuseHolder, guider, extra_args: dict, resume: Decision, noise: torch.Tensor,
                 sigma_values: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Set the run up to continue from the resume's state; returns the (noise, latent) a sampler without a replay
    starts from. The probe's evaluation there serves the sampler's call at that state (after a replay, at that
    sigma: the replayed state is the resume state up to the rounding of the recorded predictions), and the guidance
    boost covers the next steps."""
    _adopt_step_cache(state, guider, extra_args, resume.target.x)
    start = resume.target.step
    x_k = resume.target.x.to(device=noise.device, dtype=noise.dtype)
    if resume.x0 is not None:
        state.cached_eval = _cached(state, resume.target.x, None if state.replay is not None else x_k,
                                    resume.target.sigma, exact=False)
    state.boost_sigmas = state.settings.boost_sigmas(sigma_values, start)
    return _start_state(guider, resume.target.sigma, x_k)


UNSERVED_NOTE = "the probe's evaluation was not handed to the sampler ({}): one model call more"


def _cached(state: ReuseHolder, evaluated: torch.Tensor, x: torch.Tensor | None, sigma: float,
            exact: bool) -> CachedEvaluation | None:
    """The probe's evaluation at the state `evaluated`, for the sampler's next call at `x` (None: at `sigma` whatever
    the state); None, and a note, where the probe's predictions per condition were not kept."""
    kept = state.branches_of(evaluated)
    if kept is None:
        state.notes.append(UNSERVED_NOTE.format("its guider made no batch evaluation Carnator can see"))
        return None
    conds, branches = kept
    return CachedEvaluation(x, sigma, conds, branches, exact)


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
                    guidance = None
                    if state.last_guidance is not None and same_sigma(state.last_guidance[0], sigma_values[absolute]):
                        guidance = state.last_guidance[1]
                    evaluated_at = x
                    if state.model_input is not None and same_sigma(state.model_input[0], sigma_values[absolute]):
                        evaluated_at = state.model_input[1]
                    run.observe_step(absolute, sigma_values[absolute], evaluated_at, x0, guidance,
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
    state: ReuseHolder | None = model_options.get("transformer_options", {}).get(REUSE_KEY)
    if state is None or not state.active or state.capture_guidance:  # not a run's, or the run's own probe call
        return executor(x, timestep, *args, **kwargs)
    with carnator_code("answering the sampler from the donor"):
        sigma = _first_sigma(timestep)
        state.model_input = (sigma, x)
        replayed = _replayed_prediction(state, executor.class_obj, model_options, x, sigma)
        # the probe's evaluation, for this call's batch evaluation only, served or not
        offered, state.cached_eval = (state.cached_eval, None) if replayed is None else (None, state.cached_eval)
    x0 = replayed
    if x0 is None:
        state.serving, state.served_call = offered, False
        try:
            x0 = _model_prediction(state, executor, x, timestep, sigma, *args, **kwargs)
        finally:
            state.serving = None
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
            state.model_calls += 1


def calc_cond_batch_wrapper(executor, model, conds, x_in, timestep, model_options, *args, **kwargs):
    state: ReuseHolder | None = model_options.get("transformer_options", {}).get(REUSE_KEY)
    if state is None or not state.active:
        return executor(model, conds, x_in, timestep, model_options, *args, **kwargs)
    served = None
    if state.serving is not None and not state.capture_guidance:
        with carnator_code("answering the sampler from the donor"):
            offered, state.serving = state.serving, None  # the call's first batch evaluation only
            if offered.serves(x_in, _first_sigma(timestep), conds):
                served = offered.predictions(x_in)
                state.served_call = state.altered = True
    output = served if served is not None else executor(model, conds, x_in, timestep, model_options, *args, **kwargs)
    try:
        with carnator_code("keeping the guidance"):
            if state.capture_guidance:
                state.probe_outputs.append((list(output), list(conds)))
            if len(output) < 2 or output[1] is None or conds[1] is None:
                return output
            sigma = _first_sigma(timestep)
            if state.capture_guidance or any(same_sigma(sigma, s) for s in state.checkpoint_sigmas):
                state.last_guidance = (sigma, output[0] - output[1])
    except CarnatorFault as fault:
        if state.capture_guidance:  # a probe's: the probing fails and the run samples plain
            raise
        _stop_recording(state, fault)
    return output


"""One sampling run under Carnator from open to report: opening the run (fingerprints, the engine's `ReuseRun`),
the OUTER_SAMPLE wrapper, the lifecycle that records and publishes it, and the fault boundary's way back to plain
sampling (`sample_plain_again`) after a Carnator error or a host error in a run Carnator altered."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import replace

import comfy.samplers
import torch

from carnator_core.attention.sparse_attention import SparseAttentionRun
from carnator_core.lookup.embeddings import condition_vector
from carnator_core.lookup.fingerprint import FingerprintError, content_fingerprint, noise_fingerprint
from carnator_core.reuse.applicability import latent_reuse_refusal, starts_from_input
from carnator_core.reuse.packed_latent import PackedShapes, packed_shapes, unpack
from carnator_core.reuse.report import RunReport
from carnator_core.reuse.run import STORE_UNAVAILABLE, ReuseRun
from carnator_core.reuse.settings import ReuseSettings
from carnator_core.reuse.trajectory import continued_stage
from carnator_core.store.backend import StoreError
from carnator_core.store.thumbnail import PreviewFrame

from .attention_hooks import settle, withdraw_sparse_attention
from .fault_boundary import CarnatorFault, carnator_code, host_failure_in_altered_run
from .host import (
    conditioning_frame_rate,
    hard_key,
    outer_sample_arguments,
    per_run_options,
    steps_of,
    store_at,
    unsupported_latent,
)
from .keys import REUSE_SETTINGS_KEY
from .noise_process import noise_process
from .reports import publish
from .reuse_holder import ReuseHolder
from .run_state import CarnatorRun, carnator_run, run_state
from .user_scope import run_scope

log = logging.getLogger("carnator")


def _positive_tensor(guider, name: str) -> torch.Tensor | None:
    """The first tensor named `name` in the guider's positive conditioning (`cross_attn`, `concat_latent_image`)."""
    for cond in guider.conds.get("positive", []) if hasattr(guider, "conds") else []:
        tensor = cond.get(name)
        if isinstance(tensor, torch.Tensor):
            return tensor
    return None


# what a sampler may add to the guider's CFG path for its own steps (CFG++ samplers read the unconditional prediction)
CFG_PATH_OPTIONS = ("sampler_cfg_function", "sampler_pre_cfg_function", "sampler_post_cfg_function",
                    "sampler_calc_cond_batch_function", "disable_cfg1_optimization")


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
    scope, refusal = run_scope()
    if refusal:
        raise ValueError(refusal)
    store = store_at(settings.store_location)
    cross_attn = _positive_tensor(guider, "cross_attn")
    if cross_attn is None:
        raise ValueError("the positive conditioning carries no cross-attention tensor")
    sigma_list = [float(s) for s in sigmas.flatten().tolist()]
    packed = packed_shapes(latent_shapes)
    key = replace(hard_key(guider.model_patcher, noise, sigmas, packed,
                           conditioning_frame_rate(guider.conds.get("positive", []) if hasattr(guider, "conds") else [])),
                  scope=scope)
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
                    input_note=input_note, guide_image=guide, noise_process=noise_process(guider.model_patcher))


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


def stop_recording(state: ReuseHolder, fault: CarnatorFault) -> None:
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
                    stop_recording(state, fault)
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


def active_reuse(transformer_options: dict) -> ReuseHolder | None:
    """The run's reuse holder while its hooks take part; None outside a reuse run or once it samples plain again."""
    carnator = run_state(transformer_options)
    state = carnator.reuse if carnator is not None else None
    return state if state is not None and state.active else None

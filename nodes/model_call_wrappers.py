"""The model-call wrappers: PREDICT_NOISE answers the sampler from a replayed donor history, counts model calls and
applies the guidance boost; CALC_COND_BATCH serves the accepted probe's predictions per condition through the host's
whole CFG path and keeps what the run records."""

from __future__ import annotations

import torch

from .fault_boundary import CarnatorFault, carnator_code
from .reuse_holder import ReuseHolder
from .reuse_lifecycle import CFG_PATH_OPTIONS, active_reuse, stop_recording
from .sampler_preparation import UNSERVED_NOTE


def _first_sigma(timestep) -> float:
    return float(timestep.flatten()[0]) if isinstance(timestep, torch.Tensor) else float(timestep)


def predict_noise_wrapper(executor, x, timestep, *args, **kwargs):
    model_options = args[0] if args else kwargs.get("model_options", {})
    state = active_reuse(model_options.get("transformer_options", {}))
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
            stop_recording(state, fault)
    return x0


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
    state = active_reuse(model_options.get("transformer_options", {}))
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
        stop_recording(state, fault)
    return output

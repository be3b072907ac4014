"""Resuming a multistep sampler with its history: the donor's predictions replayed from the first step.

uni_pc, dpmpp_2m, deis and the other multistep samplers take each step with their last few predictions. Started at
the resume step from the donor's state, they would have none and restart at first order, which leaves the remaining
steps far from where the donor's history would have taken them at few steps and high guidance. So a run that resumes
such a sampler samples from its own first state instead, the donor's (the same noise), and its model calls before the
resume step are answered with the predictions the donor recorded there (`RunRecorder.history`), moved by the start
difference where the resume state is corrected (`StartDifference.prediction`): the sampler retraces the donor's
trajectory without a model call and reaches the resume step with the history the donor had. Only where the two
schedules coincide up to the resume: a donor of another schedule took other steps there, and the run starts at the
resume state without history.
"""

from __future__ import annotations

import torch

from carnator_core.reuse.cached_evaluation import same_sigma
from carnator_core.reuse.start_difference import StartDifference
from carnator_core.reuse.targets import ProbeTarget
from carnator_core.store.reuse_store import ReuseStore
from carnator_core.store.stages import stage_index
from carnator_core.store.tensor_names import HISTORY_BLOB, history_tensor

REPLAY_NOTE = "multistep sampler: retraced the donor's recorded predictions to the resume step, resuming with its history"


class HistoryReplay:
    """The predictions that answer a resumed run's model calls before its resume step, by sigma, each once."""

    def __init__(self, sigmas: list[float], predictions: list[torch.Tensor]) -> None:
        self.pending = list(zip(sigmas, predictions, strict=False))

    def answer(self, sigma: float) -> torch.Tensor | None:
        """The prediction for the sampler's call at `sigma` (None: a call past the replayed steps, for the model)."""
        for index, (step_sigma, prediction) in enumerate(self.pending):
            if same_sigma(step_sigma, sigma):
                del self.pending[index]
                return prediction
        return None


def replay_for(store: ReuseStore, target: ProbeTarget, start_fingerprint: str | None, sigmas: list[float],
               difference: StartDifference | None) -> HistoryReplay | None:
    """The replay that brings a run from its own first state to `target` along the donor's trajectory: that state is
    the donor's, or, where the target is corrected, the donor's moved by the difference the correction carries
    (`StartDifference.state_at` moves the state the way a replay from it does). None where neither holds, the target
    lies in a later stage, or the donor kept no complete history up to it: the run then starts at the resume state,
    without history."""
    same_start = target.start is not None and start_fingerprint is not None and target.start.state == start_fingerprint
    if stage_index(target.meta) != 0 or not (same_start or (target.corrected and difference is not None)) \
            or not _same_schedule_until(target, sigmas):
        return None
    tensors = store.get_tensors(target.meta.entry_id, HISTORY_BLOB)
    if tensors is None:
        return None
    predictions = [tensors.get(history_tensor(step)) for step in range(target.recorded_step)]
    if any(p is None or p.shape != target.x0.shape or not torch.isfinite(p).all() for p in predictions):
        return None
    if target.corrected and difference is not None:
        predictions = [difference.prediction(p) for p in predictions]
    return HistoryReplay(sigmas[:target.step], predictions)


def _same_schedule_until(target: ProbeTarget, sigmas: list[float]) -> bool:
    """Whether the donor's schedule (the sigmas its entry lists) is the request's up to the target's step."""
    donor = target.meta.extra.get("sigmas")
    step = target.step
    return target.recorded_step == step and isinstance(donor, list) and len(donor) > step < len(sigmas) and all(
        isinstance(d, (int, float)) and same_sigma(float(d), s) for d, s in zip(donor[:step + 1], sigmas[:step + 1],
                                                                               strict=True))

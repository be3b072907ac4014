"""The host side of one sampling run's reuse: what Carnator's sampling wrappers keep between the sampler's calls."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from carnator_core.reuse.cached_evaluation import Branches, CachedEvaluation, branches_of_state, same_sigma
from carnator_core.reuse.history_replay import HistoryReplay
from carnator_core.reuse.run import ReuseRun
from carnator_core.reuse.settings import ReuseSettings


class ReuseHolder:
    """The host side of one sampling run's reuse (as EasyCache keeps its holder), opened for the run
    (`nodes.reuse_lifecycle.open_run`) and dropped when it ends: the engine's `ReuseRun` (or why the run samples plain),
    what the outcome installed, the tensors the sampler is handed on its device, and the host's counters. The wrappers
    read it; the engine's fields are the engine's."""

    def __init__(self, settings: ReuseSettings, run: ReuseRun | None = None, plain_reason: str = "",
                 plain_notes: list[str] | None = None) -> None:
        self._node_settings = settings
        self.run = run
        # without a run: why the run samples plain, and the report's notes when other than the reason
        self.plain_reason = plain_reason
        self.plain_notes = plain_notes
        self.sampler_calls = 0  # the sampler's own model calls (the engine counts its probes)
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
    def settings(self) -> ReuseSettings:
        """The settings the run is judged by: the engine's (a calibration profile's thresholds, where one applies),
        else the node's."""
        return self.run.settings if self.run is not None else self._node_settings

    @property
    def active(self) -> bool:
        """Whether the run's hooks take part: the run has not been handed back to plain sampling."""
        return not self.sampling_plain_again

    def step_cache_of(self, evaluated: torch.Tensor) -> object | None:
        return next((cache for x, cache in self.probe_step_caches if x is evaluated), None)

    def branches_of(self, evaluated: torch.Tensor) -> tuple[list, Branches] | None:
        """The conditions and predictions per condition of the first batch evaluation of the probe at the state
        `evaluated`; None where its guider made none (then nothing of that probe is handed to the sampler)."""
        return next(((conds, branches) for x, conds, branches in self.probe_branches if x is evaluated), None)

    @property
    def checkpoint_sigmas(self) -> set[float]:
        """The sigmas of the steps the engine records (none once the recording stopped or the run samples plain)."""
        return self.run.checkpoint_sigmas if self.run is not None else set()

    # ------------------------------------------------------------------ what the wrappers ask
    @contextlib.contextmanager
    def probing(self) -> Iterator[None]:
        """One of the engine's probe evaluations: its batch evaluations and guidance are kept, nothing is served, and
        the sampler's hooks leave it alone."""
        self.capture_guidance, self.last_guidance, self.probe_outputs = True, None, []
        try:
            yield
        finally:
            self.capture_guidance = False

    def probe_done(self, states: list[torch.Tensor], batch: int) -> torch.Tensor | None:
        """After a probe evaluation of `states` (each `batch` long): keep each state's predictions per condition from
        the guider's first batch evaluation (the sampler's call makes that one first too); the guidance it captured."""
        if self.probe_outputs:
            outputs, conds = self.probe_outputs[0]
            self.probe_branches.extend((s, conds, branches_of_state(outputs, conds, index, batch))
                                       for index, s in enumerate(states))
        self.probe_outputs = []
        return self.last_guidance[1] if self.last_guidance is not None else None

    def next_offer(self, replayed: bool) -> CachedEvaluation | None:
        """The evaluation the outcome handed the sampler, for its next call the model answers (a replayed call keeps
        it for the call after)."""
        if replayed:
            return None
        offered, self.cached_eval = self.cached_eval, None
        return offered

    @contextlib.contextmanager
    def offering(self, offered: CachedEvaluation | None) -> Iterator[None]:
        """The sampler's call under way, whose first batch evaluation may be handed `offered` (`serve`)."""
        self.serving, self.served_call = offered, False
        try:
            yield
        finally:
            self.serving = None

    def serve(self, x: torch.Tensor, sigma: float, conditions: Sequence[object | None]) -> list[torch.Tensor] | None:
        """The predictions handed to this batch evaluation in place of the model's, or None for the model to answer:
        only the offered call's first one, only where the offer serves it (`CachedEvaluation.serves`)."""
        if self.serving is None or self.capture_guidance:
            return None
        offered, self.serving = self.serving, None
        if not offered.serves(x, sigma, conditions):
            return None
        self.served_call = self.altered = True
        return offered.predictions(x)

    def keep_batch(self, output: Sequence[torch.Tensor | None], conditions: Sequence[object | None],
                   sigma: float) -> None:
        """What a batch evaluation leaves the run: a probe's predictions per condition, and cond - uncond where a
        probe or a checkpoint needs it."""
        if self.capture_guidance:
            self.probe_outputs.append((list(output), list(conditions)))
        if len(output) < 2 or output[1] is None or conditions[1] is None:
            return
        if self.capture_guidance or any(same_sigma(sigma, s) for s in self.checkpoint_sigmas):
            self.last_guidance = (sigma, output[0] - output[1])

    def guidance_at(self, sigma: float) -> torch.Tensor | None:
        """The guidance direction the sampler's call at `sigma` computed, where it was kept."""
        kept = self.last_guidance
        return kept[1] if kept is not None and same_sigma(kept[0], sigma) else None

    def model_input_at(self, sigma: float, reported: torch.Tensor) -> torch.Tensor:
        """The state the model was given at `sigma`: samplers that keep their own scaled state (uni_pc divides it by
        sqrt(1 + sigma^2)) report that one in their step callback, and a probe or a resume must see the model's own."""
        given = self.model_input
        return given[1] if given is not None and same_sigma(given[0], sigma) else reported

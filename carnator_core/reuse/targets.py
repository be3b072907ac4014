"""What a decision can resume from: a donor's checkpoint, its first prediction and its stage's output.

These types sit below the modules that plan, correct and decide on them (`plan`, `start_difference`, `trajectory`,
`decision`), so each of those imports them without importing another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from carnator_core.lookup.shortlist import Candidate
from carnator_core.store.entry import EntryMeta


@dataclass
class StageEnd:
    """A donor stage's output (what its sampler returned, leftover noise included) and the trajectory around it."""

    sigma: float
    latent: torch.Tensor
    stage_steps: int
    trajectory_steps: int

    @property
    def share(self) -> float:
        """The stage's share of the trajectory's steps: the depth a request reaches by skipping it."""
        return self.stage_steps / max(1, self.trajectory_steps)


@dataclass
class StartPrediction:
    """What a donor's model predicted at its first state (step 0), and that state's fingerprint: a request that
    starts from the same state compares its own first evaluation with it (Decider._screen). A donor that started from
    an input also kept that state and its input: a request from a close input is compared with it."""

    meta: EntryMeta  # the entry that recorded it: the donor or, for a donor that itself resumed, up its lineage
    sigma: float
    state: str
    x0: torch.Tensor
    guidance: torch.Tensor | None
    x: torch.Tensor | None = None  # the first state itself, kept by a run from an input
    input: torch.Tensor | None = None  # and its input
    guide: torch.Tensor | None = None  # the image a guided run's conditioning carried


@dataclass
class ProbeTarget:
    """One donor checkpoint to probe: the state to evaluate at and what the donor predicted there. `step` is the
    request's step a resume from it starts at, `donor_step` the donor's step that recorded it (the same where the two
    schedules are one; `carnator_core.reuse.resume_point`), `sigma` the state's noise level."""

    candidate: Candidate
    meta: EntryMeta
    step: int
    sigma: float
    x: torch.Tensor
    x0: torch.Tensor
    guidance: torch.Tensor | None
    # The donor's shallowest checkpoint, when shallower than this one (for a donor that itself resumed, its own
    # donor's: see `_anchor_for`). Early in the schedule the prompt still decides layout and motion; later the
    # model mostly follows the state it is given, so a deeper probe can agree with a donor whose trajectory the
    # new prompt would not have taken (a motion word's opposite can pass half-way). Decider asks here first, and
    # deeper only after a pass, unless the donor's step-0 screen makes a deep pass nearly certain.
    anchor: ProbeTarget | None = None
    start: StartPrediction | None = None  # the donor's step 0, for Decider._screen
    end: StageEnd | None = None  # the donor's stage output, when the stage hands over to a later one
    corrected: bool = False  # moved by the request's step-0 difference from the donor (`start_difference`)
    donor_step: int | None = None  # None: `step`

    @property
    def recorded_step(self) -> int:
        """The donor's step that recorded this state (its tensors' names, its history)."""
        return self.step if self.donor_step is None else self.donor_step

    @property
    def depth(self) -> float:
        """How far through its schedule the donor was at this state: what the probe's thresholds are judged at."""
        return self.recorded_step / max(1, self.meta.total_steps)

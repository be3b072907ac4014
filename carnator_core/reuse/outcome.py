"""What the engine decided for one sampling run: one typed value the host installs, and the report renders.

`ReuseRun.decide` returns exactly one of three outcomes, each carrying the `Reason` the report gives and the branch of
the decision that produced it:

- `SkipStage`: the stage is skipped whole; the run returns the donor stage's output;
- `Resume`: sampling continues at a donor state, with the sampler's history replayed or not, and the probe's
  evaluation there handed to the sampler's next call;
- `SampleFresh`: sampling starts at step 0, with the step-0 screen's evaluation handed to the sampler's first call
  where the screen made one.

Tensors are as the engine holds them (the store's device and dtype): the host converts them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from carnator_core.reuse.decision import Decision
from carnator_core.reuse.history_replay import HistoryReplay


@dataclass(frozen=True)
class Reason:
    """Why the run does what it does: `branch` names the branch of the decision that chose it (stable, for code and
    tests), `text` is what the report says ("" for a hit, whose report names its donor instead)."""

    branch: str
    text: str = ""


@dataclass(frozen=True)
class ServedEvaluation:
    """A model evaluation made while deciding, for the sampler's next call: the one made at the state `evaluated`
    (the host kept its predictions per condition by that state), handed to a call at `at` and `sigma` (`at` None: at
    `sigma` whatever the state, after a replay); `exact`: only to the identical state (`CachedEvaluation`)."""

    evaluated: torch.Tensor
    at: torch.Tensor | None
    sigma: float
    exact: bool


@dataclass(frozen=True)
class SkipStage:
    """Skip the stage whole: return the donor stage's output (`sigma`: the stage's last, with leftover noise)."""

    output: torch.Tensor
    sigma: float
    decision: Decision
    reason: Reason


@dataclass(frozen=True)
class Resume:
    """Sample on from step `step` at `state`; `replay` retraces the donor's trajectory to it for a multistep sampler
    (None: the sampler starts there, without history). `continues_from` is the probe's state, whose step-cache state
    the run adopts; `served` its evaluation, where the host kept it; `boost_sigmas` the steps guided harder."""

    step: int
    sigma: float
    state: torch.Tensor
    replay: HistoryReplay | None
    continues_from: torch.Tensor
    served: ServedEvaluation | None
    boost_sigmas: frozenset[float]
    decision: Decision
    reason: Reason


@dataclass(frozen=True)
class SampleFresh:
    """Sample from step 0. `served`: the step-0 screen's evaluation of the request's own start state, and
    `continues_from` that state, whose step-cache state the run adopts (both None where the screen made none)."""

    served: ServedEvaluation | None
    continues_from: torch.Tensor | None
    reason: Reason


Outcome = SkipStage | Resume | SampleFresh

"""A model evaluation made while deciding, handed to the sampler's next call in place of the model.

The step-0 screen and the accepted probe are the request's own evaluations: the sampler's first call after them gets
the result instead of evaluating again, so deciding costs a miss nothing and a resume one call less. What is handed
over is the model's prediction per condition (the guider's batch evaluation, before CFG), never the guided output:
the host then combines it through its whole CFG path (CFG functions, pre- and post-CFG hooks, what a CFG++ sampler
reads of the unconditional prediction) exactly as it would combine the model's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

SIGMA_TOLERANCE = 1e-6  # sigmas that differ by less are one step (schedules pass through float conversions)


def same_sigma(a: float, b: float) -> bool:
    return abs(a - b) < SIGMA_TOLERANCE


Branches = list[torch.Tensor | None]  # the model's prediction per condition of one call; None: not evaluated


def branches_of_state(outputs: Sequence[torch.Tensor], conditions: Sequence[object | None], index: int,
                      batch: int) -> Branches:
    """The predictions of the `index`-th state of an evaluation that stacked several states of `batch` each; a
    condition the call did not evaluate (None: the host fills its place with zeros) is None."""
    return [None if condition is None else output[index * batch:(index + 1) * batch]
            for output, condition in zip(outputs, conditions, strict=True)]


@dataclass
class CachedEvaluation:
    """Predictions made while probing that the sampler's next call at `x`, `sigma` gets instead of the model.

    `exact`: served only for the identical state (step 0 without a resume: the output must be bit-identical to the
    plain sampler's); a resume's state comes back through the sampler's noise scaling, equal only to rounding. `x`
    None: served at `sigma` whatever the state (a replayed run reaches the state it was made at up to the rounding of
    the recorded predictions, `carnator_core.reuse.history_replay`). `conditions` are the host's own condition
    objects the probe evaluated, compared by identity: a call that evaluates others (a sampler that asks for the
    unconditional prediction at CFG 1, a guidance patch's extra evaluation) is not served: the model answers it.
    """

    x: torch.Tensor | None
    sigma: float
    conditions: Sequence[object | None]
    branches: Branches
    exact: bool

    def serves(self, x: torch.Tensor, sigma: float, conditions: Sequence[object | None]) -> bool:
        """Whether this answers a batch evaluation of `conditions` at `x`, `sigma`."""
        if not same_sigma(self.sigma, sigma) or len(conditions) != len(self.conditions):
            return False
        if any(asked is not kept for asked, kept in zip(conditions, self.conditions, strict=True)):
            return False
        if any(branch is not None and branch.shape != x.shape for branch in self.branches):
            return False
        if self.x is None:
            return True
        return torch.equal(self.x, x) if self.exact else torch.allclose(self.x, x, rtol=1e-4, atol=1e-5)

    def predictions(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The predictions as the host's batch evaluation at `x` returns them: copies (the host may write into its
        own), zeros where a condition was not evaluated."""
        return [torch.zeros_like(x) if branch is None else branch.clone() for branch in self.branches]

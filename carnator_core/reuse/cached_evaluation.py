"""A model evaluation made while deciding, handed to the sampler's next call in place of the model.

The step-0 screen and the accepted probe are the request's own evaluations: the sampler's first call after them gets
the result instead of evaluating again, so deciding costs a miss nothing and a resume one call less.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SIGMA_TOLERANCE = 1e-6  # sigmas that differ by less are one step (schedules pass through float conversions)


def same_sigma(a: float, b: float) -> bool:
    return abs(a - b) < SIGMA_TOLERANCE


@dataclass
class CachedEvaluation:
    """A model evaluation made while probing that the sampler's next call at `x`, `sigma` gets instead of the model.

    `exact`: served only for the identical state (step 0 without a resume: the output must be bit-identical to the
    plain sampler's); a resume's state comes back through the sampler's noise scaling, equal only to rounding. `x`
    None: served at `sigma` whatever the state (a replayed run reaches the state it was made at up to the rounding of
    the recorded predictions, `carnator_core.reuse.history_replay`).
    """

    x: torch.Tensor | None
    sigma: float
    x0: torch.Tensor
    guidance: torch.Tensor | None
    exact: bool

    def serves(self, x: torch.Tensor, sigma: float) -> bool:
        if not same_sigma(self.sigma, sigma) or self.x0.shape != x.shape:
            return False
        if self.x is None:
            return True
        return torch.equal(self.x, x) if self.exact else torch.allclose(self.x, x, rtol=1e-4, atol=1e-5)

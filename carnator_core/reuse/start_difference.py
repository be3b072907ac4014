"""What a request's first evaluation differs by from a same-noise donor's, and the donor state corrected by it.

A request and a donor sampled from the same initial noise share their first state, so at step 0 the request's own
prediction differs from the donor's only where their prompts differ. Carried along the donor's trajectory as far as
sampling has moved towards the prediction (one Euler step from sigma_0 to sigma_k moves the state by
`1 - sigma_k / sigma_0` of a change in the prediction), that difference gives the corrected donor state

    x_k + (1 - sigma_k / sigma_0) (x0_new_0 - x0_donor_0)

Where the prompts agree it is the donor's state; where they differ, the request's own estimate: region-level reuse
without a mask. A one-attribute edit (another background, another shape) resumed there ends closer to its own plain
clip than from the donor's state, or from its own step-0 estimate alone (docs/measurements.md, "What a donor adds to a
one-attribute edit"). The probe at the corrected state compares the live prediction with the donor's moved by the same
difference, so it judges what step 0 could not see: whether the rest of the donor's trajectory still holds.

A run from an input (`carnator_core.reuse.input_start`) and its donor start from states that differ too, by their
inputs. The same Euler step keeps `sigma_k / sigma_0` of a difference in the first state, so their corrected donor
state is

    x_k + (1 - sigma_k / sigma_0) (x0_new_0 - x0_donor_0) + (sigma_k / sigma_0) (x_new_0 - x_donor_0)

Both predictions are rounded as the store rounds what it records (float16) before subtracting, so for an identical
prompt the difference is exactly zero and every corrected tensor equals the donor's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from carnator_core.reuse.probe import downsample_guidance
from carnator_core.reuse.targets import ProbeTarget, StartPrediction


def _as_stored(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor rounded as the recording stores predictions (a no-op on a recorded one), in float32."""
    return tensor.detach().to(torch.float16).float()


@dataclass(frozen=True)
class StartDifference:
    """The request's step-0 prediction (and guidance, pooled as recorded) minus a same-noise donor's."""

    sigma: float  # the first sigma, where both predictions were made
    x0: torch.Tensor
    guidance: torch.Tensor | None  # None when either side has no guidance or their shapes differ

    # the request's first state minus the donor's, when they differ (runs from an input); None: the same state
    state: torch.Tensor | None = None

    @classmethod
    def between(cls, donor: StartPrediction, x0_new: torch.Tensor, guidance_new: torch.Tensor | None,
                start_state: torch.Tensor) -> StartDifference:
        """The difference to `donor`'s step 0, for a request that started from `start_state` (the donor's own, or,
        for a donor from another input, its recorded state)."""
        difference = cls.of(donor.sigma, x0_new, donor.x0, guidance_new, donor.guidance)
        if donor.x is None:
            return difference
        return replace(difference, state=_as_stored(start_state) - _as_stored(donor.x.to(start_state.device)))

    @classmethod
    def of(cls, sigma: float, x0_new: torch.Tensor, x0_donor: torch.Tensor, guidance_new: torch.Tensor | None,
           guidance_donor: torch.Tensor | None) -> StartDifference:
        """The difference of two step-0 evaluations at `sigma`; the guidance's where both have one (pooled to the
        donor's recorded size)."""
        guidance = None
        if guidance_new is not None and guidance_donor is not None and guidance_donor.ndim in (4, 5):
            pooled = downsample_guidance(guidance_new, tuple(guidance_donor.shape[2:]))
            if pooled.shape == guidance_donor.shape:
                guidance = _as_stored(pooled) - _as_stored(guidance_donor.to(pooled.device))
        return cls(sigma=sigma, x0=_as_stored(x0_new) - _as_stored(x0_donor.to(x0_new.device)), guidance=guidance)

    def without_prediction(self) -> StartDifference | None:
        """Only the first states' difference (None without one), for runs with CFG guidance. The step-0 prediction
        difference is measured where the correction was calibrated, without CFG; with it the step-0 difference is the
        guidance-amplified one, and the official Wan 2.1 template's rewordings (uni_pc, cfg 6) agreed less at the
        corrected state than at the donor's (docs/measurements.md, "Resuming screened donors at the corrected
        state")."""
        if self.state is None:
            return None
        return replace(self, x0=torch.zeros_like(self.x0), guidance=None)

    def moved(self, sigma: float) -> float:
        """How far sampling from the first sigma to `sigma` has moved the state towards the prediction."""
        return 1.0 - sigma / self.sigma if self.sigma > 0 else 1.0

    def state_at(self, x: torch.Tensor, sigma: float) -> torch.Tensor:
        """The donor's state `x` at `sigma`, corrected (in float32: a recorded state is float16). Of a difference in
        the first state, the part sampling has not yet moved away from carries over."""
        moved = self.moved(sigma)
        corrected = x.float() + moved * self.x0.to(x.device)
        return corrected if self.state is None else corrected + (1.0 - moved) * self.state.to(x.device)

    def prediction(self, x0: torch.Tensor) -> torch.Tensor:
        """The donor's prediction `x0` moved by the difference: what the request should predict at the corrected
        state if the rest of the donor's trajectory holds for it."""
        return x0.float() + self.x0.to(x0.device)

    def corrected(self, target: ProbeTarget) -> ProbeTarget:
        """The target at the corrected donor state, with the donor's prediction (and guidance) moved alike."""
        guidance = target.guidance
        if guidance is not None and self.guidance is not None and self.guidance.shape == guidance.shape:
            guidance = guidance.float() + self.guidance.to(guidance.device)
        return replace(target, x=self.state_at(target.x, target.sigma), x0=self.prediction(target.x0),
                       guidance=guidance, corrected=True)

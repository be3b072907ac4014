"""What one probe measured: the agreement signals `carnator_core.reuse.probe` computes at a donor checkpoint.

Plain values, no tensors: kept apart from the measuring so that the thresholds that judge them (`probe_thresholds`)
sit as low as the calibration profile that holds fitted thresholds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass


def weakest_agreement(structure: float, other_parts: Iterable[float] = ()) -> float:
    """The lowest of a packed latent's per-part structure agreements (NaN when any is NaN: it fails every bar)."""
    values = [structure, *other_parts]
    return float("nan") if any(math.isnan(value) for value in values) else min(values)


@dataclass
class ProbeSignals:
    depth: float  # fraction of the schedule the donor state has already covered (k / steps)
    raw_agreement: float
    structure_agreement: float
    guidance_cosine: float | None  # None without CFG (no uncond half to subtract)
    # a packed latent's other parts (LTX-2's audio), in packing order: each part's structure agreement
    other_parts_agreement: tuple[float, ...] = ()
    # measured at a corrected donor state against the donor's prediction moved alike (`start_difference`)
    corrected: bool = False
    # the structure agreement of the conditional branches alone, where the CFG scale and the live guidance are known
    # (`conditional_agreement`); the step-0 screen is judged on it
    conditional_agreement: float | None = None

    @property
    def weakest_structure(self) -> float:
        """The lowest structure agreement of the latent's parts: what the structure bar is compared with. Where the
        conditional branches' agreement was measured (the step-0 screen with CFG) it stands for the output's."""
        first = self.structure_agreement if self.conditional_agreement is None else self.conditional_agreement
        return weakest_agreement(first, self.other_parts_agreement)

    def as_dict(self) -> dict[str, float | None | list[float] | bool]:
        data = asdict(self)
        if self.other_parts_agreement:
            data["other_parts_agreement"] = list(self.other_parts_agreement)
        else:
            del data["other_parts_agreement"]
        if not self.corrected:
            del data["corrected"]
        if self.conditional_agreement is None:
            del data["conditional_agreement"]
        return data

"""The probe's acceptance rule: the depth-dependent bar a probe's signals must pass.

Here rather than beside the measuring code (`carnator_core.reuse.probe`) because a calibration profile holds fitted
values of it and is checked against its defaults, the shipped rule, wherever the profile is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from carnator_core.judging.probe_signals import ProbeSignals


@dataclass
class ProbeThresholds:
    """Depth-dependent acceptance: deeper resumes must agree more (threshold + slope x depth).

    Why the slope: deeper in the schedule the model follows the state it is given more closely, so agreement
    rises with depth for every donor and the bar must rise with it. The defaults follow the lowest structure
    threshold that, in the probe calibration, let no resume through that lost quality against plain sampling.
    """

    structure: float = 0.85
    structure_slope: float = 0.09
    guidance: float = 0.80
    guidance_slope: float = 0.09
    # A donor that misses the structure threshold by more than this at one depth is given up: its agreement moves
    # with depth about as the threshold does, so it would miss at the others too. (Checkpoints holding a step
    # cache's extrapolation would break this; the planner never offers them.)
    give_up_margin: float = 0.05
    # A mode that contains a shallower one asks a deep state first where the step-0 screen clears that state's bar by
    # this much: a failed first call costs one call and a pass saves at least one, so the deep probe must be more
    # likely to pass than not. Below this margin no deep probe of the calibration streams passed at cfg 1; above it
    # most did, at every guidance scale measured (docs/measurements.md, "Deep first where the screen makes it likely").
    deep_first_margin: float = 0.03

    def needed_structure(self, depth: float) -> float:
        return min(1.0, self.structure + self.structure_slope * depth)

    def passes(self, signals: ProbeSignals) -> bool:
        """Every part's structure agreement (NaN fails) and the guidance cosine, each at the depth's bar. A probe at
        a corrected donor state meets the same bar: the correction changes what is compared, not how strictly
        (`bench probe --shortcuts` measures both, docs/measurements.md)."""
        if not signals.weakest_structure >= self.needed_structure(signals.depth):
            return False
        if signals.guidance_cosine is None:
            return True
        needed_guidance = min(1.0, self.guidance + self.guidance_slope * signals.depth)
        return signals.guidance_cosine >= needed_guidance

    def screen_clears(self, signals: ProbeSignals, margin: float) -> bool:
        """Whether step-0 `signals`, taken at a deeper state's depth, pass its bar with `margin` to spare."""
        return self.passes(signals) and signals.weakest_structure >= self.needed_structure(signals.depth) + margin

    def donor_hopeless(self, signals: ProbeSignals) -> bool:
        """Whether a failed probe says the donor's other checkpoints are not worth a model call either. Never at a
        corrected state: there agreement falls with depth (an edited region drifts further from the donor's the
        longer the donor sampled it), so a deep miss says nothing of a shallower checkpoint."""
        if signals.corrected:
            return False
        return not signals.weakest_structure >= self.needed_structure(signals.depth) - self.give_up_margin

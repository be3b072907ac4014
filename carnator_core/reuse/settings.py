"""Reuse settings: the three modes and every threshold a user can override."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from carnator_core.reuse.probe import ProbeThresholds

MODES = ("safe", "balanced", "fast")
RESUME_LIMITS = {"safe": 0.0, "balanced": 0.5, "fast": 0.8}  # how deep into the schedule each mode may resume
MAX_AUTO_PROBE_BATCH = 4  # donor states per probe call when the host picks the number
SEED_POLICIES = ("same-noise", "serving")
VERIFICATIONS = ("model", "text-only")


@dataclass
class ReuseSettings:
    """What a Carnator reuse node asks of every sampling run it patches.

    - `safe`: sparsity reuse only (output differs from plain only through attention masks).
    - `balanced`: also resume from a verified donor state, at most half-way through the schedule.
    - `fast`: resume up to 80% of the way.
    Seed policy `same-noise` (default) takes latent donors only with the identical initial
    noise: a changed seed is a request for a different sample. `serving` takes any donor.
    """

    mode: str = "balanced"
    store_directory: str = ""
    prompt: str = ""
    top_k: int = 4
    min_similarity: float = 0.5
    max_probes: int = 3  # probe calls (model evaluations) per run
    probe_batch: int = 0  # donor states per probe call; 0 = auto (the host decides from free memory)
    seed_policy: str = "same-noise"
    checkpoint_fractions: tuple[float, ...] = (0.2, 0.35, 0.5, 0.65, 0.8)
    thresholds: ProbeThresholds = field(default_factory=ProbeThresholds)
    record: bool = True
    guidance_boost: float = 0.0  # extra CFG scale right after a resume (0 = off)
    guidance_boost_steps: int = 0
    verification: str = "model"  # "text-only" is the unverified baseline the benchmark compares against

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.seed_policy not in SEED_POLICIES:
            raise ValueError(f"seed policy must be one of {SEED_POLICIES}, got {self.seed_policy!r}")
        if self.verification not in VERIFICATIONS:
            raise ValueError(f"verification must be one of {VERIFICATIONS}, got {self.verification!r}")
        if self.probe_batch < 0:
            raise ValueError(f"probe batch must be 0 (auto) or positive, got {self.probe_batch}")
        if any(not 0.0 < f < 1.0 for f in self.checkpoint_fractions):
            raise ValueError("checkpoint fractions must lie strictly between 0 and 1")

    @property
    def max_resume_fraction(self) -> float:
        """How deep into the schedule a resume may start."""
        return RESUME_LIMITS[self.mode]

    @property
    def fallback_resume_fraction(self) -> float | None:
        """Where a run's last probe goes when none has been as shallow yet: balanced's limit, for fast.

        Why: a one-word colour edit fails deep probes (appearance is settled there) yet may pass half-way.
        Spending the whole budget deep, fast once ran such a request in full where balanced resumed it.
        """
        balanced = RESUME_LIMITS["balanced"]
        return balanced if self.max_resume_fraction > balanced else None

    def checkpoint_steps(self, total_steps: int) -> list[int]:
        """Steps at which a run records (x_k, x0_k, guidance_k) for later requests.

        Step 0 always: it is what later requests confirm a donor on (`ReuseRun._screen`), never a resume point.
        """
        steps = {round(f * total_steps) for f in self.checkpoint_fractions}
        return [0] + sorted(s for s in steps if 0 < s < total_steps)

    def replace(self, **changes) -> ReuseSettings:
        return dataclasses.replace(self, **changes)

"""Reuse settings: the three modes and every threshold a user can override.

The reuse nodes read their widgets' defaults and ranges from here (`input_default`, `input_range`) and build
settings through `ReuseSettings.from_inputs`, so a node input is defined, defaulted and checked in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from carnator_core.judging.calibration_profile import Profile
from carnator_core.judging.probe_thresholds import ProbeThresholds

MODES = ("safe", "balanced", "fast")
RESUME_LIMITS = {"safe": 0.0, "balanced": 0.5, "fast": 0.8}  # how deep into the schedule each mode may resume
EVERY_STEP_UP_TO = 8  # schedules this short record a checkpoint at every step
MAX_AUTO_PROBE_BATCH = 4  # donor states per probe call when the host picks the number
SEED_POLICIES = ("same-noise", "serving")
# Where a forced resume (calibration) starts: the fractions every run records a checkpoint at.
FORCED_DEPTHS = (0.2, 0.35, 0.5, 0.65, 0.8)
VERIFICATIONS = ("model", "text-only", *(f"forced {round(depth * 100)}%" for depth in FORCED_DEPTHS))

# Node inputs that set `ProbeThresholds` fields, by input name: depth_slope sets both slopes. Each input's default is
# its first field's.
THRESHOLD_FIELDS = {"structure_threshold": ("structure",), "guidance_threshold": ("guidance",),
                    "depth_slope": ("structure_slope", "guidance_slope")}
# The range of every numeric node input, by input name: the schemas offer it and `from_inputs` enforces it.
INPUT_RANGES: dict[str, tuple[float, float]] = {
    "top_k": (1, 64),
    "min_similarity": (-1.0, 1.0),
    "max_probes": (0, 16),
    "structure_threshold": (-1.0, 1.0),
    "guidance_threshold": (-1.0, 1.0),
    "depth_slope": (0.0, 1.0),
    "guidance_boost": (0.0, 2.0),
    "guidance_boost_steps": (0, 20),
    "probe_batch": (0, 16),
}


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
    store_location: str = ""  # the store's location: a directory or a store URL (empty: the default store)
    prompt: str = ""
    top_k: int = 4
    min_similarity: float = 0.5
    max_probes: int = 3  # probe calls (model evaluations) per run; fast makes at most one more (`Decider._probe`)
    # Same-noise donors the step-0 screen may judge, most similar first, whatever their similarity: the screen is
    # the request's own first evaluation, so this bounds reading their step-0 records, not model calls.
    screen_limit: int = 16
    probe_batch: int = 0  # donor states per probe call; 0 = auto (the host decides from free memory)
    seed_policy: str = "same-noise"
    checkpoint_fractions: tuple[float, ...] = (0.2, 0.35, 0.5, 0.65, 0.8)
    thresholds: ProbeThresholds = field(default_factory=ProbeThresholds)
    record: bool = True
    # an exact repeat of a stored run (every sampler input, and the first prediction bit for bit) returns its output
    exact_repeats: bool = True
    guidance_boost: float = 0.0  # extra CFG scale right after a resume (0 = off)
    guidance_boost_steps: int = 0
    # "text-only" is the unverified baseline the benchmark compares against; "forced N%" resumes at N% of the
    # steps whatever the signals say, recording them (what calibration measures)
    verification: str = "model"
    prompt_note: str = ""  # where `prompt` came from when a node read it from the graph, or why it found none
    # The `thresholds` fields the node set away from their defaults: a calibration profile leaves them alone
    explicit_thresholds: frozenset[str] = frozenset()
    judged_by: str = ""  # whose thresholds judge: a calibration profile, the node's inputs or the shipped ones
    thresholds_note: str = ""  # why no calibration profile judges, where one was refused (`with_profile`)
    # the judging profile's verdict on this mode against plain at fewer steps, for the report of a resumed run
    profile_verdict: str = ""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.seed_policy not in SEED_POLICIES:
            raise ValueError(f"seed_policy must be one of {SEED_POLICIES}, got {self.seed_policy!r}")
        if self.verification not in VERIFICATIONS:
            raise ValueError(f"verification must be one of {VERIFICATIONS}, got {self.verification!r}")
        if any(not 0.0 < f < 1.0 for f in self.checkpoint_fractions):
            raise ValueError("checkpoint fractions must lie strictly between 0 and 1")

    @classmethod
    def from_inputs(cls, store_location: str = "", prompt: str | None = "", **inputs) -> ReuseSettings:
        """Settings from a reuse node's inputs, by the names the node declares; an input left out takes its default.

        Raises ValueError naming the input when a number lies outside its range (`INPUT_RANGES`) or a choice is
        not one the node offers.
        """
        for name, (low, high) in INPUT_RANGES.items():
            value = inputs.get(name, input_default(name))
            if not low <= value <= high:  # NaN fails too
                raise ValueError(f"{name} must lie between {low} and {high}, got {value!r}")
        explicit = frozenset(field_name for name, fields_set in THRESHOLD_FIELDS.items()
                             if inputs.get(name, input_default(name)) != input_default(name) for field_name in fields_set)
        slope = inputs.pop("depth_slope", input_default("depth_slope"))
        thresholds = ProbeThresholds(structure=inputs.pop("structure_threshold", input_default("structure_threshold")),
                                     guidance=inputs.pop("guidance_threshold", input_default("guidance_threshold")),
                                     structure_slope=slope, guidance_slope=slope)
        return cls(store_location=store_location, prompt=prompt or "", thresholds=thresholds,
                   explicit_thresholds=explicit, **inputs)

    def with_profile(self, profile: Profile | None, note: str = "") -> ReuseSettings:
        """These settings judged by `profile`'s thresholds where the node left its threshold inputs at their defaults
        (`auto`). `judged_by` names what judges, for the report and the badge; `note` (why no profile applies) goes
        to the report's notes."""
        own = "node inputs" if self.explicit_thresholds else "shipped thresholds"
        if profile is None:
            return self.replace(judged_by=own, thresholds_note=note)
        fitted = {name: value for name, value in profile.thresholds.items() if name not in self.explicit_thresholds}
        if not fitted:
            return self.replace(judged_by=own, thresholds_note=f"{profile.describe()} not used: every threshold is "
                                                                "set on the node")
        kept = f" with node inputs for {', '.join(sorted(self.explicit_thresholds))}" if self.explicit_thresholds else ""
        weighed = profile.equal_quality.get(self.mode)
        return self.replace(thresholds=dataclasses.replace(self.thresholds, **fitted),
                            judged_by=profile.describe() + kept, thresholds_note=note,
                            profile_verdict="" if weighed is None else weighed.short(self.mode))

    @property
    def forced_resume_fraction(self) -> float | None:
        """Where a forced resume starts (verification "forced N%"), None when the model decides."""
        if not self.verification.startswith("forced "):
            return None
        return FORCED_DEPTHS[VERIFICATIONS.index(self.verification) - 2]

    @property
    def contained_resume_fraction(self) -> float | None:
        """The resume depth of the next shallower mode that resumes (balanced's, for fast): this mode resumes at least
        as deep as that mode, at most one call dearer (`Decider._probe`). None where no shallower mode resumes, and
        for a forced resume."""
        if self.forced_resume_fraction is not None:
            return None
        shallower = [RESUME_LIMITS[mode] for mode in MODES[:MODES.index(self.mode)] if RESUME_LIMITS[mode] > 0]
        return shallower[-1] if shallower else None

    @property
    def max_resume_fraction(self) -> float:
        """How deep into the schedule a resume may start: the mode's limit, or a forced resume's depth."""
        forced = self.forced_resume_fraction
        return RESUME_LIMITS[self.mode] if forced is None else forced

    def probe_batch_limit(self, on_cpu: bool, fits: Callable[[int], bool]) -> int:
        """Donor states per probe call: the user's number, else (auto) the most, up to MAX_AUTO_PROBE_BATCH, that
        `fits` (the host's memory check for a call of that many states) allows. On CPU auto is 1: a batched call
        there costs as much as the separate calls, and those can stop at the first pass."""
        if self.probe_batch > 0:
            return self.probe_batch
        if on_cpu:
            return 1
        limit = 1
        for states in range(2, MAX_AUTO_PROBE_BATCH + 1):
            if not fits(states):
                break
            limit = states
        return limit

    def boost_sigmas(self, sigmas: list[float], start: int) -> set[float]:
        """The sigmas of the steps after a resume at `start` that sample with the guidance boost."""
        return set(sigmas[start:start + self.guidance_boost_steps]) if self.guidance_boost > 0 else set()

    def checkpoint_steps(self, total_steps: int) -> list[int]:
        """Steps at which a run records (x_k, x0_k, guidance_k) for later requests.

        Step 0 always: it is what later requests confirm a donor on (`Decider._screen`), never a resume point.
        Few-step schedules (distilled models, LoRAs such as lightx2v) record every step: each step is a large
        share of the run, and the fractions would leave some steps out.
        """
        if total_steps <= EVERY_STEP_UP_TO:
            return list(range(total_steps))
        steps = {round(f * total_steps) for f in self.checkpoint_fractions}
        return [0] + sorted(s for s in steps if 0 < s < total_steps)

    def replace(self, **changes) -> ReuseSettings:
        return dataclasses.replace(self, **changes)


def input_default(name: str):
    """The default of the reuse node input `name`: the field's default here, or in `ProbeThresholds`."""
    if name in THRESHOLD_FIELDS:
        return getattr(ProbeThresholds, THRESHOLD_FIELDS[name][0])
    return next(f.default for f in dataclasses.fields(ReuseSettings) if f.name == name)


def input_range(name: str) -> dict[str, float]:
    """The schema's `min` and `max` of the numeric reuse node input `name`."""
    low, high = INPUT_RANGES[name]
    return {"min": low, "max": high}

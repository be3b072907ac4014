"""A calibration profile: probe thresholds fitted on one model and schedule, and how well they did.

A profile is plain JSON (never pickle) so it can be read, exported, hand-edited and imported; `Profile.from_json`
therefore trusts nothing: every field is type- and range-checked, NaN and infinities are refused, and so is a
document larger than `MAX_PROFILE_BYTES`. A profile applies to the model fingerprint (weights, LoRAs and their
strengths) and the sigma schedule fingerprint (step count, scheduler, shift) it was measured on, at the guidance
scale it was measured at, and to no other: thresholds are a property of the model's trajectories over that
schedule.

A profile judges runs only while `in_force`: calibration puts it in force where its held-back pairs support it
(`reason` says why or why not), or `forced` where the user puts it in force anyway. A document that claims to be in
force without held-back support, and is not marked forced, is refused like any other inconsistent field.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from carnator_core.reuse.probe import ProbeThresholds

PROFILE_FORMAT = "carnator-calibration-profile"
PROFILE_VERSION = 2
MAX_PROFILE_BYTES = 64 * 1024
# the fitted `ProbeThresholds` fields and the range each may take
THRESHOLD_RANGES = {"structure": (0.0, 1.0), "structure_slope": (0.0, 1.0),
                    "guidance": (0.0, 1.0), "guidance_slope": (0.0, 1.0)}
MAX_REASON = 500
FORCED_NOTE = "put in force without held-back support"


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the field and what is wrong with it."""


@dataclass(frozen=True)
class QualityTarget:
    """When a resume counts as good: its clip within `psnr_db` of the new prompt's plain clip and at least `ssim`
    similar to it. The fit keeps at least `precision` of accepted resumes good."""

    psnr_db: float = 30.0
    ssim: float = 0.95
    precision: float = 0.95

    def good(self, psnr_db: float, ssim: float) -> bool:
        return psnr_db >= self.psnr_db and ssim >= self.ssim


@dataclass(frozen=True)
class Score:
    """A rule's result on a set of resumes: accepted, good, and of those the shares (None where undefined)."""

    accepted: int
    good: int
    precision: float | None
    recall: float | None

    @classmethod
    def of(cls, accepted: list[bool], good: list[bool]) -> Score:
        hits = sum(a and g for a, g in zip(accepted, good, strict=True))
        return cls(accepted=sum(accepted), good=sum(good),
                   precision=hits / sum(accepted) if any(accepted) else None,
                   recall=hits / sum(good) if any(good) else None)


@dataclass(frozen=True)
class Profile:
    """Thresholds fitted for one model and schedule, the target they were fitted for and their held-back score."""

    model: str
    schedule: str
    name: str
    thresholds: dict[str, float]
    target: QualityTarget = field(default_factory=QualityTarget)
    fit_pairs: int = 0
    held_back_pairs: int = 0
    held_back: Score = field(default_factory=lambda: Score(0, 0, None, None))
    oracle: Score | None = None  # held-back resumes judged by the demo world's oracle, where the demo model ran
    cfg: float = 1.0  # the guidance scale it was measured at: trajectories under another scale are not its
    created_at: float = field(default_factory=time.time)
    in_force: bool = False  # whether it judges runs (the shipped thresholds do otherwise)
    reason: str = "not decided"  # one line: why it is in force or not
    forced: bool = False  # put in force by the user (`--force`) whatever its held-back pairs say

    @property
    def key(self) -> str:
        return profile_key(self.model, self.schedule)

    def probe_thresholds(self, base: ProbeThresholds | None = None) -> ProbeThresholds:
        """`base` (default: the shipped thresholds) with the fitted fields in place."""
        values = asdict(base or ProbeThresholds())
        values.update(self.thresholds)
        return ProbeThresholds(**values)

    def supported(self) -> bool:
        """Whether its held-back pairs support putting it in force: their precision meets the target, or it accepted
        none of them and is nowhere looser than the shipped rule (a profile that resumes nothing)."""
        held = self.held_back
        if held.precision is not None:
            return held.precision >= self.target.precision
        shipped = asdict(ProbeThresholds())
        return held.accepted == 0 and all(value >= shipped[name] for name, value in self.thresholds.items())

    def describe(self) -> str:
        """How the report and the store panel name it."""
        day = time.strftime("%Y-%m-%d", time.gmtime(self.created_at))
        forced = f" ({FORCED_NOTE})" if self.forced else ""
        return f"profile {self.name!r} ({day}, {self.fit_pairs + self.held_back_pairs} pairs){forced}"

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **data}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, allow_nan=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> Profile:
        """The profile in `text`; ProfileError says why it cannot be used."""
        if len(text) > MAX_PROFILE_BYTES:
            raise ProfileError(f"profile of {len(text)} bytes refused: a profile is at most {MAX_PROFILE_BYTES}")
        try:
            data = json.loads(text, parse_constant=_refuse_constant)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ProfileError(f"profile is not JSON: {error}") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        if not isinstance(data, dict):
            raise ProfileError("profile is not a JSON object")
        if data.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"not a Carnator calibration profile (format {data.get('format')!r})")
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(f"profile version {data.get('version')!r} is not {PROFILE_VERSION}")
        thresholds = _mapping(data, "thresholds")
        if set(thresholds) != set(THRESHOLD_RANGES):
            raise ProfileError(f"thresholds must hold exactly {sorted(THRESHOLD_RANGES)}, got {sorted(thresholds)}")
        target = _mapping(data, "target")
        oracle = data.get("oracle")
        profile = cls(
            model=_text(data, "model", 64), schedule=_text(data, "schedule", 64), name=_text(data, "name", 200),
            thresholds={name: _number(thresholds, name, *limits) for name, limits in THRESHOLD_RANGES.items()},
            target=QualityTarget(psnr_db=_number(target, "psnr_db", 0.0, 100.0), ssim=_number(target, "ssim", -1.0, 1.0),
                                 precision=_number(target, "precision", 0.0, 1.0)),
            fit_pairs=int(_number(data, "fit_pairs", 0, 10_000)),
            held_back_pairs=int(_number(data, "held_back_pairs", 0, 10_000)),
            held_back=_score(_mapping(data, "held_back"), "held_back"),
            oracle=None if oracle is None else _score(oracle, "oracle"), cfg=_number(data, "cfg", 0.0, 100.0),
            created_at=_number(data, "created_at", 0.0, 1e11), in_force=_flag(data, "in_force"),
            reason=_text(data, "reason", MAX_REASON), forced=_flag(data, "forced"))
        if profile.in_force and not profile.forced and not profile.supported():
            raise ProfileError("profile field 'in_force' is true but its held-back precision "
                               f"({profile.held_back.precision}) does not meet its target ({profile.target.precision}): "
                               "put it in force with --force, which marks it 'forced'")
        if profile.forced and not profile.in_force:
            raise ProfileError("profile field 'forced' is true but 'in_force' is false")
        return profile


def profile_key(model: str, schedule: str) -> str:
    """The store's key of the profile for a model fingerprint and a schedule fingerprint."""
    return f"{model}/{schedule}"


def _refuse_constant(name: str) -> float:
    raise ProfileError(f"profile holds {name}: every number must be finite")


def _mapping(data: dict, name: str) -> dict:
    value = data.get(name)
    if not isinstance(value, dict):
        raise ProfileError(f"profile field {name!r} must be an object")
    return value


def _text(data: dict, name: str, limit: int) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not value or len(value) > limit:
        raise ProfileError(f"profile field {name!r} must be a non-empty string of at most {limit} characters")
    return value


def _flag(data: dict, name: str) -> bool:
    value = data.get(name)
    if not isinstance(value, bool):
        raise ProfileError(f"profile field {name!r} must be true or false, got {value!r}")
    return value


def _number(data: dict, name: str, low: float, high: float) -> float:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ProfileError(f"profile field {name!r} must be a number between {low} and {high}, got {value!r}")
    return float(value)


def _score(data: Any, name: str) -> Score:
    if not isinstance(data, dict):
        raise ProfileError(f"profile field {name!r} must be an object")
    shares = {}
    for share in ("precision", "recall"):
        shares[share] = None if data.get(share) is None else _number(data, share, 0.0, 1.0)
    return Score(accepted=int(_number(data, "accepted", 0, 1e9)), good=int(_number(data, "good", 0, 1e9)), **shares)

"""A calibration profile: probe thresholds fitted on one model and schedule, and how well they did.

A profile is plain JSON (never pickle) so it can be read, exported, hand-edited and imported; `Profile.from_json`
therefore trusts nothing: every field is type- and range-checked, NaN and infinities are refused, and so is a
document larger than `MAX_PROFILE_BYTES`. A profile applies to the model fingerprint (weights, LoRAs and their
strengths) and the sigma schedule fingerprint (step count, scheduler, shift) it was measured on, at the guidance
scale it was measured at, and to no other: thresholds are a property of the model's trajectories over that
schedule.

A profile may also carry what lowering the steps buys on the same pairs or stream (`fewer_steps`: plain at the
bisected step counts of the plain-steps curve) and, per reuse mode, the verdict that weighs the mode against the cheapest of those runs as close to
plain (`equal_quality`, `ModeVerdict`), and the configuration to run (`equal_quality.recommended`, the cheapest steps
and mode as good as full plain: `judging.recommendation`): all absent where calibration ran no fewer-steps runs.

A profile judges runs only while `in_force`: calibration puts it in force where its held-back pairs support it
(`reason` says why or why not), or `forced` where the user puts it in force anyway. A document that claims to be in
force without held-back support, and is not marked forced, is refused like any other inconsistent field.

Calibration writes profiles; the store checks the ones it holds, the reuse settings judge by one and the probe
benchmark reads one, so the profile and its checks sit below all of them.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from carnator_core.judging.fewer_steps import fewer_steps_count, step_count
from carnator_core.judging.probe_thresholds import ProbeThresholds
from carnator_core.judging.quality_target import QualityTarget
from carnator_core.judging.ratio_interval import ratio_words
from carnator_core.judging.recommendation import PLAIN, Recommendation

PROFILE_FORMAT = "carnator-calibration-profile"
PROFILE_VERSION = 2
MAX_PROFILE_BYTES = 64 * 1024
# the fitted `ProbeThresholds` fields and the range each may take
THRESHOLD_RANGES = {"structure": (0.0, 1.0), "structure_slope": (0.0, 1.0),
                    "guidance": (0.0, 1.0), "guidance_slope": (0.0, 1.0)}
MAX_REASON = 500
WEIGHED_MODES = ("balanced", "fast")  # the modes that resume, each weighed against plain at fewer steps
DECIDING_MEASURES = ("adherence", "PSNR", "detail")  # the yardstick's measures, as a verdict names the deciding one
MAX_COUNT = 1e6  # the most model calls, steps or pairs a profile's field may give
FORCED_NOTE = "put in force without held-back support"


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the field and what is wrong with it."""


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
class FewerStepsRun:
    """Plain at `steps` steps on the calibration's requests: its clips against the full plain clips (PSNR of them
    together, median SSIM, mean detail ratio) and its mean model calls."""

    steps: int
    psnr_db: float
    ssim: float
    model_calls: float
    detail: float = 1.0


@dataclass(frozen=True)
class ModeVerdict:
    """A reuse mode weighed against lowering the steps by the one yardstick (`judging.yardstick`): the model calls a
    request takes in the mode, how close its clips stay to plain, the cheapest plain run as good (`against`: a
    `plain-<n>`, or `plain` where none with fewer steps is) and `calls`, that run's calls over the mode's, with its
    90 % `interval` over the requests: below 1, lowering the steps is cheaper at the same quality.

    `weighed_on` "stream": the user's prompts in order, each mode run by the engine as it runs (`pairs` counts the
    prompts); "pairs": each pair weighed as a two-prompt stream, its earlier prompt sampled plain."""

    model_calls: float
    psnr_db: float
    ssim: float
    resumed: int  # requests the mode resumed
    pairs: int  # requests weighed: the stream's prompts, or the pairs (held-back ones, or all: `held_back` false)
    held_back: bool
    steps: int  # the graph's steps
    against: str
    against_calls: float
    calls: float
    interval: tuple[float, float] | None = None
    decided_by: str | None = None  # the measure on which the next cheaper plain run fell short
    steps_short: int | None = None  # the most steps measured that fall short of the mode
    weighed_on: str = "pairs"
    detail: float = 1.0

    def words(self) -> str:
        if self.interval is None:
            return f"{self.calls:.2f}x over the cheapest plain run as good (no interval measured)"
        requests = self.pairs if self.weighed_on == "stream" else 2 * self.pairs
        return ratio_words(self.calls, tuple(self.interval), requests)

    def sentence(self, mode: str) -> str:
        """The verdict in one plain sentence, for the command, the Calibrate node and the store panel."""
        if self.weighed_on == "stream":
            basis = f"on a stream of {self.pairs} prompts, each mode run as the engine runs it"
        else:
            basis = (f"each of {self.pairs} {'held-back ' if self.held_back else ''}pairs weighed as a two-prompt "
                     "stream (its earlier prompt sampled plain)")
        if not self.resumed:
            return f"On this model, {mode} resumed no request ({basis}): no verdict, it saves nothing to weigh."
        lowered = fewer_steps_count(self.against)
        against = f"full plain ({self.steps} steps)" if lowered is None else f"plain at {lowered} of {self.steps} steps"
        short = ""
        if self.steps_short is not None:
            short = f"; {step_count(self.steps_short)} fall short" + (f" on {self.decided_by}" if self.decided_by else "")
        return (f"On this model, {mode}: {self.words()}. Weighed against {against}, the cheapest plain run as good "
                f"({_calls(self.against_calls)} calls against {mode}'s {_calls(self.model_calls)}{short}), {basis}.")

    def short(self, mode: str) -> str:
        """The verdict in a few words, for the report of a request the profile judged."""
        if not self.resumed:
            return f"calibration: {mode} resumed no calibration request, so nothing weighs it against fewer steps"
        lowered = fewer_steps_count(self.against)
        against = "full plain" if lowered is None else f"plain at {step_count(lowered)}"
        return f"calibration: {mode} {self.words()} against {against}, the cheapest plain run as good"


def _calls(value: float) -> str:
    return f"{round(value, 1):g}"


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
    fewer_steps: dict[str, FewerStepsRun] = field(default_factory=dict)  # by name, `plain-<n>`
    equal_quality: dict[str, ModeVerdict] = field(default_factory=dict)  # by mode, of WEIGHED_MODES
    recommended: Recommendation | None = None  # what to run, where the calibration weighed it
    scope: str = ""  # whose it is (`carnator_core.store.scopes`): the store files and reads it in that scope only

    def verdict_lines(self) -> list[str]:
        """Per weighed mode, whether reuse beats lowering the steps, one sentence each, then what to run (none without
        the runs)."""
        lines = [self.equal_quality[mode].sentence(mode) for mode in WEIGHED_MODES if mode in self.equal_quality]
        return lines + ([f"Recommended: {self.recommended.words()}."] if self.recommended is not None else [])

    @property
    def key(self) -> str:
        return profile_key(self.model, self.schedule, self.scope)

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
        pairs = self.fit_pairs + self.held_back_pairs
        streams = [v.pairs for v in self.equal_quality.values() if v.weighed_on == "stream"]
        source = f"{pairs} pairs" if pairs or not streams else f"a stream of {streams[0]} prompts"
        return f"profile {self.name!r} ({day}, {source}){forced}"

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        recommended = data.pop("recommended")
        if recommended is not None:
            data["equal_quality"]["recommended"] = self.recommended.as_dict()
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
            reason=_text(data, "reason", MAX_REASON), forced=_flag(data, "forced"),
            fewer_steps=_fewer_steps(data.get("fewer_steps", {})),
            scope=_scope(data))
        weighed = data.get("equal_quality", {})
        recommended = weighed.get("recommended") if isinstance(weighed, dict) else None
        if isinstance(weighed, dict):
            weighed = {mode: verdict for mode, verdict in weighed.items() if mode != "recommended"}
        profile = replace(profile, equal_quality=_equal_quality(weighed, profile.fewer_steps),
                          recommended=None if recommended is None else _recommended(recommended, profile.fewer_steps))
        if profile.in_force and not profile.forced and not profile.supported():
            raise ProfileError("profile field 'in_force' is true but its held-back precision "
                               f"({profile.held_back.precision}) does not meet its target ({profile.target.precision}): "
                               "put it in force with --force, which marks it 'forced'")
        if profile.forced and not profile.in_force:
            raise ProfileError("profile field 'forced' is true but 'in_force' is false")
        return profile


def profile_key(model: str, schedule: str, scope: str = "") -> str:
    """The store's key of the profile for a model fingerprint and a schedule fingerprint, in a scope."""
    return f"{model}/{schedule}" if not scope else f"{scope}|{model}/{schedule}"


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


def _scope(data: dict) -> str:
    """The profile's scope: "" (the single-user scope) where absent, else a string of at most 200 characters."""
    value = data.get("scope", "")
    if not isinstance(value, str) or len(value) > 200:
        raise ProfileError("profile field 'scope' must be a string of at most 200 characters")
    return value


def _flag(data: dict, name: str, within: str = "") -> bool:
    value = data.get(name)
    if not isinstance(value, bool):
        raise ProfileError(f"profile field {within + name!r} must be true or false, got {value!r}")
    return value


def _number(data: dict, name: str, low: float, high: float, within: str = "") -> float:
    """`data[name]`, a finite number in [low, high]; the error names the field by its path (`within` the object)."""
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ProfileError(f"profile field {within + name!r} must be a number between {low} and {high}, "
                           f"got {value!r}")
    return float(value)


def _fewer_steps(data: Any) -> dict[str, FewerStepsRun]:
    if not isinstance(data, dict):
        raise ProfileError("profile field 'fewer_steps' must be an object")
    runs = {}
    for name, run in data.items():
        within = f"fewer_steps.{name}."
        if fewer_steps_count(name) is None or not isinstance(run, dict):
            raise ProfileError(f"profile field 'fewer_steps' must map names plain-<steps> to objects, got {name!r}")
        runs[name] = FewerStepsRun(steps=int(_number(run, "steps", 1, MAX_COUNT, within)),
                                   psnr_db=_number(run, "psnr_db", 0.0, 100.0, within),
                                   ssim=_number(run, "ssim", -1.0, 1.0, within),
                                   model_calls=_number(run, "model_calls", 0.0, MAX_COUNT, within),
                                   detail=_number(run, "detail", 0.0, MAX_COUNT, within) if "detail" in run else 1.0)
        if runs[name].steps != fewer_steps_count(name):
            raise ProfileError(f"profile field {within + 'steps'!r} is {runs[name].steps}, not the {name}'s steps")
    return runs


def _equal_quality(data: Any, fewer: dict[str, FewerStepsRun]) -> dict[str, ModeVerdict]:
    if not isinstance(data, dict) or not set(data) <= set(WEIGHED_MODES):
        raise ProfileError(f"profile field 'equal_quality' must be an object of modes {', '.join(WEIGHED_MODES)}")
    verdicts = {}
    for mode, verdict in data.items():
        within = f"equal_quality.{mode}."
        if not isinstance(verdict, dict):
            raise ProfileError(f"profile field {within[:-1]!r} must be an object")
        against = verdict.get("against")
        if against != "plain" and against not in fewer:
            raise ProfileError(f"profile field {within + 'against'!r} must be 'plain' or one of the profile's "
                               f"fewer_steps runs ({', '.join(fewer) or 'none'}), got {against!r}")
        verdicts[mode] = ModeVerdict(
            model_calls=_number(verdict, "model_calls", 0.0, MAX_COUNT, within),
            psnr_db=_number(verdict, "psnr_db", 0.0, 100.0, within), ssim=_number(verdict, "ssim", -1.0, 1.0, within),
            resumed=int(_number(verdict, "resumed", 0, MAX_COUNT, within)),
            pairs=int(_number(verdict, "pairs", 1, MAX_COUNT, within)), held_back=_flag(verdict, "held_back", within),
            steps=int(_number(verdict, "steps", 1, MAX_COUNT, within)), against=against,
            against_calls=_number(verdict, "against_calls", 0.0, MAX_COUNT, within),
            calls=_number(verdict, "calls", 0.0, MAX_COUNT, within), interval=_interval(verdict, within),
            decided_by=_choice(verdict, "decided_by", DECIDING_MEASURES, within),
            steps_short=None if verdict.get("steps_short") is None else
            int(_number(verdict, "steps_short", 1, MAX_COUNT, within)),
            weighed_on=_choice(verdict, "weighed_on", ("pairs", "stream"), within) or "pairs",
            detail=_number(verdict, "detail", 0.0, MAX_COUNT, within) if "detail" in verdict else 1.0)
        if verdicts[mode].resumed > verdicts[mode].pairs:
            raise ProfileError(f"profile field {within + 'resumed'!r} is more than its {verdicts[mode].pairs} pairs")
    return verdicts


def _recommended(data: Any, fewer: dict[str, FewerStepsRun]) -> Recommendation:
    within = "equal_quality.recommended."
    if not isinstance(data, dict):
        raise ProfileError("profile field 'equal_quality.recommended' must be an object")
    mode = _choice(data, "mode", (PLAIN, *WEIGHED_MODES), within)
    against = data.get("against")
    if mode is None or (against != PLAIN and against not in fewer):
        raise ProfileError(f"profile field {within[:-1]!r} needs a mode ({', '.join((PLAIN, *WEIGHED_MODES))}) and "
                           f"'against' 'plain' or one of the profile's fewer_steps runs, got {mode!r}, {against!r}")
    interval = _interval(data, within)
    steps = int(_number(data, "steps", 1, MAX_COUNT, within))
    full = int(_number(data, "full_steps", steps, MAX_COUNT, within)) if "full_steps" in data else steps
    return Recommendation(steps=steps, mode=mode, model_calls=_number(data, "model_calls", 0.0, MAX_COUNT, within),
                          full_steps=full, against=against,
                          against_steps=full if against == PLAIN else fewer[against].steps,
                          calls=_number(data, "calls", 0.0, MAX_COUNT, within),
                          interval=interval if interval is not None else (1.0, 1.0),
                          requests=int(_number(data, "requests", 1, MAX_COUNT, within)) if "requests" in data else 1)


def _interval(verdict: dict, within: str) -> tuple[float, float] | None:
    value = verdict.get("interval")
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2:
        raise ProfileError(f"profile field {within + 'interval'!r} must be [low, high], got {value!r}")
    low, high = (_number({"interval": v}, "interval", 0.0, MAX_COUNT, within) for v in value)
    if low > high:
        raise ProfileError(f"profile field {within + 'interval'!r} has its low end above its high end")
    return low, high


def _choice(data: dict, name: str, choices: tuple[str, ...], within: str) -> str | None:
    value = data.get(name)
    if value is not None and value not in choices:
        raise ProfileError(f"profile field {within + name!r} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _score(data: Any, name: str) -> Score:
    if not isinstance(data, dict):
        raise ProfileError(f"profile field {name!r} must be an object")
    shares = {}
    for share in ("precision", "recall"):
        shares[share] = None if data.get(share) is None else _number(data, share, 0.0, 1.0)
    return Score(accepted=int(_number(data, "accepted", 0, 1e9)), good=int(_number(data, "good", 0, 1e9)), **shares)

"""The report of one sampling run: what the `carnator.status` event, the CarnatorReport node and the badge show.

Three kinds share one type: a reuse run's (`ReuseRun.report`), a plain run's (Carnator could not take part:
nothing looked up, probed or recorded) and a sparse-attention-only run's (no reuse engine around it), whose JSON
carries only the attention fields. Its `verdict` and `text` are the one reading of a run: the report node, the
log, the badge (from the JSON's `verdict`), the demo, the queue runner and the benchmarks all show them, the
clients outside ComfyUI through `RunReport.from_dict`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from carnator_core.attention.sparse_attention import MASKS_TOO_FULL, SparseAttentionRun
from carnator_core.reuse.decision import ProbeRecord
from carnator_core.reuse.plan import OTHER_SEED

SPARSE_ATTENTION_MODE = "attention/"  # the mode prefix of a sparse-attention-only run
SEED_ACTION = ("with seed policy 'same-noise' an edited prompt reuses only a run made with the same seed: keep the "
               "last run's seed (seed control 'fixed'), or use seed policy 'serving'")

# The JSON fields of a sparse-attention-only run, in their order.
_SPARSE_ATTENTION_FIELDS = ("hit", "verdict", "mode", "donor_id", "donor_prompt", "text_similarity", "agreement",
                            "skipped_steps", "total_steps", "attention_density", "heads_reuse", "heads_own", "time_s",
                            "time_saved_s", "reason", "attention")


class Verdict(str, Enum):
    """What a run reused. `hit` alone cannot tell a resume from borrowed attention masks, so every consumer reads
    this instead of deriving its own."""

    EXACT_REPEAT = "exact repeat"  # every sampler input and the first prediction matched a stored run: its output
    RESUMED = "resumed"  # started from a verified donor state, skipping steps
    STAGE_SKIPPED = "stage skipped"  # a trajectory stage replaced whole by a donor stage's output
    MASKS_BORROWED = "masks borrowed"  # sampled every step, with a donor's attention masks
    MISS = "miss"

    @property
    def label(self) -> str:
        """The short form tables and progress lines show."""
        return _LABELS[self]

    @property
    def skips_steps(self) -> bool:
        """Whether the run took a donor's latent state (and so saved model calls)."""
        return self in (Verdict.RESUMED, Verdict.STAGE_SKIPPED, Verdict.EXACT_REPEAT)

    @classmethod
    def strongest(cls, verdicts: Iterable[Verdict]) -> Verdict:
        """One verdict for a prompt of several sampling runs (stages, experts): the most reuse any of them got."""
        return max(verdicts, key=_STRENGTH.index, default=cls.MISS)


_LABELS = {Verdict.RESUMED: "HIT (resumed)", Verdict.STAGE_SKIPPED: "HIT (stage skipped)",
           Verdict.MASKS_BORROWED: "HIT (masks)", Verdict.MISS: "MISS", Verdict.EXACT_REPEAT: "HIT (exact repeat)"}
_STRENGTH = (Verdict.MISS, Verdict.MASKS_BORROWED, Verdict.RESUMED, Verdict.STAGE_SKIPPED, Verdict.EXACT_REPEAT)


@dataclass
class RunReport:
    """What one sampling run did: hit or miss and why, the donor and its signals, cost and savings."""

    mode: str
    total_steps: int
    time_s: float
    reason: str = ""
    hit: bool = False
    prompt: str = ""  # the request's prompt text as matched: wired, or read from the queued graph
    judged_by: str = ""  # whose thresholds judged the probes: a calibration profile, the node's inputs, the shipped
    donor_id: str | None = None
    donor_prompt: str | None = None
    text_similarity: float | None = None
    agreement: float | None = None
    structure_agreement: float | None = None
    guidance_cosine: float | None = None
    other_parts_agreement: tuple[float, ...] = ()  # a packed latent's other parts (LTX-2's audio), as the probe's
    skipped_steps: int = 0
    exact_repeat: bool = False  # its output is a stored run's, every input and the first prediction matching
    # a resume's sigma and where the donor recorded that state ({"sigma", "donor_step", "donor_steps"}); empty else
    resumed_at: dict[str, Any] = field(default_factory=dict)
    attention: dict[str, Any] = field(default_factory=dict)  # the sparse-attention summary; empty without one
    model_calls: int = 0
    time_saved_s: float = 0.0
    probes: list[ProbeRecord] = field(default_factory=list)
    candidates: list[dict[str, Any]] = field(default_factory=list)
    filtered: dict[str, int] = field(default_factory=dict)
    skipped_donors: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    sparse_attention_only: bool = False  # no reuse engine took part: the JSON has the attention fields only
    # A run that is one stage of a trajectory (`carnator_core.reuse.trajectory`): its index, first trajectory step,
    # whether it hands over to a later stage and whether it was skipped whole; empty for a single-stage run.
    stage: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def plain(cls, mode: str, reason: str, total_steps: int, model_calls: int, elapsed: float,
              attention: dict[str, Any] | None = None, notes: list[str] | None = None) -> RunReport:
        """A run Carnator could not take part in; its notes are `reason` unless given."""
        return cls(mode=mode, total_steps=total_steps, time_s=elapsed, reason=reason, attention=attention or {},
                   model_calls=model_calls, notes=notes if notes is not None else [reason])

    @classmethod
    def of_sparse_attention(cls, run: SparseAttentionRun, elapsed: float) -> RunReport:
        """A run that used sparse attention without the reuse engine: a hit when a donor's masks ran sparse."""
        summary = run.summary()
        reason = run.inactive
        if not reason and not summary["borrowed_sparse_calls"]:
            reason = MASKS_TOO_FULL if summary["heads_reuse"] else "no donor masks adopted"
        return cls(mode=f"{SPARSE_ATTENTION_MODE}{run.settings.source}", total_steps=run.total_steps, time_s=elapsed,
                   reason=reason, hit=bool(summary["borrowed_sparse_calls"]), attention=summary,
                   sparse_attention_only=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunReport:
        """The report behind its JSON (`as_dict`, as /history and `carnator.status` carry it), so clients render
        through the same `verdict` and `text`. Missing fields keep their defaults; unknown ones (the prompt and node
        tags, `verdict` itself) are ignored."""
        names = {f.name for f in fields(cls)} - {"sparse_attention_only"}
        values = {name: data[name] for name in names if data.get(name) is not None}
        values.setdefault("mode", "")
        values.setdefault("total_steps", 0)
        values.setdefault("time_s", 0.0)
        values["other_parts_agreement"] = tuple(float(v) for v in values.get("other_parts_agreement", ()))
        values["probes"] = [ProbeRecord.from_dict(probe) for probe in values.get("probes", ()) if isinstance(probe, dict)]
        if "attention" not in values:  # only the flat attention fields: keep what they say
            flat = {"density": "attention_density", "heads_reuse": "heads_reuse", "heads_own": "heads_own"}
            values["attention"] = {key: data[name] for key, name in flat.items() if data.get(name) is not None}
        return cls(**values, sparse_attention_only=str(values["mode"]).startswith(SPARSE_ATTENTION_MODE))

    @property
    def verdict(self) -> Verdict:
        """What the run reused. A skipped stage also counts its steps as skipped, so it is told apart first."""
        if self.exact_repeat:
            return Verdict.EXACT_REPEAT
        if self.stage.get("skipped_whole"):
            return Verdict.STAGE_SKIPPED
        if self.skipped_steps > 0:
            return Verdict.RESUMED
        return Verdict.MASKS_BORROWED if self.hit else Verdict.MISS

    @property
    def seed_miss(self) -> bool:
        """Whether only the seed kept this run from reusing: a donor was left out for its other initial noise and
        no donor reached the model."""
        return self.verdict is Verdict.MISS and OTHER_SEED in self.skipped_donors and not self.probes

    def headline(self) -> str:
        """The first line of `text`: the verdict and what decides it (the log line)."""
        verdict = self.verdict
        if verdict is Verdict.MISS:
            return f"MISS: {self.reason or 'no reuse'}"
        if verdict is Verdict.MASKS_BORROWED:
            return "HIT: attention masks borrowed"
        if verdict is Verdict.EXACT_REPEAT:
            return f"HIT: {self.reason} ({(self.donor_prompt or '')[:60]!r}), ~{self.time_saved_s:.1f} s saved"
        donor = repr((self.donor_prompt or "")[:60])
        checks = [f"{name} {value:.3f}" for name, value in (("structure", self.structure_agreement),
                                                           ("guidance", self.guidance_cosine)) if value is not None]
        checks += [f"packed part {index} {value:.3f}" for index, value in enumerate(self.other_parts_agreement, 2)]
        what = (f"stage skipped ({self.skipped_steps}/{self.total_steps} steps), output taken from {donor}"
                if verdict is Verdict.STAGE_SKIPPED
                else f"resumed at step {self.skipped_steps}/{self.total_steps} from {donor}{self._donor_schedule()}")
        return f"HIT: {what} ({', '.join(checks) or 'unverified'}), ~{self.time_saved_s:.1f} s saved"

    def _donor_schedule(self) -> str:
        """How a donor of another schedule lent its state ("" for one of the request's own schedule)."""
        where = self.resumed_at
        steps, step, sigma = where.get("donor_steps"), where.get("donor_step"), where.get("sigma")
        if steps is None or step is None or sigma is None or (steps == self.total_steps
                                                               and step == self.skipped_steps):
            return ""
        return f" at σ {float(sigma):.3f}, its step {int(step)} of {int(steps)}"

    def text(self) -> str:
        """One readable paragraph: the verdict, the run's cost, the prompt matched and notes, its attention and any
        kernel fallbacks."""
        lines = [self.headline(), f"  mode {self.mode}, {self.time_s:.1f} s, probes {len(self.probes)}"]
        if self.seed_miss:
            lines.append(f"  seed: {SEED_ACTION}")
        if self.prompt:
            lines.append(f"  prompt {self.prompt[:80]!r}")
        if self.judged_by:
            lines.append(f"  judged by {self.judged_by}")
        lines.extend(f"  note: {note}" for note in self.notes if note != self.reason)
        if self.attention.get("density") is not None:
            lines.append(f"  attention density {self.attention['density']:.3f}, heads reuse/own "
                         f"{self.attention.get('heads_reuse', 0)}/{self.attention.get('heads_own', 0)}")
        lines.extend(f"  kernel fallback: {line}" for line in self.attention.get("kernel_fallbacks", ()))
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data, the form every consumer reads."""
        data = {
            "hit": self.hit,
            "verdict": self.verdict.value,
            "mode": self.mode,
            "prompt": self.prompt,
            "judged_by": self.judged_by,
            "donor_id": self.donor_id,
            "donor_prompt": self.donor_prompt,
            "text_similarity": self.text_similarity,
            "agreement": self.agreement,
            "structure_agreement": self.structure_agreement,
            "guidance_cosine": self.guidance_cosine,
            **({"other_parts_agreement": list(self.other_parts_agreement)} if self.other_parts_agreement else {}),
            "skipped_steps": self.skipped_steps,
            "total_steps": self.total_steps,
            "exact_repeat": self.exact_repeat,
            "resumed_at": self.resumed_at,
            "attention_density": self.attention.get("density"),
            "attention": self.attention,
            "heads_reuse": self.attention.get("heads_reuse", 0),
            "heads_own": self.attention.get("heads_own", 0),
            "model_calls": self.model_calls,
            "time_s": self.time_s,
            "time_saved_s": self.time_saved_s,
            "reason": self.reason,
            "seed_miss": self.seed_miss,
            "probes": [probe.as_dict() for probe in self.probes],
            "candidates": self.candidates,
            "filtered": self.filtered,
            "skipped_donors": self.skipped_donors,
            "notes": self.notes,
            "stage": self.stage,
        }
        if self.sparse_attention_only:
            return {name: data[name] for name in _SPARSE_ATTENTION_FIELDS}
        return data

"""The report of one sampling run: what the `carnator.status` event, the CarnatorReport node and the badge show.

Three kinds share one type: a reuse run's (`ReuseRun.report`), a plain run's (Carnator could not take part:
nothing looked up, probed or recorded) and a sparse-attention-only run's (no reuse engine around it), whose JSON
carries only the attention fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from carnator_core.attention.sparse_attention import MASKS_TOO_FULL, SparseAttentionRun

# The JSON fields of a sparse-attention-only run, in their order.
_SPARSE_ATTENTION_FIELDS = ("hit", "mode", "donor_id", "donor_prompt", "text_similarity", "agreement",
                            "skipped_steps", "total_steps", "attention_density", "heads_reuse", "heads_own", "time_s",
                            "time_saved_s", "reason", "attention")


@dataclass
class RunReport:
    """What one sampling run did: hit or miss and why, the donor and its signals, cost and savings."""

    mode: str
    total_steps: int
    time_s: float
    reason: str = ""
    hit: bool = False
    donor_id: str | None = None
    donor_prompt: str | None = None
    text_similarity: float | None = None
    agreement: float | None = None
    structure_agreement: float | None = None
    guidance_cosine: float | None = None
    skipped_steps: int = 0
    attention: dict[str, Any] = field(default_factory=dict)  # the sparse-attention summary; empty without one
    model_calls: int = 0
    time_saved_s: float = 0.0
    probes: list[dict[str, Any]] = field(default_factory=list)
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
        return cls(mode=f"attention/{run.settings.source}", total_steps=run.total_steps, time_s=elapsed,
                   reason=reason, hit=bool(summary["borrowed_sparse_calls"]), attention=summary,
                   sparse_attention_only=True)

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data, the form every consumer reads."""
        data = {
            "hit": self.hit,
            "mode": self.mode,
            "donor_id": self.donor_id,
            "donor_prompt": self.donor_prompt,
            "text_similarity": self.text_similarity,
            "agreement": self.agreement,
            "structure_agreement": self.structure_agreement,
            "guidance_cosine": self.guidance_cosine,
            "skipped_steps": self.skipped_steps,
            "total_steps": self.total_steps,
            "attention_density": self.attention.get("density"),
            "attention": self.attention,
            "heads_reuse": self.attention.get("heads_reuse", 0),
            "heads_own": self.attention.get("heads_own", 0),
            "model_calls": self.model_calls,
            "time_s": self.time_s,
            "time_saved_s": self.time_saved_s,
            "reason": self.reason,
            "probes": self.probes,
            "candidates": self.candidates,
            "filtered": self.filtered,
            "skipped_donors": self.skipped_donors,
            "notes": self.notes,
            "stage": self.stage,
        }
        if self.sparse_attention_only:
            return {name: data[name] for name in _SPARSE_ATTENTION_FIELDS}
        return data

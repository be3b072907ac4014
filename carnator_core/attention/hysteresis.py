"""Per-head switching between a borrowed mask (REUSE) and the live request's own mask (OWN).

Two thresholds keep a head from flapping: it leaves REUSE as soon as the donor mask's recall
drops below `exit_recall`, but returns only after `confirm_checks` consecutive checks at or
above `enter_recall` (> `exit_recall`). Values between the two change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class HeadMode(str, Enum):
    REUSE = "reuse"
    OWN = "own"


@dataclass
class HeadState:
    mode: HeadMode
    streak: int = 0  # consecutive checks at or above enter_recall while OWN
    history: list[tuple[int, float, str]] = field(default_factory=list)  # (step, recall, mode after the check)


def check_recall_thresholds(enter_recall: float, exit_recall: float) -> None:
    """Refuse recall thresholds without a gap between them (the gap is what stops flapping) or outside [0, 1]."""
    if not 0.0 <= exit_recall < enter_recall <= 1.0:
        raise ValueError(f"exit_recall must be lower than enter_recall, both between 0 and 1; got exit_recall "
                         f"{exit_recall} and enter_recall {enter_recall}")


class HeadHysteresis:
    """The REUSE/OWN state of every (layer, head) of one sampling run."""

    def __init__(self, enter_recall: float, exit_recall: float, confirm_checks: int = 2) -> None:
        check_recall_thresholds(enter_recall, exit_recall)
        if confirm_checks < 1:
            raise ValueError("confirm_checks must be at least 1")
        self.enter_recall = enter_recall
        self.exit_recall = exit_recall
        self.confirm_checks = confirm_checks
        self.heads: dict[tuple[int, int], HeadState] = {}

    def adopt(self, head: tuple[int, int], recall: float, step: int) -> HeadMode:
        """First decision for a head with a donor mask: REUSE only when its recall reaches `enter_recall`."""
        mode = HeadMode.REUSE if recall >= self.enter_recall else HeadMode.OWN
        self.heads[head] = HeadState(mode=mode, history=[(step, recall, mode.value)])
        return mode

    def check(self, head: tuple[int, int], recall: float, step: int) -> HeadMode:
        """Re-check a head against the donor mask's current recall and return its (possibly new) mode."""
        state = self.heads.get(head)
        if state is None:
            return self.adopt(head, recall, step)
        if state.mode is HeadMode.REUSE:
            if recall < self.exit_recall:
                state.mode, state.streak = HeadMode.OWN, 0
        elif recall >= self.enter_recall:
            state.streak += 1
            if state.streak >= self.confirm_checks:
                state.mode, state.streak = HeadMode.REUSE, 0
        else:
            state.streak = 0
        state.history.append((step, recall, state.mode.value))
        return state.mode

    def mode(self, head: tuple[int, int]) -> HeadMode:
        state = self.heads.get(head)
        return state.mode if state is not None else HeadMode.OWN

    def counts(self) -> dict[str, int]:
        reuse = sum(state.mode is HeadMode.REUSE for state in self.heads.values())
        return {"heads_reuse": reuse, "heads_own": len(self.heads) - reuse}

    def history(self) -> dict[str, list[tuple[int, float, str]]]:
        """Per-head check history for the report, keyed 'layer:head'."""
        return {f"{layer}:{head}": state.history for (layer, head), state in sorted(self.heads.items())}

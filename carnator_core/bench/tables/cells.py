"""How a figure reads in a generated table cell, the same in every table."""

from __future__ import annotations

from typing import Any

from carnator_core.judging.fewer_steps import fewer_steps_count

MODES = ("balanced", "fast")  # the modes the tables compare with plain


def adherence(config: dict[str, Any]) -> str:
    return "n/a" if config.get("adherence") is None else f"{config['adherence']:.3f}"


def against(name: str) -> str:
    steps = fewer_steps_count(name)
    return "against plain" if steps is None else f"plain at {steps} steps"


def with_interval(speedup: dict[str, Any]) -> str:
    """An equal-quality ratio by calls, with its 90 % interval where the run measured one."""
    interval = speedup.get("interval")
    return f"{speedup['calls']:.2f}x" + ("" if interval is None else f" ({interval[0]:.2f}–{interval[1]:.2f}x)")


def threads(count: int) -> str:
    return "torch on every core" if count == 0 else f"{count} torch thread" + "s" * (count > 1)


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table, ending in a newline."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"

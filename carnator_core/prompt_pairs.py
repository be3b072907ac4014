"""Prompt pairs: an earlier prompt and the new prompt that follows it, sampled with the same seed.

From a file (`--pairs FILE`) or the Calibrate node's text, one pair per line, the two prompts separated by a tab or
by `=>` (a text box in the graph editor cannot take a tab); blank lines and lines starting with # are skipped. Or
from the user's own history (`--from-store`): successive prompts a store recorded for the same model, schedule and
seed, which is how that user iterates.

Calibration reads them, and so does the probe benchmark (`bench probe --pairs-file`): they sit beside the prompt
file reader, below both.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from carnator_core.prompt_file import PromptFileError, read_prompt_file

PAIR_RULE = "one pair per line, the earlier and the new prompt separated by a tab or by =>"
SEPARATORS = ("\t", "=>")


@dataclass(frozen=True)
class Pair:
    earlier: str
    new: str


def read_pairs(path: Path) -> list[Pair]:
    """The pairs of the file at `path`; PromptFileError names the line that is not a pair."""
    return parse_pairs(read_prompt_file(path), f"pairs file {path}")


def parse_pairs(lines: list[str], source: str) -> list[Pair]:
    """The pairs of `lines` (blank and # lines already dropped); PromptFileError names the one that is not a pair."""
    pairs = []
    for number, line in enumerate(lines, 1):
        separator = next((s for s in SEPARATORS if s in line), SEPARATORS[0])
        parts = [part.strip() for part in line.split(separator)]
        if len(parts) != 2 or not all(parts):
            raise PromptFileError(f"{source}, pair {number} ({line[:60]!r}): {PAIR_RULE}")
        pairs.append(Pair(*parts))
    return pairs


def pairs_from_history(entries: list[dict], limit: int) -> tuple[list[Pair], str]:
    """The newest `limit` pairs of successive distinct prompts in a store listing (the store panel's entry
    summaries), from the model and schedule the listing holds most such pairs of; and a line saying which."""
    runs = _histories(entries)
    by_model: dict[tuple, list[tuple[float, Pair]]] = defaultdict(list)
    for (model, schedule, _), history in runs.items():
        for earlier, new in zip(history, history[1:], strict=False):
            if earlier["prompt"] != new["prompt"]:
                by_model[(model, schedule)].append((new.get("created_at") or 0.0, Pair(earlier["prompt"],
                                                                                       new["prompt"])))
    if not by_model:
        return [], "the store holds no two successive prompts of one model, schedule and seed"
    (model, _), found = max(by_model.items(), key=lambda item: len(item[1]))
    unique = list(dict.fromkeys(pair for _, pair in sorted(found, key=lambda item: -item[0])))[:limit]
    return unique, f"{len(unique)} pairs from the store's history of model {model[:12]}"


def stream_from_history(entries: list[dict], limit: int) -> list[str]:
    """The newest `limit` prompts of the history `pairs_from_history` draws its pairs from, oldest first, a prompt
    repeated right after itself kept once: the user's own stream."""
    runs = _histories(entries)
    if not runs:
        return []
    prompts = [entry["prompt"] for entry in max(runs.values(), key=len)]
    return [p for i, p in enumerate(prompts) if i == 0 or p != prompts[i - 1]][-limit:]


def _histories(entries: list[dict]) -> dict[tuple, list[dict]]:
    """The entries that name their prompt, seed and model, by (model, schedule, seed), each oldest first."""
    runs: dict[tuple, list[dict]] = defaultdict(list)
    for entry in entries:
        if entry.get("prompt") and entry.get("seed") is not None and entry.get("model"):
            runs[(entry["model"], entry.get("schedule"), entry["seed"])].append(entry)
    for history in runs.values():
        history.sort(key=lambda entry: entry.get("created_at") or 0.0)
    return runs

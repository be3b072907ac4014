"""The stored runs a published table is generated from, read from the results folder as the tables ask for them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carnator_core.judging.fewer_steps import fewer_steps_count
from carnator_core.judging.ratio_interval import median_ratio_interval
from carnator_core.recorded_runs import RunConditions, read_result

Link = Callable[[str], str]  # a stored run's name -> its JSON's path as the document links it


@dataclass(frozen=True)
class StoredRun:
    """One stored benchmark run: the conditions it had and the benchmark's JSON."""

    name: str
    conditions: RunConditions
    result: dict[str, Any]

    def config(self, name: str) -> dict[str, Any]:
        for config in self.result["configs"]:
            if config["name"] == name:
                return config
        raise KeyError(f"{self.name}: the run has no configuration {name!r}")

    def has(self, name: str) -> bool:
        return any(config["name"] == name for config in self.result.get("configs", []))

    @property
    def fewer_steps(self) -> list[dict[str, Any]]:
        """Plain at fewer steps, most steps first."""
        runs = [c for c in self.result["configs"] if fewer_steps_count(c["name"]) is not None]
        return sorted(runs, key=lambda c: -(fewer_steps_count(c["name"]) or 0))

    def time(self, config: dict[str, Any]) -> str:
        """The configuration's median time against plain, where the run had the machine to itself, with its 90 %
        interval over the run's requests where the run stored them."""
        if not self.conditions.alone:
            return "— (not measured alone)"
        times = self.request_times("plain"), self.request_times(config["name"])
        if config["name"] == "plain" or not all(times) or len(times[0]) != len(times[1]):
            return f"{config['speedup']:.2f}x"
        low, high = median_ratio_interval(*times)
        return f"{config['speedup']:.2f}x ({low:.2f}–{high:.2f}x)"

    def request_times(self, name: str, prompts: list[int] | None = None) -> list[float]:
        """The configuration's time per request (of the requests numbered `prompts`, else all), in request order;
        empty where the run did not store them."""
        per_prompt = self.result.get("per_prompt", [])
        chosen = per_prompt if prompts is None else [per_prompt[i] for i in prompts]
        return [p["configs"][name]["time_s"] for p in chosen if "time_s" in p["configs"].get(name, {})]


class StoredRuns:
    """The runs stored in a results folder, each read once, when a table first asks for it: a missing one fails
    with its file's name."""

    def __init__(self, results_dir: Path) -> None:
        self.results_dir = results_dir
        self._read: dict[str, StoredRun] = {}

    def __getitem__(self, name: str) -> StoredRun:
        if name not in self._read:
            conditions, result = read_result(name, self.results_dir)
            self._read[name] = StoredRun(name, conditions, result)
        return self._read[name]

    def names(self) -> list[str]:
        """Every stored run's name, in name order."""
        return sorted(path.stem for path in self.results_dir.glob("*.json"))

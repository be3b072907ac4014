"""Weighing a stream's runs: each configuration summarised against plain (speedups, calls, quality), weighed by the
one yardstick against the cheapest plain run as good (the plain-steps curve), the streams' targets, and the nesting of
the modes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from carnator_core.bench.workload_configurations import STEP_CACHES
from carnator_core.bench.workload_stream import Sample, mean, median, score_samples
from carnator_core.judging.fewer_steps import fewer_steps_count, step_count
from carnator_core.judging.plain_steps_curve import MAX_LOWERED_COUNTS, next_count
from carnator_core.judging.quality import psnr_from_mse
from carnator_core.judging.recommendation import as_good_as_full, knee, recommend
from carnator_core.judging.yardstick import FULL, RequestOutcome, curve_row, equal_quality, falls_short

FIELDS = ("speedup", "model_calls", "hit_rate", "masks_only_rate", "attention_density", "psnr", "ssim", "detail",
          "adherence",
          "bytes_per_entry")
# Plain's median server CPU time / this configuration's (None where unknown); the mean model calls and the speedup
# (plain's median time / the hits' median time) of the requests that resumed (None without one); the mean model calls
# per request of each stage, in stage order (two-expert graph: first and second expert; else the one sampler); the
# configuration against the cheapest plain run of as good a quality (`equal_quality_speedup`; None for plain runs).
EXTRA_FIELDS = ("cpu_speedup", "hit_model_calls", "hit_speedup", "stage_model_calls", "equal_quality_speedup")
# What each stream must show, by configuration (the benchmark's JSON reports each as measured and met or not):
# calls_speedup: plain's mean model calls over the configuration's; adherence_gap: the mean adherence the
# configuration loses against plain; extra_calls: the most model calls one request makes beyond plain's;
# time_speedup: plain's median time over the configuration's (on the unrelated stream: what a miss costs).
STREAM_TARGETS: dict[str, dict[str, dict[str, float]]] = {
    "edit-loop": {"fast": {"calls_speedup": 2.0, "adherence_gap": 0.01},
                  "balanced": {"calls_speedup": 1.5, "adherence_gap": 0.01}},
    "near-dup": {"fast": {"calls_speedup": 1.6}},
    "adversarial": {mode: {"adherence_gap": 0.0} for mode in ("safe", "balanced", "fast")},
    "unrelated": {mode: {"extra_calls": 1.0, "time_speedup": 0.97} for mode in ("safe", "balanced", "fast")},
}
KNEE_MODES = ("balanced", "fast")  # the modes weighed again at the knee of the plain-steps curve
AT_LEAST = frozenset({"calls_speedup", "time_speedup"})  # the measures a target bounds from below, the others above


def _median_seconds(runs: list[Sample]) -> float:
    return median([s.seconds for s in runs])


def _mean_calls(runs: list[Sample]) -> float:
    return sum(s.model_calls for s in runs) / len(runs)


def _adherence(runs: list[Sample]) -> float | None:
    return mean([s.quality["adherence"] for s in runs])


def equal_quality_speedup(runs: list[Sample], plain: list[Sample], fewer: dict[str, list[Sample]], steps: int,
                          timed: frozenset[str] = frozenset()) -> dict[str, Any]:
    """`runs` weighed by the yardstick (`judging.yardstick`) against full `plain` and the plain runs at fewer steps
    (`fewer`, by name): the cheapest as good, its calls over theirs with the interval, and its median time over
    theirs where it is one of the `timed` configurations (run interleaved with the others), else None."""
    weighed = equal_quality([_outcome(s) for s in runs], [_outcome(s) for s in plain],
                            {fewer_steps_count(name): [_outcome(s) for s in samples] for name, samples in fewer.items()},
                            steps)
    reference = fewer.get(weighed.against, plain)
    timed_reference = weighed.against == FULL or weighed.against in timed
    return {**weighed.as_dict(),
            "time": round(_median_seconds(reference) / _median_seconds(runs), 3) if timed_reference else None}


def curve_table(samples: dict[str, list[Sample]], curve: dict[str, list[Sample]], steps: int) -> list[dict[str, Any]]:
    """Every plain run the stream weighs against, fewest steps first: its calls and the yardstick's three measures."""
    runs = {steps: samples["plain"], **{fewer_steps_count(name): runs for name, runs in {**samples, **curve}.items()
                                        if fewer_steps_count(name) is not None}}
    return [{**curve_row(count, [_outcome(s) for s in runs[count]]), "bisected": f"plain-{count}" in curve}
            for count in sorted(runs)]


def _outcome(sample: Sample) -> RequestOutcome:
    return RequestOutcome(model_calls=sample.model_calls, mse=sample.quality["mse"], detail=sample.quality["detail"],
                          adherence=sample.quality["adherence"])


def plain_steps_curve(samples: dict[str, list[Sample]], curve: dict[str, list[Sample]], steps: int,
                      sample_at: Callable[[int, int], Sample], prompts: list[str],
                      progress: Callable[[str], None]) -> None:
    """Plain at the step counts that bracket each weighed configuration's quality and the knee (`judging.plain_steps_curve`),
    sampled on every prompt (`sample_at(prompt index, steps)`) and scored into `curve` by name, beside the fixed
    fewer-steps runs already in `samples`."""
    weighed = {name: runs for name, runs in samples.items()
               if name != "plain" and name not in STEP_CACHES and fewer_steps_count(name) is None}

    def lowered() -> dict[int, list[Sample]]:
        return {fewer_steps_count(name): runs for name, runs in {**samples, **curve}.items()
                if fewer_steps_count(name) is not None}

    def judge(runs: list[Sample]) -> Callable[[int], bool]:
        return lambda n: falls_short([_outcome(s) for s in lowered()[n]], [_outcome(s) for s in runs],
                                     [_outcome(s) for s in samples["plain"]]) is None

    def knee_judge(n: int) -> bool:  # the knee's bracket: plain at n as good as full plain
        return as_good_as_full([_outcome(s) for s in lowered()[n]], [_outcome(s) for s in samples["plain"]])

    for _ in range(MAX_LOWERED_COUNTS):
        count = next_count(steps, lowered(), [judge(runs) for runs in weighed.values()] + [knee_judge])
        if count is None:
            return
        progress(f"plain-steps curve: plain at {step_count(count)} on every prompt")
        runs = [sample_at(i, count) for i in range(len(prompts))]
        curve[f"plain-{count}"] = runs
        score_samples(prompts, {"plain": samples["plain"], f"plain-{count}": runs})


def summarise(samples: dict[str, list[Sample]], store_bytes: dict[str, float], steps: int,
              curve: dict[str, list[Sample]] | None = None) -> list[dict[str, Any]]:
    """One row per configuration, with the FIELDS and EXTRA_FIELDS of the JSON report; `curve` holds the plain runs
    the bisection added (`plain_steps_curve`), weighed against but not rows of their own (they ran after the stream,
    not interleaved with it)."""
    curve = curve or {}
    plain_time = _median_seconds(samples["plain"])
    plain_cpu = median([s.cpu_seconds for s in samples["plain"] if s.cpu_seconds is not None])
    fewer = {name: runs for name, runs in samples.items() if fewer_steps_count(name) is not None}
    rows = []
    for name, runs in samples.items():
        cpu = median([s.cpu_seconds for s in runs if s.cpu_seconds is not None])
        hits = [s for s in runs if s.hit]
        first_expert = mean([s.first_expert_calls for s in runs])
        calls = _mean_calls(runs)
        rows.append({
            "name": name,
            "speedup": round(plain_time / _median_seconds(runs), 3),
            "cpu_speedup": round(plain_cpu / cpu, 3) if plain_cpu > 0 and cpu > 0 else None,  # NaN: unknown
            "model_calls": round(calls, 2),
            "hit_rate": round(sum(s.hit for s in runs) / len(runs), 3),
            "masks_only_rate": round(sum(s.masks_only for s in runs) / len(runs), 3),
            "attention_density": round(sum(s.density for s in runs) / len(runs), 3),
            "psnr": _psnr(runs),
            "ssim": round(mean([s.quality["ssim"] for s in runs]), 4),
            "detail": round(mean([s.quality["detail"] for s in runs]), 4),
            "adherence": _round(_adherence(runs), 3),
            "bytes_per_entry": round(store_bytes.get(name, 0.0)),
            "hit_model_calls": _round(mean([s.model_calls for s in hits]), 2),
            "hit_speedup": round(plain_time / _median_seconds(hits), 3) if hits else None,
            "stage_model_calls": [round(calls, 2)] if first_expert is None else
                                 [round(first_expert, 2), round(calls - first_expert, 2)],
            "equal_quality_speedup": None if name == "plain" or name in fewer or name in STEP_CACHES else
                                     equal_quality_speedup(runs, samples["plain"], {**fewer, **curve}, steps,
                                                           frozenset(fewer)),
        })
    return rows


def targets(stream: str, samples: dict[str, list[Sample]]) -> list[dict[str, Any]]:
    """The stream's `STREAM_TARGETS`, each with what this run measured and whether it met it."""
    plain = samples["plain"]
    plain_calls = _mean_calls(plain)
    plain_adherence = _adherence(plain)
    rows = []
    for name, wanted in STREAM_TARGETS.get(stream, {}).items():
        runs = samples.get(name)
        if not runs:
            continue
        adherence = _adherence(runs)
        measured = {
            "calls_speedup": plain_calls / _mean_calls(runs),
            "adherence_gap": None if adherence is None or plain_adherence is None else plain_adherence - adherence,
            "extra_calls": max(s.model_calls - p.model_calls for s, p in zip(runs, plain, strict=True)),
            "time_speedup": _median_seconds(plain) / _median_seconds(runs),
        }
        for measure, bound in wanted.items():
            value = measured[measure]
            met = None if value is None else (value >= bound if measure in AT_LEAST else value <= bound + 1e-9)
            rows.append({"config": name, "measure": measure, "target": bound,
                         "measured": _round(value, 3), "met": met})
    return rows


def nesting(prompts: list[str], samples: dict[str, list[Sample]]) -> dict[str, list[dict[str, Any]]]:
    """Where the modes are not nested, per prompt: fast resuming shallower than balanced (fewer steps skipped), fast
    taking more than balanced's model calls plus one (its one call beyond balanced's), and balanced more than safe
    plus one (its one probe call a miss may cost); each such prompt with both calls and steps skipped. Empty lists
    are the goal. Only the checks whose modes all ran are there."""
    checks: dict[str, tuple[str, str, Callable[[Sample, Sample], bool]]] = {
        "fast_shallower_than_balanced": ("fast", "balanced", lambda a, b: a.skipped_steps < b.skipped_steps),
        "fast_over_balanced_plus_one": ("fast", "balanced", lambda a, b: a.model_calls > b.model_calls + 1),
        "balanced_over_safe_plus_one": ("balanced", "safe", lambda a, b: a.model_calls > b.model_calls + 1)}
    found: dict[str, list[dict[str, Any]]] = {}
    for check, (deeper, shallower, broken) in checks.items():
        if deeper not in samples or shallower not in samples:
            continue
        found[check] = [
            {"prompt": prompt, deeper: {"model_calls": a.model_calls, "skipped_steps": a.skipped_steps},
             shallower: {"model_calls": b.model_calls, "skipped_steps": b.skipped_steps}}
            for prompt, a, b in zip(prompts, samples[deeper], samples[shallower], strict=True) if broken(a, b)]
    return found


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _psnr(runs: list[Sample]) -> float | None:
    """PSNR of the runs' clips together (mean squared error over them) against their same-seed plain clips."""
    return round(psnr_from_mse(mean([s.quality["mse"] for s in runs])), 2) if runs else None


def per_kind(kinds: list[str], samples: dict[str, list[Sample]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per configuration and kind of edit (`streams.edit_kinds`): how many resumed, at which depths, the kind's mean
    adherence, and PSNR against plain of the kind's clips and of its resumed clips alone (None without a resume)."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for name, runs in samples.items():
        table[name] = {}
        for kind in dict.fromkeys(kinds):
            of_kind = [s for s, k in zip(runs, kinds, strict=True) if k == kind]
            table[name][kind] = {"requests": len(of_kind), "resumed": sum(s.verdict.skips_steps for s in of_kind),
                                 "skipped_steps": [s.skipped_steps for s in of_kind],
                                 "adherence": _round(mean([s.quality["adherence"] for s in of_kind]), 3),
                                 "psnr": _psnr(of_kind),
                                 "resumed_psnr": _psnr([s for s in of_kind if s.verdict.skips_steps])}
    return table


def _lowered(samples: dict[str, list[Sample]], curve: dict[str, list[Sample]]) -> dict[int, list[RequestOutcome]]:
    """Every plain run at fewer steps (fixed rows and the curve's), as outcomes by step count."""
    return {fewer_steps_count(name): [_outcome(s) for s in runs] for name, runs in {**samples, **curve}.items()
            if fewer_steps_count(name) is not None}


def knee_steps(samples: dict[str, list[Sample]], curve: dict[str, list[Sample]], steps: int) -> int:
    """The fewest measured plain steps as good as full plain (`judging.recommendation.knee`)."""
    return knee([_outcome(s) for s in samples["plain"]], _lowered(samples, curve), steps)


def recommended(samples: dict[str, list[Sample]], curve: dict[str, list[Sample]], at_knee: dict[str, list[Sample]],
                steps: int) -> dict[str, Any]:
    """The knee, the modes weighed there, and the configuration to run (`judging.recommendation.recommend`) among
    plain at every measured count and the reuse modes at the workflow's steps and at the knee."""
    full = [_outcome(s) for s in samples["plain"]]
    modes = {(steps, mode): [_outcome(s) for s in samples[mode]] for mode in KNEE_MODES if mode in samples}
    for name, runs in at_knee.items():
        mode, count = name.split("@")
        modes[int(count), mode] = [_outcome(s) for s in runs]
    count = knee_steps(samples, curve, steps)
    knee_rows = {name: {"model_calls": round(_mean_calls(runs), 2), "psnr": _psnr(runs),
                        "detail": round(mean([s.quality["detail"] for s in runs]), 4),
                        "adherence": _round(_adherence(runs), 3), "hit_rate": round(sum(s.hit for s in runs) / len(runs), 3)}
                 for name, runs in at_knee.items()}
    return {"knee": {"steps": count, "modes": knee_rows},
            "recommended": recommend(full, _lowered(samples, curve), modes, steps).as_dict()}

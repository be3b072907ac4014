"""The workload benchmark: its prompt streams, its quality measures, and one end-to-end run of the command
through a real headless ComfyUI (3 prompts, 2 steps, every configuration; figures are not asserted here: the JSON
shape is, and what holds whatever the figures, such as summaries that agree with the per-prompt details), and the
choice of the plain run an equal-quality speedup compares against, on constructed runs.

The demo weights may not be committed yet, so the run uses a random-weight stand-in of the demo model's
architecture (--weights), which exercises the same graphs, nodes and measurements.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from carnator_core.bench.random_wan import write_random_wan
from carnator_core.bench.streams import EDIT_LOOP, STREAMS, edit_kinds, make_stream
from carnator_core.bench.workload_configurations import (
    CONFIGS,
    RECORDING,
    STEP_CACHES,
    TWO_EXPERT_CONFIGS,
    donor_prompt_for,
)
from carnator_core.bench.workload_stream import Sample
from carnator_core.bench.workload_weighing import EXTRA_FIELDS, FIELDS, STREAM_TARGETS, equal_quality_speedup, targets
from carnator_core.demo import world
from carnator_core.demo.wan_model import WanConfig
from carnator_core.judging.fewer_steps import fewer_steps, fewer_steps_count
from carnator_core.judging.quality import PSNR_IDENTICAL, mse, psnr_from_mse, ssim
from carnator_core.prompt_file import read_prompt_file
from carnator_core.reuse.report import Verdict

REPO = Path(__file__).resolve().parents[2]
# What the saved JSON says of each configuration's run of each prompt (`per_prompt`).
DETAIL_FIELDS = {"time_s", "cpu_s", "model_calls", "hit", "verdict", "skipped_steps", "attention_density", "psnr",
                 "ssim", "detail", "adherence", "observed", "donor_prompt", "reason", "probes"}
RESUMED = ("resumed", "stage skipped")  # the verdicts of a run that took a donor's state and skipped steps


def _bench(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "carnator_core.bench", "workload", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def _agrees_with_its_runs(config: dict, runs: list[dict]) -> None:
    """A configuration's summary row against its per-prompt runs: means, rates and bounds."""
    name, n = config["name"], len(runs)
    assert all(set(run) == DETAIL_FIELDS for run in runs), (name, runs)
    assert 0 <= config["hit_rate"] <= 1 and config["hit_rate"] == round(sum(run["hit"] for run in runs) / n, 3), name
    assert all(run["hit"] == (run["verdict"] in RESUMED) for run in runs), (name, runs)
    assert config["masks_only_rate"] == round(sum(run["verdict"] == "masks borrowed" for run in runs) / n, 3), name
    assert config["model_calls"] == round(sum(run["model_calls"] for run in runs) / n, 2), name
    assert all(0 < run["attention_density"] <= 1 for run in runs) and 0 < config["attention_density"] <= 1, name
    resumed = [run for run in runs if run["verdict"] in RESUMED]
    assert (config["hit_model_calls"] is None) == (config["hit_speedup"] is None) == (not resumed), (name, runs)
    assert all(run["skipped_steps"] > 0 for run in resumed), (name, runs)
    assert all(run["skipped_steps"] == 0 for run in runs if run not in resumed), (name, runs)
    assert config["ssim"] <= 1 + 1e-6 and config["psnr"] <= PSNR_IDENTICAL, name
    assert config["adherence"] is None or 0 <= config["adherence"] <= 1, name


def _equal_quality_agrees_with_configs(data: dict, markdown: str) -> None:
    """Each equal-quality speedup names the cheapest plain run of the stream's plain-steps curve (fixed rows and
    bisected counts) as adherent, as close to plain and as detailed as its configuration (else plain), its calls
    ratio is that run's calls over the configuration's inside its interval, and its words are said under the
    table."""
    fewer = [c for c in data["configs"] if fewer_steps_count(c["name"]) is not None]
    curve = {f"plain-{row['steps']}": row for row in data["plain_steps_curve"]}
    steps = max(row["steps"] for row in data["plain_steps_curve"])  # the full run's
    assert {c["name"] for c in fewer} <= set(curve) and curve[f"plain-{steps}"]["psnr"] == PSNR_IDENTICAL
    for config in data["configs"]:
        speedup = config["equal_quality_speedup"]
        if config["name"] == "plain" or config in fewer or config["name"] in STEP_CACHES:
            assert speedup is None, config  # a step cache's leftover noise would read as detail: not weighed
            continue
        as_good = [row for name, row in curve.items() if row["steps"] < steps and row["psnr"] >= config["psnr"] - 0.01
                   and (row["adherence"] is None or config["adherence"] is None
                        or row["adherence"] >= config["adherence"] - 0.005)
                   and row["detail"] >= min(config["detail"], 1.0) - 0.05 - 1e-3]
        cheapest = min(as_good, key=lambda row: row["model_calls"], default=curve[f"plain-{steps}"])
        assert speedup["steps_needed"] == cheapest["steps"], (config, data["plain_steps_curve"])
        assert speedup["calls"] == pytest.approx(cheapest["model_calls"] / config["model_calls"], abs=2e-3), config
        low, high = speedup["interval"]
        assert low <= speedup["calls"] + 1e-9 and speedup["calls"] <= high + 1e-9, config
        assert (speedup["time"] is None) == (speedup["against"] not in {"plain", *(c["name"] for c in fewer)})
        assert f"- {config['name']}: {speedup['words']}" in markdown, (config, markdown)


def _targets_agree_with_configs(data: dict, stream: str) -> None:
    """The JSON's targets are the stream's, each measured from the configurations' own figures."""
    by_name = {c["name"]: c for c in data["configs"]}
    wanted = [(config, measure, bound) for config, measures in STREAM_TARGETS[stream].items()
              for measure, bound in measures.items() if config in by_name]
    assert [(t["config"], t["measure"], t["target"]) for t in data["targets"]] == wanted and wanted
    for target in data["targets"]:
        config = by_name[target["config"]]
        if target["measure"] == "calls_speedup":
            assert target["measured"] == pytest.approx(by_name["plain"]["model_calls"] / config["model_calls"], abs=2e-3)
            assert target["met"] == (target["measured"] >= target["target"])
        if target["measure"] == "time_speedup":
            assert target["measured"] == pytest.approx(config["speedup"], abs=2e-3)
            assert target["met"] == (target["measured"] >= target["target"])
        if target["measure"] == "adherence_gap" and config["adherence"] is not None:
            assert target["measured"] == pytest.approx(by_name["plain"]["adherence"] - config["adherence"], abs=2e-3)


@pytest.mark.parametrize("name", STREAMS)
def test_streams_are_deterministic_distinct_and_scorable(name):
    prompts = make_stream(name, 8)
    assert prompts == make_stream(name, 8)
    assert len(prompts) == 8 and len(set(prompts)) == 8  # a verbatim repeat would hit ComfyUI's output cache
    assert all(world.parse_prompt(p) is not None for p in prompts), prompts


def test_near_dup_stream_revisits_scenes_and_unrelated_does_not():
    def attrs(name):
        return [world.parse_prompt(p) for p in make_stream(name, 8)]

    near = attrs("near-dup")
    assert near[0] == near[1] == near[3]  # paraphrases of one scene ...
    assert sum(near[2][k] != near[0][k] for k in world.ATTRIBUTES) == 1  # ... and a one-word edit of it
    unrelated = attrs("unrelated")
    for i, a in enumerate(unrelated):
        for b in unrelated[i + 1:]:
            assert sum(a[k] != b[k] for k in world.ATTRIBUTES) >= 3


def test_adversarial_pairs_differ_in_one_word_and_one_attribute():
    prompts = make_stream("adversarial", 8)
    for a, b in zip(prompts[::2], prompts[1::2], strict=True):
        words_a, words_b = a.split(), b.split()
        assert len(words_a) == len(words_b) and sum(x != y for x, y in zip(words_a, words_b, strict=True)) == 1
        pa, pb = world.parse_prompt(a), world.parse_prompt(b)
        changed = [k for k in world.ATTRIBUTES if pa[k] != pb[k]]
        assert changed in (["motion"], ["colour"]), (a, b)
    changes = {tuple(k for k in world.ATTRIBUTES if world.parse_prompt(a)[k] != world.parse_prompt(b)[k])
               for a, b in zip(prompts[::2], prompts[1::2], strict=True)}
    assert changes == {("motion",), ("colour",)}


def test_edit_loop_rewords_edits_one_attribute_and_returns_to_the_scene():
    prompts = make_stream("edit-loop", 8)
    kinds = edit_kinds("edit-loop", 8)
    assert kinds == list(EDIT_LOOP)
    scene = world.parse_prompt(prompts[0])
    for prompt, kind in zip(prompts, kinds, strict=True):
        changed = [k for k in world.ATTRIBUTES if world.parse_prompt(prompt)[k] != scene[k]]
        assert changed == ([kind] if kind in world.ATTRIBUTES else []), (kind, prompt)
    assert sum(kind in world.ATTRIBUTES for kind in kinds) >= 3
    assert edit_kinds("edit-loop", 10)[8:] == ["rewording", "background"]  # the pattern repeats after the scene
    with pytest.raises(ValueError, match="no kinds"):
        edit_kinds("near-dup", 4)


def test_prompts_file_and_arbitrary_donor(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a red circle moving left on a black background\n\n  a dragon over the moon \n"
                    "a small green box rising over white\n")
    prompts = read_prompt_file(str(path))
    assert prompts == ["a red circle moving left on a black background", "a dragon over the moon",
                       "a small green box rising over white"]
    donor = world.parse_prompt(donor_prompt_for(prompts))
    for prompt in (prompts[0], prompts[2]):  # unrelated to every scorable prompt in every attribute
        assert all(donor[k] != v for k, v in world.parse_prompt(prompt).items()), (donor, prompt)
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompt_file(str(tmp_path / "empty.txt"))


def test_psnr_and_ssim():
    clip = torch.rand(3, 5, 16, 16, generator=torch.Generator().manual_seed(0))
    assert psnr_from_mse(mse(clip, clip)) == PSNR_IDENTICAL and ssim(clip, clip) == pytest.approx(1.0)
    noisy = (clip + 0.01 * torch.randn(clip.shape, generator=torch.Generator().manual_seed(1))).clamp(0, 1)
    assert psnr_from_mse(mse(noisy, clip)) == pytest.approx(40.0, abs=0.5)
    assert 0.9 < ssim(noisy, clip) < 1.0
    assert ssim(torch.rand(clip.shape, generator=torch.Generator().manual_seed(2)), clip) < 0.2


def test_fewer_steps_configurations_skip_what_cannot_run_on_its_own():
    assert fewer_steps(30) == (["plain-15", "plain-10", "plain-7"], [])
    names, skipped = fewer_steps(8)
    assert names == ["plain-4", "plain-2"] and len(skipped) == 1 and "1/4" in skipped[0] and "plain-2" in skipped[0]
    names, skipped = fewer_steps(2)
    assert names == ["plain-1"] and [("1/3" in line, "0 steps" in line) for line in skipped] == [(True, True),
                                                                                               (False, True)]
    assert [fewer_steps_count(name) for name in ("plain-15", "plain", "plain-x", "fast")] == [15, None, None, None]


def _run(calls: int, seconds: float, error: float, adherence: float | None, detail: float = 1.0) -> Sample:
    """A request's outcome as `equal_quality_speedup` reads it: calls, time, MSE against plain, detail, adherence."""
    return Sample(seconds=seconds, model_calls=calls, verdict=Verdict.MISS, skipped_steps=0, density=1.0,
                  rgb=torch.zeros(1), latent=torch.zeros(1), report=None,
                  quality={"mse": error, "adherence": adherence, "detail": detail})


def test_equal_quality_speedup_weighs_by_the_yardstick_and_times_only_against_an_interleaved_row():
    plain = [_run(30, 3.0, 0.0, 1.0)] * 2
    fewer = {"plain-15": [_run(15, 1.5, 1e-5, 1.0)] * 2,  # 50 dB
             "plain-10": [_run(10, 1.0, 1e-4, 0.996)] * 2,  # 40 dB
             "plain-7": [_run(7, 0.7, 1e-3, 0.5)] * 2}  # 30 dB, the shapes lost
    close = [_run(12, 1.2, 2e-5, 1.0)] * 2  # 47 dB: only plain-15 is as close
    speedup = equal_quality_speedup(close, plain, fewer, 30, frozenset(fewer))
    assert (speedup["against"], speedup["calls"], speedup["time"], speedup["decided_by"]) == \
        ("plain-15", 1.25, 1.25, "PSNR")
    rougher = [_run(20, 2.0, 1e-3, 1.0)] * 2  # 30 dB: plain-10 is cheaper and within the adherence tolerance
    assert equal_quality_speedup(rougher, plain, fewer, 30, frozenset(fewer))["against"] == "plain-10"
    assert equal_quality_speedup(rougher, plain, fewer, 30)["time"] is None  # plain-10 not interleaved: no time
    blurred = {**fewer, "plain-10": [_run(10, 1.0, 1e-4, 0.996, detail=0.9)] * 2}  # as close, but blurred
    assert equal_quality_speedup(rougher, plain, blurred, 30)["against"] == "plain-15"
    sharper = [_run(24, 4.0, 1e-6, 1.0)] * 2  # 60 dB: no fewer-steps run is as close, so full plain
    sharp = equal_quality_speedup(sharper, plain, fewer, 30)
    assert (sharp["against"], sharp["calls"], sharp["time"], sharp["steps_needed"], sharp["steps_short"]) == \
        ("plain", 1.25, 0.75, 30, 15)


def test_a_miss_costing_more_than_three_percent_of_plains_time_misses_the_unrelated_streams_target():
    plain = [_run(30, 1.50, 0.0, 1.0), _run(30, 1.52, 0.0, 1.0), _run(30, 1.54, 0.0, 1.0)]
    cheap = [_run(30, 1.54, 0.0, 1.0), _run(31, 1.55, 0.0, 1.0), _run(30, 1.50, 0.0, 1.0)]  # 0.987x, one failed probe
    costly = [_run(30, 1.60, 0.0, 1.0), _run(30, 1.58, 0.0, 1.0), _run(32, 1.62, 0.0, 1.0)]  # 0.95x, two probes
    rows = targets("unrelated", {"plain": plain, "safe": cheap, "balanced": cheap, "fast": costly})
    by = {(row["config"], row["measure"]): row for row in rows}
    assert {config for config, _ in by} == {"safe", "balanced", "fast"}
    assert by["safe", "time_speedup"] == {"config": "safe", "measure": "time_speedup", "target": 0.97,
                                          "measured": 0.987, "met": True}
    assert by["fast", "time_speedup"]["measured"] == 0.95 and by["fast", "time_speedup"]["met"] is False
    assert by["balanced", "extra_calls"]["met"] is True and by["fast", "extra_calls"]["met"] is False


def test_missing_weights_names_the_train_command(tmp_path):
    result = _bench("--n", "3", "--weights", str(tmp_path / "missing.safetensors"), "--out", str(tmp_path))
    assert result.returncode == 1
    assert "python -m carnator_core.demo.train" in result.stderr and "missing.safetensors" in result.stderr


def test_negative_threads_are_refused_before_any_server_starts(tmp_path):
    result = _bench("--n", "3", "--threads", "-1", "--out", str(tmp_path))
    assert result.returncode == 1 and "--threads must be 0 (every core) or more" in result.stderr


@pytest.mark.server
def test_workload_end_to_end_json_shape(tmp_path):
    # three layers: the first and last stay dense by default, so the middle one gets (and borrows) masks
    weights = write_random_wan(tmp_path / "carnator_demo_random.safetensors", WanConfig(128, 256, 3))
    out = tmp_path / "out"
    result = _bench("--stream", "near-dup", "--n", "3", "--steps", "2", "--json", "--out", str(out),
                    "--weights", str(weights))
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    assert set(data) == {"stream", "prompts", "configs", "targets", "nesting", "plain_steps_curve", "knee",
                         "recommended"}
    assert {"steps", "mode", "calls", "interval", "against", "words"} <= set(data["recommended"])
    assert data["recommended"]["words"].startswith("run ") and 1 <= data["knee"]["steps"] <= 2
    assert set(data["nesting"]) == {"fast_shallower_than_balanced", "fast_over_balanced_plus_one",
                                    "balanced_over_safe_plus_one"}
    assert data["stream"] == "near-dup" and data["prompts"] == make_stream("near-dup", 3)
    _targets_agree_with_configs(data, "near-dup")
    names = ["plain", "plain-1", *CONFIGS[1:]]  # 2 steps: 1/3 and 1/4 of them are 0 steps, said and skipped
    assert [c["name"] for c in data["configs"]] == names
    assert "plain at 1/3 of 2 steps skipped" in result.stderr and "plain at 1/4 of 2 steps skipped" in result.stderr
    for config in data["configs"]:
        assert set(config) == {"name", *FIELDS, *EXTRA_FIELDS}
        for field in FIELDS:
            value = config[field]
            assert isinstance(value, (int, float)) and math.isfinite(value), (config["name"], field, value)
        assert config["cpu_speedup"] > 0, config  # the server's CPU time is readable on Linux
    by_name = {c["name"]: c for c in data["configs"]}
    assert by_name["plain"]["speedup"] == by_name["plain"]["cpu_speedup"] == 1.0
    assert by_name["plain"]["psnr"] == PSNR_IDENTICAL
    assert by_name["plain"]["model_calls"] == 2 and by_name["plain"]["hit_rate"] == 0
    assert by_name["plain-1"]["model_calls"] == 1 and by_name["plain-1"]["bytes_per_entry"] == 0
    for name, config in by_name.items():  # bytes/entry 0: the configuration records nothing
        assert (config["bytes_per_entry"] > 0) == (name in RECORDING), config
    # the unrelated donor's masks were offered and taken, and sampling them skips no step
    assert by_name["any-donor-masks"]["masks_only_rate"] > 0 and by_name["any-donor-masks"]["hit_rate"] == 0
    saved = json.loads((out / "workload_near-dup.json").read_text())
    assert saved["configs"] == data["configs"] and len(saved["per_prompt"]) == 3
    details = saved["per_prompt"]
    assert [d["prompt"] for d in details] == data["prompts"] and all(list(d["configs"]) == names for d in details)
    for config in data["configs"]:
        _agrees_with_its_runs(config, [d["configs"][config["name"]] for d in details])
    plain = [d["configs"]["plain"] for d in details]
    assert sum(run["model_calls"] for run in plain) == 2 * 3 and {run["verdict"] for run in plain} == {"miss"}
    probes = [(i, probe) for i, details in enumerate(saved["per_prompt"])
              for config in details["configs"].values() for probe in config["probes"]]
    assert all(probe["donor_prompt"] in data["prompts"][:i] for i, probe in probes), probes  # donors came earlier
    table = (out / "workload_near-dup.md").read_text()
    assert table.count("\n| ") == len(names) + 1
    assert saved["settings"]["server_threads"] == 1 and "Server torch threads: 1." in table
    _equal_quality_agrees_with_configs(data, table)
    with Image.open(out / "workload_near-dup.png") as image:
        assert image.size[0] > 0 and len(set(np.asarray(image.convert("L")).flatten().tolist())) > 2


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.parametrize("stream", ["edit-loop", "reword-and-edit"])
def test_the_modes_are_nested_by_depth_on_every_prompt_of_the_edit_streams_in_one_shared_store(tmp_path, stream):
    """On the demo model (8 steps), safe, balanced and fast against one store recorded by all three in turn, on the
    edit loop and on the first 4 prompts of docs/streams/reword-and-edit.txt (the stored runs' nesting table holds
    every prompt of every docs stream at 30 steps): on every prompt fast skips at least balanced's steps and takes at
    most balanced's model calls plus one, fewer on average, and balanced no more than safe plus its one probe call;
    the JSON's nesting lists and the markdown agree."""
    if stream == "edit-loop":
        arguments = ("--stream", "edit-loop", "--n", "4")
    else:
        prompts = tmp_path / "reword-and-edit-4.txt"
        lines = (REPO / "docs" / "streams" / "reword-and-edit.txt").read_text().splitlines()
        prompts.write_text("\n".join([line for line in lines if line.strip() and not line.startswith("#")][:4]))
        arguments = ("--prompts", str(prompts))
    out = tmp_path / "out"
    result = _bench(*arguments, "--steps", "8", "--configs", "safe,balanced,fast", "--shared-store", "--json",
                    "--out", str(out), timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    assert [c["name"] for c in data["configs"]] == ["plain", "safe", "balanced", "fast"]
    saved = json.loads(next(out.glob("workload_*.json")).read_text())
    assert saved["settings"]["shared_store"] is True
    # the modes met each other's donors: no plain-steps curve, no mode at the knee, and the run says so
    assert [row["steps"] for row in data["plain_steps_curve"]] == [8] and data["knee"]["modes"] == {}
    assert "--shared-store: the modes met each other's donors, so no plain-steps curve is sampled" in result.stderr
    runs = [prompt["configs"] for prompt in saved["per_prompt"]]
    assert len(runs) == len(data["prompts"]) and any(r["fast"]["skipped_steps"] > r["balanced"]["skipped_steps"]
                                                     for r in runs)
    assert [r for r in runs if r["fast"]["skipped_steps"] < r["balanced"]["skipped_steps"]
            or r["fast"]["model_calls"] > r["balanced"]["model_calls"] + 1
            or r["balanced"]["model_calls"] > r["safe"]["model_calls"] + 1] == []
    by_name = {c["name"]: c for c in data["configs"]}
    assert by_name["fast"]["model_calls"] < by_name["balanced"]["model_calls"]
    assert data["nesting"] == {"fast_shallower_than_balanced": [], "fast_over_balanced_plus_one": [],
                               "balanced_over_safe_plus_one": []}
    table = next(out.glob("workload_*.md")).read_text()
    assert "one store shared by safe, balanced, fast" in table
    assert "fast resumed shallower than balanced on 0 prompts; fast took more than balanced + 1 model calls on 0 " \
           "prompts" in table


@pytest.mark.server
def test_two_expert_workload_counts_each_expert_and_reports_hits_and_kinds(tmp_path):
    weights = write_random_wan(tmp_path / "carnator_demo_random.safetensors", WanConfig(128, 256, 3))
    out = tmp_path / "out"
    result = _bench("--graph", "two-expert", "--stream", "edit-loop", "--n", "2", "--steps", "4", "--json",
                    "--out", str(out), "--weights", str(weights))
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    assert data["stream"] == "edit-loop (two-expert)"
    assert set(data) == {"stream", "prompts", "configs", "per_kind", "targets", "nesting",
                         "plain_steps_curve", "knee", "recommended"}
    _targets_agree_with_configs(data, "edit-loop")
    by_name = {c["name"]: c for c in data["configs"]}
    names = ["plain", "plain-2", "plain-1", *TWO_EXPERT_CONFIGS[1:]]  # 4 // 4 steps is plain-1 again: said, skipped
    assert list(by_name) == names
    assert "plain at 1/4 of 4 steps skipped: 1 step, as plain-1 already runs" in result.stderr
    assert all(set(config) == {"name", *FIELDS, *EXTRA_FIELDS} for config in data["configs"])
    assert by_name["plain"]["model_calls"] == 4 and by_name["plain"]["stage_model_calls"] == [2, 2]
    assert by_name["plain-2"]["model_calls"] == 2 and by_name["plain-2"]["stage_model_calls"] == [1, 1]
    assert by_name["plain-1"]["model_calls"] == 1 and by_name["plain-1"]["stage_model_calls"] == [1, 0]
    for name in ("balanced", "fast"):  # the rewording of the scene resumes: the first stage is skipped whole
        assert by_name[name]["hit_rate"] == 0.5 and by_name[name]["stage_model_calls"][0] == 1.5, by_name[name]
    assert by_name["balanced"]["hit_model_calls"] == 3 and by_name["fast"]["hit_model_calls"] == 2
    rewording = data["per_kind"]["fast"]["rewording"]
    assert rewording == {"requests": 1, "resumed": 1, "skipped_steps": [3], "adherence": rewording["adherence"],
                         "psnr": rewording["psnr"], "resumed_psnr": rewording["psnr"]}  # its one clip resumed
    assert all(kind["psnr"] == 100.0 and kind["resumed_psnr"] is None  # plain against itself, never resumed
               for kind in data["per_kind"]["plain"].values())
    table = (out / "workload_edit-loop_two-expert.md").read_text()
    assert "| first-expert calls |" in table and "| masks-only rate |" in table
    _equal_quality_agrees_with_configs(data, table)
    per_prompt = json.loads((out / "workload_edit-loop_two-expert.json").read_text())["per_prompt"]
    assert [p["configs"]["fast"]["verdict"] for p in per_prompt] == ["miss", "stage skipped"], per_prompt
    assert list(data["per_kind"]) == names
    for config in data["configs"]:
        runs = [p["configs"][config["name"]] for p in per_prompt]
        _agrees_with_its_runs(config, runs)
        kinds = data["per_kind"][config["name"]]  # the per-kind counts add up to the runs and their verdicts
        assert sum(kind["requests"] for kind in kinds.values()) == len(runs) == 2
        assert sum(kind["resumed"] for kind in kinds.values()) == sum(run["verdict"] in RESUMED for run in runs)
        assert sum(kind["resumed"] for kind in kinds.values()) == round(config["hit_rate"] * len(runs))
        assert sorted(s for kind in kinds.values() for s in kind["skipped_steps"]) == sorted(
            run["skipped_steps"] for run in runs)
    plain = [p["configs"]["plain"] for p in per_prompt]
    assert [run["model_calls"] for run in plain] == [4, 4]  # steps x requests, both experts together


def test_a_staged_graph_runs_the_stages_benchmark_on_the_users_server():
    """`--graph ltx2-two-stage` is the shipped LTX-2 workflow on the user's server: without one it says so."""
    result = _bench("--graph", "ltx2-two-stage", timeout=60)
    assert result.returncode == 2 and "--server" in result.stderr, result.stderr
    result = _bench("--graph", "ltx2-two-stage", "--server", "http://127.0.0.1:9", timeout=60)
    assert result.returncode == 1 and result.stderr.startswith("carnator stages benchmark: cannot reach"), \
        result.stderr

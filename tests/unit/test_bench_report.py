"""Published tables come from stored runs: `bench report` writes them between their markers, `--check` fails on a
hand edit to one, and a time ratio shows only from a run that had the machine to itself."""

from __future__ import annotations

import json
import statistics
import subprocess
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from carnator_core.bench import report
from carnator_core.bench.tables.agreement import AGREEMENT_CFGS, AGREEMENT_RUNS, AGREEMENT_STREAMS, agreement_table
from carnator_core.bench.tables.deep_first import DEEP_FIRST_RUNS
from carnator_core.bench.tables.stored_runs import StoredRuns
from carnator_core.bench.tables.streams import STREAM_RUNS
from carnator_core.judging.ratio_interval import median_ratio_interval
from carnator_core.recorded_runs import CpuUse, RunConditions

SHARED = RunConditions(
    command="python -m carnator_core.bench workload --stream edit-loop --n 8", commit="0" * 40,
    uncommitted_changes=False, comfyui_version="0.3.64", frontend_version="1.27.10", torch_version="2.14.1",
    cores=2, torch_threads=1, gpu=None, load_before=(3.1, 3.0, 2.9), load_after=(4.2, 3.5, 3.0), wall_seconds=300.0,
    others_cpu_cores=1.2, alone=False)
ALONE = replace(SHARED, others_cpu_cores=0.01, alone=True)


def _config(name: str, calls: float, speedup: float, psnr: float, against: str | None = "plain") -> dict:
    equal = None if against is None else {"against": against, "calls": round(30 / calls, 3), "time": speedup}
    return {"name": name, "speedup": speedup, "model_calls": calls, "psnr": psnr, "ssim": 0.99, "adherence": 1.0,
            "equal_quality_speedup": equal}


def _store(results_dir: Path, name: str, conditions: RunConditions, per_prompt: list | None = None) -> None:
    configs = [_config("plain", 30.0, 1.0, 100.0, None), _config("plain-15", 15.0, 1.98, 38.3, None),
               _config("plain-10", 10.0, 2.97, 33.5, None), _config("balanced", 23.1, 1.27, 46.8),
               _config("fast", 19.1, 1.61, 46.4)]
    payload = {"run": asdict(conditions), "stream": name, "prompts": [], "configs": configs,
               "settings": {"steps": 30, "cfg": 4.0 if name.endswith("cfg4") else 1.0}, "per_prompt": per_prompt or []}
    (results_dir / f"{name}.json").write_text(json.dumps(payload))


def _store_agreement(results_dir: Path, name: str, fast_calls: float = 1.58) -> None:
    """A workload run (agree-*) or a stream calibration (calibrate-*) of the agreement table."""
    if name.startswith("agree-"):
        configs = [{"name": mode, "equal_quality_speedup": {"against": "plain-26", "calls": calls,
                                                             "interval": [calls - 0.3, calls + 0.3], "time": None}}
                   for mode, calls in (("balanced", 1.27), ("fast", fast_calls))]
        payload = {"run": asdict(SHARED), "configs": configs}
    else:
        verdicts = {mode: {"against": "plain-26", "calls": calls, "interval": [calls - 0.4, calls + 0.4], "pairs": 16}
                    for mode, calls in (("balanced", 1.27), ("fast", 1.6))}
        payload = {"run": asdict(SHARED), "kind": "calibration", "profile": {"equal_quality": verdicts}}
    (results_dir / f"{name}.json").write_text(json.dumps(payload))


@pytest.fixture
def published(tmp_path, monkeypatch) -> Path:
    """A results folder with every stream run (edit-loop alone on the machine, the others shared) and a document
    holding the generated tables, as `bench report` leaves it; `report.main` reads these."""
    results_dir = tmp_path / "docs" / "results"
    results_dir.mkdir(parents=True)
    for name in AGREEMENT_RUNS:
        _store_agreement(results_dir, name)
    for name in {*STREAM_RUNS, *DEEP_FIRST_RUNS}:
        _store(results_dir, name, ALONE if name == "edit-loop" else SHARED)
    document = tmp_path / "docs" / "measurements.md"
    document.write_text("# Results\n\n<!-- results:streams -->\n<!-- /results:streams -->\n\nText.\n\n"
                        "<!-- results:runs -->\n<!-- /results:runs -->\n")
    monkeypatch.setattr(report, "DOCUMENTS", (document,))
    monkeypatch.setattr(report, "RESULTS_DIR", results_dir)
    assert report.main([]) == 0
    return document


def test_check_passes_on_the_generated_tables_and_fails_on_a_hand_edit(published):
    assert report.main(["--check"]) == 0
    text = published.read_text()
    assert "| [edit-loop (8)](results/edit-loop.json) | fast | 1.61x | 19.1 | 46.4 |" in text
    published.write_text(text.replace("| fast | 1.61x | 19.1 |", "| fast | 1.67x | 18.0 |"))
    assert report.main(["--check"]) == 1
    assert "1.67x" in published.read_text(), "--check changes nothing"
    assert report.main([]) == 0
    assert report.main(["--check"]) == 0
    assert "| fast | 1.61x | 19.1 |" in published.read_text()


def test_a_shared_run_shows_calls_and_quality_and_says_why_its_time_is_empty(published):
    text = published.read_text()
    assert ("| [near-dup (8)](results/near-dup.json) | fast | — (not measured alone) | 19.1 | 46.4 | 0.990 | 1.000 | "
            "1.57x; plain |") in text
    assert "| [edit-loop (8)](results/edit-loop.json) | fast | 1.61x | 19.1 | 46.4 | 0.990 | 1.000 | 1.57x, 1.61x; plain |" \
        in text
    assert "other processes used 1.20 of the 2 cores during the run: shared, times not shown." in text
    assert "other processes used 0.01 of the 2 cores during the run: alone, times shown." in text


def test_the_readme_table_and_text_outside_the_markers(published, monkeypatch):
    document = published.parent.parent / "README.md"
    document.write_text("Intro.\n<!-- results:readme -->\nhand-typed 3.51x\n<!-- /results:readme -->\nOutro.\n")
    monkeypatch.setattr(report, "DOCUMENTS", (published, document))
    assert report.main(["--check"]) == 1
    assert report.main([]) == 0
    text = document.read_text()
    assert text.startswith("Intro.\n<!-- results:readme -->\n| stream |") and text.endswith("<!-- /results:readme -->\nOutro.\n")
    assert "3.51x" not in text
    assert ("| [near-dup (8)](docs/results/near-dup.json) | not shown: other processes used 1.20 of the 2 cores during "
            "the run | 23.1, 46.8 dB, 1.000 |") in text
    assert ("| [edit-loop (8)](docs/results/edit-loop.json) | 1.27x / 1.61x | 23.1, 46.8 dB, 1.000 | "
            "19.1, 46.4 dB, 1.000 | 1.30x / 1.57x (against plain) | 15: 38.3 dB · 10: 33.5; all 1.000 |") in text


def test_an_unknown_table_or_a_missing_run_fails_with_its_name(published, capsys):
    published.write_text(published.read_text() + "<!-- results:nope -->\n<!-- /results:nope -->\n")
    assert report.main(["--check"]) == 1
    assert "no results table 'nope'" in capsys.readouterr().err
    published.write_text(published.read_text().replace("<!-- results:nope -->\n<!-- /results:nope -->\n", ""))
    (report.RESULTS_DIR / "mixed.json").unlink()
    assert report.main(["--check"]) == 1
    assert "mixed.json" in capsys.readouterr().err


def test_a_run_had_the_machine_alone_only_while_other_processes_stayed_near_idle(tmp_path):
    before = CpuUse(machine_seconds=100.0, own_seconds=10.0, wall=0.0, load=(0.5, 0.5, 0.5))
    quiet = CpuUse(machine_seconds=161.0, own_seconds=70.0, wall=60.0, load=(1.0, 0.8, 0.6))
    busy = CpuUse(machine_seconds=190.0, own_seconds=70.0, wall=60.0, load=(2.0, 1.2, 0.8))
    alone = RunConditions.measured("python -m carnator_core.bench workload", "unknown", 1, before, quiet)
    shared = RunConditions.measured("python -m carnator_core.bench workload", "unknown", 1, before, busy)
    assert (alone.others_cpu_cores, alone.alone, alone.why_no_time) == (0.017, True, None)
    assert (shared.others_cpu_cores, shared.alone) == (0.5, False)
    assert shared.why_no_time == f"not shown: other processes used 0.50 of the {shared.cores} cores during the run"
    assert (shared.wall_seconds, shared.load_before, shared.load_after, shared.torch_threads) == \
        (60.0, (0.5, 0.5, 0.5), (2.0, 1.2, 0.8), 1)
    assert len(shared.commit) == 40 and shared.comfyui_version == "unknown"


def test_where_the_system_does_not_say_what_else_ran_no_time_is_shown(tmp_path):
    blind = CpuUse(machine_seconds=None, own_seconds=10.0, wall=0.0, load=(0.5, 0.5, 0.5))
    conditions = RunConditions.measured("python -m carnator_core.bench workload", "unknown", 1, blind, blind)
    assert (conditions.others_cpu_cores, conditions.alone) == (None, False)
    assert conditions.why_no_time == "not shown: this system does not say what else used the CPU during the run"


def _probe(donor: str, step: int, agreement: float, passed: bool) -> dict:
    return {"donor_prompt": donor, "step": step, "passed": passed, "donor_given_up": False,
            "structure_agreement": agreement}


def test_the_deep_first_table_counts_each_deep_probe_of_a_screened_donor_once_by_its_screen_s_clearance(published):
    """The deep-first margin's evidence: a deep probe counts in the bin of how far its donor's step-0 screen cleared
    the probe's bar (0.922 at step 24 of 30), once per prompt whichever modes asked it; a donor the screen did not
    judge does not count."""
    both = [_probe("scene", 0, 0.960, True), _probe("scene", 24, 0.95, True)]  # cleared by 0.038, in both modes
    per_prompt = [
        {"prompt": "a rewording", "configs": {"balanced": {"probes": both}, "fast": {"probes": both}}},
        {"prompt": "an edit", "configs": {"fast": {"probes": [_probe("scene", 0, 0.950, True),  # by 0.028
                                                               _probe("scene", 24, 0.89, False)]}}},
        {"prompt": "another seed", "configs": {"fast": {"probes": [_probe("scene", 6, 0.99, True)]}}},  # unscreened
        {"prompt": "a near twin", "configs": {"fast": {"probes": [_probe("scene", 0, 0.990, True),  # by 0.068
                                                                  _probe("scene", 24, 0.98, True)]}}},
    ]
    _store(report.RESULTS_DIR, "agree-blocks-and-balls-cfg1", SHARED, per_prompt)
    published.write_text(published.read_text() + "\n<!-- results:deep-first -->\n<!-- /results:deep-first -->\n")
    assert report.main([]) == 0
    row = next(line for line in published.read_text().splitlines() if line.startswith("| 1 |"))
    assert row.endswith("| none asked | 0 of 1 passed | 1 of 1 passed | 1 of 1 passed |"), row
    assert "[agree-blocks-and-balls-cfg1](results/agree-blocks-and-balls-cfg1.json)" in row
    assert report.main(["--check"]) == 0


def test_a_stored_result_is_not_an_uncommitted_change_to_the_code_that_ran(tmp_path, monkeypatch):
    """A run that records writes into docs/results/, so the next run of the same commit must not count that file as
    a change to the code it ran; a change anywhere else counts."""
    from carnator_core import recorded_runs as results

    repo = tmp_path / "repo"
    stored = repo / "docs" / "results" / "edit-loop.json"
    stored.parent.mkdir(parents=True)
    (repo / "engine.py").write_text("DEPTH = 0.8\n")
    stored.write_text("{}\n")
    git = ["git", "-C", str(repo), "-c", "user.name=ci", "-c", "user.email=ci@localhost"]
    for command in (["init", "-q"], ["add", "."], ["commit", "-qm", "code and a stored run"]):
        subprocess.run([*git, *command], check=True)
    monkeypatch.setattr(results, "REPO_DIR", repo)
    monkeypatch.setattr(results, "RESULTS_DIR", stored.parent)

    def measured() -> RunConditions:
        return RunConditions.measured("python -m carnator_core.bench workload", "0.3.64", 1, CpuUse.now(),
                                      CpuUse.now())

    stored.write_text('{"rerun": true}\n')
    assert not measured().uncommitted_changes
    (repo / "engine.py").write_text("DEPTH = 0.9\n")
    assert measured().uncommitted_changes


def test_a_time_ratio_from_a_run_alone_shows_its_interval_over_the_run_s_requests(published):
    """Where the run stored each request's time, a time ratio carries its 90 % bootstrap interval over the requests,
    the same on every report (seeded), around the ratio of medians."""
    plain, fast = [1.6, 2.4, 1.7, 2.1, 1.9, 1.8, 2.0, 1.6], [0.4, 1.8, 0.5, 0.4, 2.0, 0.5, 0.4, 0.5]
    per_prompt = [{"prompt": f"p{i}", "configs": {"plain": {"time_s": a}, "fast": {"time_s": b}}}
                  for i, (a, b) in enumerate(zip(plain, fast, strict=True))]
    _store(report.RESULTS_DIR, "edit-loop", ALONE, per_prompt)
    assert report.main([]) == 0
    row = next(line for line in published.read_text().splitlines()
               if line.startswith("| [edit-loop (8)](results/edit-loop.json) | fast |"))
    low, high = median_ratio_interval(plain, fast)
    assert low < statistics.median(plain) / statistics.median(fast) < high
    assert f"| 1.61x ({low:.2f}–{high:.2f}x) |" in row, row
    assert report.main(["--check"]) == 0


def test_the_interval_of_a_ratio_of_medians():
    times = [1.0, 1.2, 0.9, 1.1, 1.3, 0.8]
    assert median_ratio_interval(times, times) == (1.0, 1.0)
    halved = [t / 2 for t in times]
    assert median_ratio_interval(times, halved) == pytest.approx((2.0, 2.0))
    noisy = [t * f for t, f in zip(times, [1.0, 1.5, 0.7, 1.2, 0.9, 1.4], strict=True)]
    low, high = median_ratio_interval(times, noisy)
    assert low < 1.0 < high and (low, high) == median_ratio_interval(times, noisy)
    with pytest.raises(ValueError):
        median_ratio_interval(times, times[:-1])


def test_the_agreement_table_says_whether_the_workload_s_ratio_lies_in_the_calibration_s_interval(published):
    results_dir = report.RESULTS_DIR
    for name in AGREEMENT_RUNS:  # the fixture's deep-first runs overwrote the workload's agree-* records
        _store_agreement(results_dir, name)
    table = agreement_table(StoredRuns(results_dir), lambda name: f"results/{name}.json")
    rows = table.splitlines()[2:]
    assert len(rows) == 2 * len(AGREEMENT_STREAMS) * len(AGREEMENT_CFGS)
    assert rows[1] == ("| [blocks-and-balls](results/agree-blocks-and-balls-cfg1.json) | 1 | fast | 1.58x (1.28–1.88x), "
                       "plain at 26 steps | [saves 1.60x (1.20–2.00x)](results/calibrate-blocks-and-balls-cfg1.json), "
                       "plain at 26 steps | yes |")
    _store_agreement(results_dir, "agree-blocks-and-balls-cfg1", fast_calls=2.5)
    assert agreement_table(StoredRuns(results_dir), str).splitlines()[3].endswith("| **no** |")


def _attention_rows(fp32_speedup: float) -> list[dict]:
    return [{"n": 8192, "heads": 12, "head_dim": 128, "density": density, "dense_s": 3.0,
             "sparse_s": round(3.0 / speedup, 4), "speedup": speedup, "ideal": round(1 / density, 2),
             "max_abs_err": 5e-7}
            for density, speedup in ((0.125, fp32_speedup), (0.25, 3.0), (0.5, 1.5))]


def _store_attention(results_dir: Path, name: str, conditions: RunConditions, speedup: float) -> None:
    config = {"device": "cpu", "backend": "auto", "dtype": "float32", "threads": 1, "repeats": 3, "block_size": 128,
              "clock": "process"}
    payload = {"run": asdict(replace(conditions, comfyui_version="none")), "rows": _attention_rows(speedup),
               "config": config}
    (results_dir / f"{name}.json").write_text(json.dumps(payload))


def test_the_attention_targets_read_the_stored_rows_and_show_no_time_from_a_shared_run(published):
    """A speedup target holds where its least covered figure does, an error target where its largest does; a miss
    reads **no**; a shared run's time targets say why they are empty while its error targets still count."""
    from carnator_core.bench.tables.attention import attention_table, attention_targets_table

    results_dir = report.RESULTS_DIR
    _store_attention(results_dir, "attention-fp32", ALONE, 5.9)
    _store_attention(results_dir, "attention-bf16", ALONE, 4.0)
    rows = attention_targets_table(StoredRuns(results_dir), str).splitlines()[2:]
    assert rows[0].endswith("| at least 6x | 5.90 | **no** |"), rows[0]
    assert rows[1].endswith("| at least 0.6 | 0.74 (least) | yes |"), rows[1]
    assert rows[3].endswith("| at most 1e-5 | 5.00e-07 | yes |"), rows[3]
    _store_attention(results_dir, "attention-fp32", SHARED, 7.0)
    rows = attention_targets_table(StoredRuns(results_dir), str).splitlines()[2:]
    assert rows[0].endswith("| — (not measured alone) | — |") and rows[3].endswith("| yes |"), rows
    table = attention_table("attention-fp32", StoredRuns(results_dir), str)
    assert "| 8192 | 0.1250 | — | — | — | — | 5.00e-07 |" in table and "not shown: other processes used" in table


def test_a_miss_costs_table_counts_the_requests_that_sampled_every_step(published):
    """What a miss costs: per mode the requests that skipped no step, their calls beyond plain's and, from a run alone,
    the time on those requests only."""
    from carnator_core.bench.tables.streams import MISS_RUN, misses_table

    per_prompt = []
    for i in range(6):
        hit = i == 5  # one resumed request: not a miss, left out of every cell
        configs = {"plain": {"time_s": 2.0, "model_calls": 30, "skipped_steps": 0}}
        for mode in ("text-only", "safe", "balanced", "fast"):
            configs[mode] = {"time_s": 1.0 if hit else 2.0, "model_calls": 16 if hit else 30 + (mode == "fast" and i < 2),
                             "skipped_steps": 15 if hit else 0}
        per_prompt.append({"prompt": f"p{i}", "configs": configs})
    _store(report.RESULTS_DIR, MISS_RUN, ALONE, per_prompt)
    rows = {line.split(" | ")[0][2:]: line for line in
            misses_table(StoredRuns(report.RESULTS_DIR), str).splitlines() if line.startswith("| ")}
    assert rows["fast"] == "| fast | 5 of 6 | 1.000x (1.000–1.000x) | 30.40 | +1 | 0 |", rows["fast"]
    assert rows["safe"] == "| safe | 5 of 6 | 1.000x (1.000–1.000x) | 30.00 | +0 | 0 |", rows["safe"]


def test_a_recording_stores_only_when_asked_and_says_whether_its_run_is_timed(tmp_path, monkeypatch):
    from carnator_core import recorded_runs as results

    stored = tmp_path / "docs" / "results"
    monkeypatch.setattr(results, "REPO_DIR", tmp_path)
    monkeypatch.setattr(results, "RESULTS_DIR", stored)
    assert results.Recording(None, "carnator_core.bench masks", []).store({"rows": []}) is None
    assert not stored.exists()
    path = results.Recording("masks", "carnator_core.bench masks", ["--n", "8"]).store({"rows": []}, timed=False)
    conditions, payload = results.read_result("masks", stored)
    assert path == stored / "masks.json" and payload == {"rows": []}
    assert conditions.command == "python -m carnator_core.bench masks --n 8"
    assert (conditions.comfyui_version, conditions.frontend_version, conditions.timed) == ("none", None, False)
    runs = report.runs_list(StoredRuns(stored), str)
    assert "no ComfyUI" in runs and runs.rstrip().endswith("calls and quality only, no times.")


def test_a_benchmark_run_with_record_is_stored_and_its_table_generated_from_it(tmp_path, monkeypatch, capsys):
    """`bench attention --record NAME` end to end (the smallest size): the stored rows are the ones it printed, with
    conditions that say no ComfyUI ran, and the attention table is written from them."""
    from carnator_core import recorded_runs
    from carnator_core.bench import attention
    from carnator_core.bench.tables.attention import attention_table

    stored = tmp_path / "docs" / "results"
    monkeypatch.setattr(recorded_runs, "REPO_DIR", tmp_path)
    monkeypatch.setattr(recorded_runs, "RESULTS_DIR", stored)
    argv = ["--quick", "--sizes", "512", "--threads", "1", "--json", "--record", "attention-fp32"]
    assert attention.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    conditions, result = recorded_runs.read_result("attention-fp32", stored)
    assert result["rows"] == printed["rows"] and len(result["rows"]) == 4
    assert conditions.command == "python -m carnator_core.bench attention " + " ".join(argv)
    assert conditions.comfyui_version == recorded_runs.NO_COMFYUI and conditions.torch_threads == 1
    table = attention_table("attention-fp32", StoredRuns(stored), str)
    assert table.count("\n| 512 | ") == 4


def test_the_report_imports_no_torch():
    """CI checks the tables with the system Python, before any venv with torch exists: the report and every table
    module read JSON and format it, nothing more."""
    import sys

    code = "import sys, carnator_core.bench.report; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(report.__file__).parents[2]).returncode == 0

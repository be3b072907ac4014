"""`python -m carnator_core.calibrate` through a real headless ComfyUI on the shipped demo model, and what it leaves:
a profile filed in the store that the next `CarnatorReuse` run, thresholds left at auto, is judged by.

The workflow is the shipped CPU demo's API twin at 8 steps; the pairs are the first three of the shipped demo
pairs file (two fitted, one held back). The Wan 2.1, Wan 2.2 14B and LTX-2 twins calibrate on the tiny models. The interruption test stops the server after the first measured resume
and starts another on the same base directory: the same command finishes the rest without redoing what was done.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from support.comfy_host import REPO_ROOT, ServerFactory, make_base_dir
from support.t2v_graphs import LTX2_AUDIO_LATENT, ltx2_audio_latent_shape
from support.tiny_models import LTXAV, host_lacks, write_ltx2_stage_models, write_tiny_model
from support.tiny_workflows import api_workflow, on_tiny_models

from carnator_core.calibration.job import CalibrationPlan, calibrate
from carnator_core.calibration.server_runs import CalibrationInterrupted
from carnator_core.calibration.workflow import CalibrationWorkflow
from carnator_core.demo.server import demo_weights
from carnator_core.judging.calibration_profile import Profile
from carnator_core.judging.plain_steps_curve import MAX_LOWERED_COUNTS
from carnator_core.queue import Workflow

pytestmark = pytest.mark.server

STEPS = 8
PAIRS_FILE = REPO_ROOT / "workflows" / "calibration_pairs_demo.txt"
EARLIER, REWORDED = "a blue circle moving left on a black background", "a blue disc moving left on a black background"


LOW_NOISE_UNET = "tiny_wan_low_noise.safetensors"  # the Wan 2.2 14B twin's low-noise expert at test size


@pytest.fixture(scope="module")
def servers(comfyui_path: Path, tmp_path_factory: pytest.TempPathFactory, tiny_models, current_model):
    low_noise = write_tiny_model("wan", tmp_path_factory.mktemp("low_noise"), seed=1, filename=LOW_NOISE_UNET)
    models = {"demo": demo_weights(), "low_noise": low_noise,
              **{family: model.path for family, model in tiny_models.items()}}
    if not host_lacks(LTXAV):  # the LTX-2 twin: its tiny model and its empty audio latent
        models["ltxav"] = current_model("ltxav").path
    base = make_base_dir(tmp_path_factory.mktemp("calibration"), models)
    if not host_lacks(LTXAV):
        write_ltx2_stage_models(base / "models")
    audio = {"latent_tensor": torch.zeros(ltx2_audio_latent_shape()), "latent_format_version_0": torch.tensor([])}
    save_file(audio, str(base / "input" / LTX2_AUDIO_LATENT))
    factory = ServerFactory(comfyui_path, lambda: base)
    try:
        yield factory
    finally:
        factory.stop_all()


@pytest.fixture(scope="module")
def server(servers: ServerFactory):
    return servers()


def _graph(steps: int = STEPS) -> dict:
    graph = api_workflow("carnator_demo_cpu")
    for node in graph.values():
        if node["class_type"] == "KSampler":
            node["inputs"]["steps"] = steps
    return graph


def _files(tmp_path: Path, graph: dict, pairs: int = 3) -> tuple[Path, Path]:
    workflow = tmp_path / "workflow.json"
    workflow.write_text(json.dumps(graph))
    lines = [line for line in PAIRS_FILE.read_text().splitlines() if line and not line.startswith("#")][:pairs]
    pairs_file = tmp_path / "pairs.txt"
    pairs_file.write_text("\n".join(lines) + "\n")
    return workflow, pairs_file


def _calibrate(url: str, workflow: Path, pairs: Path, out: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "carnator_core.calibrate", "--server", url, "--workflow", str(workflow),
               "--pairs", str(pairs), "--out", str(out), "--depths", "0.2,0.5", *extra]
    return subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _report(server, prompt: str, record: bool, top_k: int = 4) -> dict:
    """The report of the shipped demo workflow (8 steps) run on `prompt`, recording or not; another `top_k` makes
    ComfyUI sample an otherwise identical graph again rather than serve it from its cache."""
    graph = Workflow(_graph()).for_prompt(prompt, "fixed", None)
    for node in graph.values():
        if node["class_type"] == "CarnatorReuse":
            node["inputs"].update(record=record, sparse_attention="off", top_k=top_k)
    [report] = server.client.run(graph).statuses
    return report


def _bisected(plain_runs: list[dict], pairs, steps: int = STEPS) -> list[int]:
    """The fewer step counts plain ran at, fewest first, checked: half the steps first, at most MAX_LOWERED_COUNTS of
    them, each once on every pair beside the full run."""
    counts = sorted({row["steps"] for row in plain_runs} - {steps})
    assert next(row["steps"] for row in plain_runs if row["steps"] != steps) == (steps + 1) // 2, plain_runs
    assert 1 <= len(counts) <= MAX_LOWERED_COUNTS and min(counts) >= 2, counts
    assert sorted((row["pair"], row["steps"]) for row in plain_runs) == [(p, n) for p in pairs
                                                                         for n in (*counts, steps)]
    return counts


def _knee_runs_ran(out: Path, profile: Profile, counts: list[int], pairs) -> None:
    """Balanced and fast ran at the knee on every pair (where the knee is below the steps), and the recommendation
    weighed them."""
    path = out / "knee_runs.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    knees = {row["steps"] for row in rows}
    assert len(knees) <= 1 and knees <= set(counts), rows
    assert sorted((row["pair"], row["mode"]) for row in rows) == ([] if not knees else sorted(
        (p, mode) for p in pairs for mode in ("balanced", "fast")))
    assert profile.recommended is not None and profile.recommended.steps in (*counts, STEPS)


def test_calibration_writes_a_profile_that_auto_thresholds_then_judge_by(server, tmp_path):
    workflow, pairs = _files(tmp_path, _graph())
    out = tmp_path / "out"
    started = time.monotonic()
    run = _calibrate(server.url, workflow, pairs, out, "--force")  # one held-back pair: forced to see it judge
    output, _ = run.communicate(timeout=900)
    assert run.returncode == 0, output
    profile = Profile.from_json((out / "profile.json").read_text())
    # last, per mode, whether reuse beats just lowering the steps, weighed on the held-back pair
    assert output.splitlines()[-3:] == profile.verdict_lines() and len(profile.verdict_lines()) == 3, output
    assert profile.verdict_lines()[-1].startswith("Recommended: run ")  # last, what to run
    assert output.splitlines()[-4].endswith("(in force)") and "pairs used 3; a stable fit here" in output
    assert "calibrating on 3 pairs x 2 depths (decoded frames, demo oracle)" in output
    assert "plain also at up to 4 bisected step counts of 8 (the first 4), then balanced and fast at the knee" in output
    assert re.search(r"\b1/\d+ runs, about .* left", output)  # progress with an estimate of the time left
    assert "depth  resumes  good  accepted by the fitted rule" in output
    rows = [json.loads(line) for line in (out / "resumes.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {row["pair"] for row in rows} == {0, 1, 2}
    assert all(row["skipped_steps"] in (2, 4) and row["screen_structure"] is not None for row in rows)
    reworded = [row for row in rows if row["pair"] == 0]  # a rewording resumed is close to its plain clip
    assert all(row["psnr_db"] > 30 and row["ssim"] > 0.95 and row["oracle_kept"] for row in reworded)
    assert (profile.fit_pairs, profile.held_back_pairs) == (2, 1) and profile.oracle is not None
    plain_runs = [json.loads(line) for line in (out / "plain_runs.jsonl").read_text().splitlines()]
    counts = _bisected(plain_runs, range(3))
    assert all(row["model_calls"] == row["steps"] for row in plain_runs)  # plain: one model call per step
    assert {name: run.steps for name, run in profile.fewer_steps.items()} == {f"plain-{n}": n for n in counts}
    assert profile.fewer_steps[f"plain-{counts[0]}"].psnr_db < profile.fewer_steps[f"plain-{counts[-1]}"].psnr_db < 100
    _knee_runs_ran(out, profile, counts, range(3))
    for weighed in profile.equal_quality.values():  # the held-back pair (the third), under the fitted rule
        assert (weighed.pairs, weighed.held_back, weighed.steps) == (1, True, STEPS), weighed
        against = STEPS if weighed.against == "plain" else profile.fewer_steps[weighed.against].model_calls
        assert weighed.calls == pytest.approx(against / weighed.model_calls, abs=1e-3)
    assert (out / "plot-structure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "plot-pairs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    filed = server.get("/carnator/store/profiles").json()["profiles"]
    assert [p["key"] for p in filed] == [profile.key] and f"filed as {profile.describe()}" in output
    print(f"calibration of 3 pairs x 2 depths at {STEPS} steps took {time.monotonic() - started:.0f} s")

    # the next run of the workflow, thresholds left at auto, is judged by the profile; a stricter profile misses
    _report(server, EARLIER, record=True)
    judged = _report(server, REWORDED, record=False)
    assert judged["judged_by"] == profile.describe()
    lenient = {**profile.as_dict(), "thresholds": {"structure": 0.5, "structure_slope": 0.0, "guidance": 0.5,
                                                   "guidance_slope": 0.0}, "name": "lenient"}
    assert server.post("/carnator/store/profiles", json=lenient).status_code == 200
    hit = _report(server, REWORDED, record=False, top_k=5)
    assert hit["judged_by"].startswith("profile 'lenient'") and hit["verdict"] == "resumed"
    assert profile.equal_quality["balanced"].short("balanced") in hit["notes"]  # the profile's verdict on its mode
    strict = {**lenient, "thresholds": {**lenient["thresholds"], "structure": 1.0}, "name": "strict"}
    assert server.post("/carnator/store/profiles", json=strict).status_code == 200
    miss = _report(server, REWORDED, record=False, top_k=6)
    assert miss["judged_by"].startswith("profile 'strict'") and miss["verdict"] == "miss"


def test_a_hand_edited_profile_is_refused_at_import_naming_the_field(server):
    server.client.run({"1": {"class_type": "CarnatorStoreInfo", "inputs": {}}})  # the default store, opened
    profile = Profile(model="abc", schedule="def", name="edited", thresholds={
        "structure": 0.9, "structure_slope": 0.0, "guidance": 0.5, "guidance_slope": 0.0}).as_dict()
    profile["thresholds"]["structure"] = 7
    answer = server.post("/carnator/store/profiles", json=profile)
    assert answer.status_code == 400 and "'structure' must be a number between 0.0 and 1.0" in answer.json()["error"]
    in_force = {**profile, "in_force": True, "forced": True, "thresholds": {**profile["thresholds"], "structure": -0.3}}
    answer = server.post("/carnator/store/profiles", json=in_force)
    assert answer.status_code == 400 and "'structure' must be a number between 0.0 and 1.0" in answer.json()["error"]
    no_reason = {k: v for k, v in in_force.items() if k != "reason"} | {"thresholds": profile["thresholds"] | {
        "structure": 0.9}}
    answer = server.post("/carnator/store/profiles", json=no_reason)
    assert answer.status_code == 400 and "'reason' must be a non-empty string" in answer.json()["error"]
    answer = server.post("/carnator/store/profiles", data=b"{" + b" " * 70_000 + b"}")
    assert answer.status_code == 413
    assert server.post("/carnator/store/profiles", data=b"NaN").status_code == 400


@pytest.mark.parametrize(("change", "message"), [
    ("two samplers", "several samplers that do not run one after another (9 (KSampler), 99 (KSampler))"),
    ("no sampler", "no sampler node"),
])
def test_a_workflow_without_exactly_one_sampler_is_a_clear_error_naming_the_nodes(server, tmp_path, change, message):
    graph = _graph()
    if change == "two samplers":
        graph["99"] = copy.deepcopy(graph["9"])
    else:
        del graph["9"]
    workflow, pairs = _files(tmp_path, graph, pairs=1)
    run = _calibrate(server.url, workflow, pairs, tmp_path / "out")
    output, _ = run.communicate(timeout=300)
    assert run.returncode == 2 and message in output, output


def test_the_explicit_control_workflow_calibrates_through_its_lookup_node_without_sparse_attention(server, tmp_path):
    """Lookup -> sparse attention -> reuse sampler: the lookup reads the pair's store, sparse attention is bypassed."""
    graph = api_workflow("carnator_explicit_control")
    for node in graph.values():
        if node["class_type"] == "BasicScheduler":
            node["inputs"]["steps"] = 8
        if node["class_type"] == "EmptyHunyuanLatentVideo":
            node["inputs"].update(width=128, height=128)
    workflow, pairs = _files(tmp_path, graph, pairs=1)
    run = _calibrate(server.url, workflow, pairs, tmp_path / "out", "--no-install", "--no-fewer-steps")
    output, _ = run.communicate(timeout=600)
    assert run.returncode == 0, output
    assert output.splitlines()[-1] == ("plain at fewer steps: not run (turned off), so no mode is weighed against "
                                       "lowering the steps")
    plain_runs = (tmp_path / "out" / "plain_runs.jsonl").read_text().splitlines()
    assert [json.loads(line)["steps"] for line in plain_runs] == [8]  # the full plain run alone
    rows = [json.loads(line) for line in (tmp_path / "out" / "resumes.jsonl").read_text().splitlines()]
    assert [row["skipped_steps"] for row in rows] == [2, 4]  # forced at 0.2 and 0.5 of 8 steps
    assert all(row["psnr_db"] > 30 for row in rows)  # a rewording, resumed from its own earlier prompt


def test_a_pair_that_fails_to_sample_is_skipped_and_reported_and_the_rest_calibrates(server, tmp_path):
    """The second pair's donor run is interrupted through ComfyUI's /interrupt while it samples (40 steps)."""
    workflow, pairs = _files(tmp_path, _graph(steps=40), pairs=2)
    second = pairs.read_text().splitlines()[1].split("\t")[0]
    out = tmp_path / "out"
    run = _calibrate(server.url, workflow, pairs, out, "--no-install", "--no-fewer-steps")
    interrupted = False
    deadline = time.monotonic() + 300
    while run.poll() is None and not interrupted and time.monotonic() < deadline:
        for item in server.get("/queue").json()["queue_running"]:
            if any(node["inputs"].get("value") == second for node in item[2].values()):
                server.post("/interrupt", json={"prompt_id": item[1]})
                interrupted = True
        time.sleep(0.02)
    output, _ = run.communicate(timeout=600)
    assert interrupted and run.returncode == 0, output
    assert "pair 2: skipped, a prompt failed to sample" in output
    skipped = json.loads((out / "skipped.json").read_text())
    assert list(skipped) == ["1"] and "interrupted" in skipped["1"].lower() and second in skipped["1"]
    rows = [json.loads(line) for line in (out / "resumes.jsonl").read_text().splitlines()]
    assert {row["pair"] for row in rows} == {0}


def test_the_wan21_template_calibrates_with_its_guidance_on_latents(server, tiny_models, tmp_path):
    """The official Wan 2.1 template's settings (uni_pc, cfg 6, shift 8) on the tiny Wan model, which has no VAE
    decode at test size: clips are compared on latents, and the guidance signal is measured and fitted."""
    graph = on_tiny_models(api_workflow("carnator_wan21_t2v"), "wan", tiny_models["wan"].name, steps=8)
    workflow, pairs = _files(tmp_path, graph, pairs=3)
    # the positive prompt's node ("6" in the template) encodes with the test harness's text node: named, as a user
    # names a text node the tool cannot find by itself
    run = _calibrate(server.url, workflow, pairs, tmp_path / "out", "--no-install", "--text-node", "6")
    output, _ = run.communicate(timeout=600)
    assert run.returncode == 0, output
    assert "(latents)" in output
    rows = [json.loads(line) for line in (tmp_path / "out" / "resumes.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(row["guidance"] is not None and row["screen_guidance"] is not None for row in rows)
    assert all(row["oracle_kept"] is None for row in rows)  # no demo world to judge a tiny model's clips
    profile = Profile.from_json((tmp_path / "out" / "profile.json").read_text())
    assert profile.cfg == 6.0 and profile.oracle is None
    assert "plain-4" in profile.fewer_steps and set(profile.equal_quality) == {"balanced", "fast"}
    assert all(run.steps >= 2 for run in profile.fewer_steps.values())  # never below two steps
    assert output.splitlines()[-3:] == profile.verdict_lines()


def test_the_wan22_14b_template_calibrates_its_first_expert_and_its_runs_are_judged_by_the_profile(
        server, tiny_models, tmp_path):
    """The two-expert template (high-noise expert steps 0-4, low-noise expert 4-8 here) calibrates its first stage:
    the low-noise expert samples plain in every run, the clip compared is the second expert's, and the profile (the
    high-noise expert's model and schedule) judges that stage of the next run, thresholds left at auto."""
    graph = on_tiny_models(api_workflow("carnator_wan22_14b_t2v"), "wan", tiny_models["wan"].name,
                           low_noise_unet=LOW_NOISE_UNET)
    for node in graph.values():
        if node["class_type"] == "KSamplerAdvanced":
            first = node["inputs"]["add_noise"] == "enable"
            node["inputs"].update(steps=8, start_at_step=0 if first else 4, end_at_step=4 if first else 10000)
    workflow, pairs = _files(tmp_path, graph, pairs=2)
    run = _calibrate(server.url, workflow, pairs, tmp_path / "out", "--text-node", "89", "--depths", "0.5,0.8",
                     "--force")  # two pairs hold none back: forced to see it judge
    output, _ = run.communicate(timeout=600)
    assert run.returncode == 0, output
    rows = [json.loads(line) for line in (tmp_path / "out" / "resumes.jsonl").read_text().splitlines()]
    assert sorted((row["pair"], row["skipped_steps"], row["total_steps"]) for row in rows) == [
        (0, 2, 4), (0, 3, 4), (1, 2, 4), (1, 3, 4)], rows  # the first expert's 4 steps, resumed at 2 and 3
    profile = Profile.from_json((tmp_path / "out" / "profile.json").read_text())
    # plain at 4 and 2 of the 8 steps, the experts' hand-over scaled with them; no pair held back: both weighed
    plain_runs = [json.loads(line) for line in (tmp_path / "out" / "plain_runs.jsonl").read_text().splitlines()]
    assert 4 in _bisected(plain_runs, range(2), steps=8)
    assert all(row["model_calls"] == row["steps"] for row in plain_runs), plain_runs
    assert all(not weighed.held_back and weighed.pairs == 2 for weighed in profile.equal_quality.values())
    assert output.splitlines()[-3:] == profile.verdict_lines()

    statuses = server.client.run(Workflow(graph, "89").for_prompt(EARLIER, "fixed", None)).statuses
    judged = {report["node"]: report["judged_by"] for report in statuses}
    assert judged["81"] == profile.describe() and judged["78"] != profile.describe(), judged


def test_the_ltx2_template_calibrates_its_first_stage_on_the_weaker_of_video_and_audio(server, tmp_path):
    """The LTX-2 twin (tiny model) calibrates its first stage, whose packed latent holds video and audio: every
    resume's structure signal is the lower of the two parts' agreements, the one the bar compares."""
    if host_lacks(LTXAV):
        pytest.skip(host_lacks(LTXAV))
    graph = on_tiny_models(api_workflow("carnator_ltx2_t2v"), "ltxav", LTXAV.filename)
    (text_node,) = [node_id for node_id, node in graph.items() if "cheerful" in node["inputs"].get("text", "")]
    workflow, pairs = _files(tmp_path, graph, pairs=2)
    run = _calibrate(server.url, workflow, pairs, tmp_path / "out", "--no-install", "--text-node", text_node,
                     "--depths", "0.5")
    output, _ = run.communicate(timeout=600)
    assert run.returncode == 0, output
    rows = [json.loads(line) for line in (tmp_path / "out" / "resumes.jsonl").read_text().splitlines()]
    assert len(rows) == 2, rows
    for row in rows:
        video, audio = row["part_structures"]
        assert row["structure"] == min(video, audio), row
    profile = Profile.from_json((tmp_path / "out" / "profile.json").read_text())
    assert profile.fit_pairs >= 1 and set(profile.equal_quality) == {"balanced", "fast"}, output


def test_pairs_from_the_store_s_history_are_the_user_s_successive_prompts(server, tmp_path):
    edited = "a blue circle moving right on a black background"
    for prompt, top_k in ((EARLIER, 7), (REWORDED, 7), (edited, 7)):  # one user's loop, same model, seed, schedule
        _report(server, prompt, record=True, top_k=top_k)
    workflow, _ = _files(tmp_path, _graph())
    command = [sys.executable, "-m", "carnator_core.calibrate", "--server", server.url, "--workflow", str(workflow),
               "--from-store", "--out", str(tmp_path / "out"), "--depths", "0.5", "--no-install", "--max-pairs", "3"]
    run = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "pairs from the store's history of model" in run.stdout
    rows = [json.loads(line) for line in (tmp_path / "out" / "resumes.jsonl").read_text().splitlines()]
    assert {(row["earlier"], row["new"]) for row in rows} >= {(EARLIER, REWORDED), (REWORDED, edited)}
    # the same history, in the user's order, is the stream the verdict is weighed on
    stream = [json.loads(line) for line in (tmp_path / "out" / "stream" / "stream_runs.jsonl").read_text().splitlines()]
    prompts = [row["prompt"] for row in sorted(stream, key=lambda row: row["index"]) if row["run"] == "plain"]
    assert prompts[-3:] == [EARLIER, REWORDED, edited] and len(prompts) <= 4
    profile = Profile.from_json((tmp_path / "out" / "profile.json").read_text())
    assert {v.weighed_on for v in profile.equal_quality.values()} == {"stream"} and profile.fit_pairs >= 1
    # the stream weighed the modes, so the pairs only fit thresholds: no pair ran plain at fewer steps or at the knee
    assert "the pairs fit thresholds only" in run.stdout
    pair_plains = [json.loads(line) for line in (tmp_path / "out" / "plain_runs.jsonl").read_text().splitlines()]
    assert {row["steps"] for row in pair_plains} == {STEPS} and not (tmp_path / "out" / "knee_runs.jsonl").exists()


def test_an_output_directory_of_another_workflow_is_refused_not_mixed_in(server, tmp_path):
    workflow, pairs = _files(tmp_path, _graph(), pairs=1)
    out = tmp_path / "out"
    first = _calibrate(server.url, workflow, pairs, out, "--no-install", "--no-fewer-steps")
    output, _ = first.communicate(timeout=600)
    assert first.returncode == 0, output
    (tmp_path / "other").mkdir()
    other, _ = _files(tmp_path / "other", _graph(steps=12), pairs=1)
    again = _calibrate(server.url, other, pairs, out, "--no-install", "--no-fewer-steps")
    output, _ = again.communicate(timeout=300)
    assert again.returncode == 2 and "holds a calibration of another workflow" in output, output
    assert len((out / "resumes.jsonl").read_text().splitlines()) == 2


STREAM = [EARLIER, REWORDED, "a blue circle moving right on a black background",
          "a blue circle moving left on a white background"]


def _stream_files(tmp_path: Path, prompts: list[str], graph: dict | None = None) -> tuple[Path, Path]:
    """The workflow (the demo twin at 8 steps, reading and filing in a store of its own) and the prompts file."""
    if graph is None:
        graph = _graph()
        graph["20"] = {"class_type": "CarnatorStore", "inputs": {"path": f"stream-{tmp_path.name}",
                                                                  "size_limit_gb": 1.0}}
        graph["8"]["inputs"]["store"] = ["20", 0]
    workflow = tmp_path / "workflow.json"
    workflow.write_text(json.dumps(graph))
    prompts_file = tmp_path / "stream.txt"
    prompts_file.write_text("\n".join(prompts) + "\n")
    return workflow, prompts_file


def _calibrate_stream(url: str, workflow: Path, prompts: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "carnator_core.calibrate", "--server", url, "--workflow", str(workflow),
               "--prompts", str(prompts), "--out", str(out), *extra]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_a_stream_calibration_runs_each_mode_as_the_engine_does_and_the_workload_lies_in_its_interval(server,
                                                                                                     tmp_path):
    workflow, prompts = _stream_files(tmp_path, STREAM[:3])
    out = tmp_path / "out"
    run = _calibrate_stream(server.url, workflow, prompts, out)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    profile = Profile.from_json((out / "profile.json").read_text())
    lines = output.splitlines()
    assert lines[-3:] == profile.verdict_lines() and not profile.in_force, output
    assert "a stream calibration fits no thresholds" in profile.reason and "(at most 5 plain runs per prompt)" in output
    assert profile.recommended is not None and lines[-1] == f"Recommended: {profile.recommended.words()}."
    rows = [json.loads(line) for line in (out / "stream" / "stream_runs.jsonl").read_text().splitlines()]
    runs = {(row["index"], row["run"]) for row in rows}
    assert len(runs) == len(rows)  # every run once
    lowered = sorted({row["run"] for row in rows if row["run"].startswith("plain-")})
    assert 1 <= len(lowered) <= MAX_LOWERED_COUNTS and all((i, name) in runs for i in range(3) for name in (
        "plain", "balanced", "fast", *lowered))
    knee = sorted({row["run"] for row in rows if "@" in row["run"]})  # both modes again at the knee, on every prompt
    assert len(knee) in (0, 2) and all((i, name) in runs for i in range(3) for name in knee), knee
    first = [row for row in rows if row["index"] == 0 and row["run"] in ("balanced", "fast")]
    assert all(row["skipped_steps"] == 0 for row in first)  # nothing stored before the first prompt
    reworded = {row["run"]: row for row in rows if row["index"] == 1}  # the rewording resumes in each mode
    assert reworded["fast"]["skipped_steps"] >= reworded["balanced"]["skipped_steps"] > 0
    assert reworded["fast"]["model_calls"] < reworded["plain"]["model_calls"] == STEPS
    for mode, weighed in profile.equal_quality.items():
        assert (weighed.weighed_on, weighed.pairs, weighed.steps) == ("stream", 3, STEPS) and weighed.resumed >= 1
        mine = [row["model_calls"] for row in rows if row["run"] == mode]
        assert weighed.model_calls == pytest.approx(sum(mine) / 3, abs=0.01)  # the engine's own calls, as counted
        low, high = weighed.interval
        assert low <= weighed.calls <= high and ("not settled" in weighed.words()) == (low <= 1.0 <= high)
        against = STEPS if weighed.against == "plain" else profile.fewer_steps[weighed.against].model_calls
        assert weighed.calls == pytest.approx(against / weighed.model_calls, abs=2e-3)
    assert (out / "plot-stream.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    location = output.split("in the store at ")[1].split(" (")[0]
    filed = server.get("/carnator/store/profiles", params={"store": location}).json()["profiles"]
    assert [p["verdict"] for p in filed] == [profile.verdict_lines()]  # the store panel says the same

    # the workload benchmark on the same stream and settings: its ratio by the same yardstick lies in the interval
    bench = subprocess.run([sys.executable, "-m", "carnator_core.bench", "workload", "--prompts", str(prompts),
                            "--steps", str(STEPS), "--configs", "balanced,fast", "--json", "--out",
                            str(tmp_path / "bench")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert bench.returncode == 0, bench.stderr
    for config in json.loads(bench.stdout)["configs"]:
        if config["name"] in profile.equal_quality:
            low, high = profile.equal_quality[config["name"]].interval
            assert low - 1e-3 <= config["equal_quality_speedup"]["calls"] <= high + 1e-3, (config, profile)

    # run again: nothing is sampled; a profile already filed for the model keeps its thresholds, takes the verdict
    fitted = {**profile.as_dict(), "name": "fitted", "in_force": True, "reason": "in force: held back",
              "thresholds": {**profile.thresholds, "structure": 0.9},
              "held_back": {"accepted": 4, "good": 4, "precision": 1.0, "recall": 1.0}}
    assert server.post("/carnator/store/profiles", params={"store": location}, json=fitted).status_code == 200
    again = _calibrate_stream(server.url, workflow, prompts, out)
    assert again.returncode == 0 and "[prompt" not in again.stdout, again.stdout + again.stderr
    [merged] = server.get("/carnator/store/profiles", params={"store": location}).json()["profiles"]
    assert (merged["name"], merged["in_force"], merged["thresholds"]["structure"]) == ("fitted", True, 0.9)
    assert merged["verdict"] == profile.verdict_lines()


@pytest.mark.parametrize(("prompts", "steps_linked", "message"), [
    ([EARLIER], False, "a stream of 1 prompt has no earlier prompt to resume from: no verdict"),
    (STREAM[:2], True, "cannot be lowered"),
])
def test_a_stream_that_cannot_give_a_verdict_says_why_in_one_line_and_claims_none(server, tmp_path, prompts,
                                                                                   steps_linked, message):
    graph = _graph()
    if steps_linked:  # the steps come from another node: calibration cannot lower them
        graph["30"] = {"class_type": "PrimitiveInt", "inputs": {"value": STEPS}}
        graph["9"]["inputs"]["steps"] = ["30", 0]
    workflow, prompts_file = _stream_files(tmp_path, prompts, graph)
    run = _calibrate_stream(server.url, workflow, prompts_file, tmp_path / "out")
    assert run.returncode == 2 and message in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert not (tmp_path / "out" / "profile.json").exists()


def test_a_stream_with_nothing_resumable_claims_no_verdict_and_samples_no_fewer_steps(server, tmp_path):
    workflow, prompts = _stream_files(tmp_path, [EARLIER, "a green triangle moving up on a white background"])
    run = _calibrate_stream(server.url, workflow, prompts, tmp_path / "out", "--no-install")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "no mode resumed any of the 2 prompts: nothing in this stream is resumable here" in run.stdout
    profile = Profile.from_json((tmp_path / "out" / "profile.json").read_text())
    assert profile.fewer_steps == {} and all(v.interval is None and v.resumed == 0
                                             for v in profile.equal_quality.values())
    assert all("resumed no request" in line and "no verdict" in line for line in run.stdout.splitlines()[-2:])


def test_an_interrupted_stream_calibration_resumes_where_it_stopped(server, tmp_path):
    graph = json.loads(_stream_files(tmp_path, STREAM[:3])[0].read_text())
    plan = CalibrationPlan(workflow=CalibrationWorkflow.prepare(Workflow(graph), server.client.object_info()),
                           pairs=[], prompts=STREAM[:3], out=tmp_path / "out", name="stream", install=False)
    asked = itertools.count()
    with pytest.raises(CalibrationInterrupted):
        calibrate(server.client, plan, echo=lambda line: None, should_stop=lambda: next(asked) >= 4)
    rows = tmp_path / "out" / "stream" / "stream_runs.jsonl"
    assert len(rows.read_text().splitlines()) == 4 and not (tmp_path / "out" / "profile.json").exists()
    said: list[str] = []
    calibrated = calibrate(server.client, plan, echo=said.append)
    kept = [json.loads(line) for line in rows.read_text().splitlines()]
    assert len({(row["index"], row["run"]) for row in kept}) == len(kept)  # nothing sampled twice
    assert sum(line.startswith("[prompt") for line in said) == len(kept) - 4  # only what was left
    assert set(calibrated.profile.equal_quality) == {"balanced", "fast"}


def _calibration_state(server, until, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = server.get("/carnator/calibration").json()
        if until(state):
            return state
        time.sleep(0.1)
    raise AssertionError(f"the calibration did not get there: {state}")


def test_the_calibrate_workflow_calibrates_from_the_graph_editor_beside_the_queue(server):
    """The shipped `carnator_calibrate_demo` workflow (8 steps, its first two pairs) queued as the graph editor
    queues it: the Calibrate node starts the calibration and its runs queue behind; queued again meanwhile it says
    so; stopped from the panel's route it keeps what it did, and queued again it resumes and files the profile."""
    graph = api_workflow("carnator_calibrate_demo")
    (node_id,) = [n for n, node in graph.items() if node["class_type"] == "CarnatorCalibrate"]
    calibrate = graph[node_id]["inputs"]
    lines = [line for line in calibrate["pairs"].splitlines() if not line.startswith("#")]
    calibrate.update(pairs="\n".join(lines[:2]), name="graph editor")
    graph["9"]["inputs"]["steps"] = STEPS

    def status(history: dict) -> str:
        return history["outputs"][node_id]["text"][0]

    assert "Calibrating 'graph editor' on 2 pairs" in status(server.client.run(graph).history)
    busy = status(server.client.run(graph).history)
    assert busy.startswith("Not started: calibration 'graph editor' is running"), busy
    _calibration_state(server, lambda state: state.get("runs_done", 0) >= 3)
    assert server.post("/carnator/calibration/stop").json()["phase"] in ("stopping", "stopped")
    stopped = _calibration_state(server, lambda state: state["phase"] == "stopped")
    out = Path(stopped["out"])
    done = len((out / "resumes.jsonl").read_text().splitlines())
    plains_left = sum(not (out / "pairs" / f"{pair:03d}-plain.safetensors").exists() for pair in (0, 1))
    assert 1 <= done < 10 and "queue the Calibrate node again to resume" in stopped["line"]

    server.client.run(graph)
    finished = _calibration_state(server, lambda state: state["phase"] in ("done", "failed"))
    assert finished["phase"] == "done", finished
    rows = [json.loads(line) for line in (out / "resumes.jsonl").read_text().splitlines()]
    assert sorted((row["pair"], row["requested_depth"]) for row in rows) == sorted(
        (pair, depth) for pair in (0, 1) for depth in (0.2, 0.35, 0.5, 0.65, 0.8))
    # the demo world's oracle, which the pack registers at load, judged every resume in the server's own process
    assert all(row["oracle_kept"] is not None for row in rows)
    # only what was left ran again: resumes, the donor and plain runs, then the bisected plain runs and the modes at
    # the knee (the total counts the most these may take)
    plain_runs = [json.loads(line) for line in (out / "plain_runs.jsonl").read_text().splitlines()]
    knee_runs = (out / "knee_runs.jsonl").read_text().splitlines() if (out / "knee_runs.jsonl").exists() else []
    curve_runs = len(plain_runs) - 2 + len(knee_runs)
    assert finished["runs_done"] == 10 - done + 2 * plains_left + curve_runs <= finished["runs_total"], finished
    filed = [p for p in server.get("/carnator/store/profiles").json()["profiles"] if p["name"] == "graph editor"]
    assert len(filed) == 1 and finished["profile"] == filed[0]["description"]
    assert any(line.startswith("filed as profile 'graph editor'") for line in finished["summary"])
    assert finished["summary"][-3:] == filed[0]["verdict"] and len(filed[0]["verdict"]) == 3  # the panel's too


def test_an_interrupted_calibration_resumes_where_it_stopped(servers, server, tmp_path):
    """Without plain at fewer steps: the graph editor's calibration above samples the bisection and the knee after its
    resume."""
    workflow, pairs = _files(tmp_path, _graph(), pairs=2)
    out = tmp_path / "out"
    run = _calibrate(server.url, workflow, pairs, out, "--no-fewer-steps")
    rows = out / "resumes.jsonl"

    def stop_after_first_resume() -> None:
        while not (rows.exists() and rows.read_text().strip()):
            time.sleep(0.05)
        server.stop()

    threading.Thread(target=stop_after_first_resume, daemon=True).start()
    output, _ = run.communicate(timeout=600)
    assert run.returncode == 1 and "run the same command to resume" in output, output
    done = len(rows.read_text().splitlines())
    assert 1 <= done < 4
    again = servers()
    run = _calibrate(again.url, workflow, pairs, out, "--no-fewer-steps")
    output, _ = run.communicate(timeout=600)
    assert run.returncode == 0, output
    assert len(rows.read_text().splitlines()) == 4
    assert output.count("forced") == 4 - done  # only what was left was sampled again
    plain_runs = [json.loads(line) for line in (out / "plain_runs.jsonl").read_text().splitlines()]
    assert sorted((row["pair"], row["steps"]) for row in plain_runs) == [(0, STEPS), (1, STEPS)]  # each once

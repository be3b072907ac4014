"""A run that starts from an input reuses the same stage of an earlier run from a close input, in real ComfyUI.

The graph is the Wan 2.2 14B template's shape with fresh noise added before the second expert (its KSamplerAdvanced
with `add_noise` on): the second stage starts from the first stage's output mixed with new noise, as a refinement
pass, image-to-video or video-to-video does. Only the second expert has a Carnator node. A request whose first stage
ran at another guidance scale hands the second stage a slightly different input (tiny random-weight models cannot
tell a rewording from an edit, so the input is changed the way an upstream tweak changes it). Its second stage is
screened on its own first evaluation and resumed from the earlier second stage, corrected by what the two first states
and predictions differ by; an input edited far, or a donor the model rejects, samples plain, bit-identical to the
graph without Carnator.
"""

from __future__ import annotations

import copy
import itertools
import json
import sys

import pytest
import torch
from support.latent_files import write_retouched_videos
from support.reuse_graphs import with_expert_reuse, with_reuse
from support.t2v_graphs import HIGH_NOISE, LATENT, LOW_NOISE, SAMPLER, wan22_14b_t2v, wan_i2v, wan_t2v
from support.tiny_models import WAN21_VAE, write_tiny_model

from carnator_core.reuse.input_start import GUIDE_NOTE, INPUT_NOTE, MAX_INPUT_DISTANCE
from carnator_core.reuse.recording import entry_writer

_stores = itertools.count()
PROMPT = "a red ball rolls left"


@pytest.fixture
def store_path() -> str:
    return f"stores/input-start-{next(_stores)}"


def _graph(tiny_models, wan_low_noise, first_stage_cfg: float = 1.0) -> dict:
    graph = wan22_14b_t2v(tiny_models["wan"].name, wan_low_noise, steps=8, boundary=4, text=PROMPT, seed=5)
    graph[LOW_NOISE]["inputs"]["add_noise"] = "enable"  # the second stage starts from its input and fresh noise
    graph[HIGH_NOISE]["inputs"]["cfg"] = first_stage_cfg
    return graph


def _with_reuse(graph: dict, store_path: str, **options) -> dict:
    return with_expert_reuse(graph, store_path, prompt=PROMPT, experts=(LOW_NOISE,), sparse_attention="off", **options)


def _run(comfy, graph: dict, output: str = LOW_NOISE) -> tuple[torch.Tensor, int, dict | None]:
    """The request's latent (the `output` node's), the second expert's forwards and its Carnator report (None without
    Carnator)."""
    harness = next(m for k, m in sys.modules.items() if k.endswith("carnator_harness"))
    comfy.unload_models()
    before = harness.model_calls.get("low_noise", 0)
    run = comfy.run_prompt(comfy.complete(graph))
    entry_writer().flush()
    calls = harness.model_calls.get("low_noise", 0) - before
    reports = json.loads(run.output("carnator_report", 1)) if "carnator_report" in graph else [None]
    return run.output(output)["samples"], calls, reports[-1]


def test_a_request_with_a_close_input_resumes_the_stage_that_starts_from_it(comfy, tiny_models, wan_low_noise,
                                                                         store_path):
    plain_first, plain_calls, _ = _run(comfy, _graph(tiny_models, wan_low_noise))
    donor, calls, report = _run(comfy, _with_reuse(_graph(tiny_models, wan_low_noise), store_path))
    assert torch.equal(donor, plain_first) and calls == plain_calls == 4  # a miss is plain, bit for bit
    assert not report["hit"] and INPUT_NOTE in report["notes"] and report["stage"] == {}, json.dumps(report)

    tweaked = _graph(tiny_models, wan_low_noise, first_stage_cfg=1.5)
    plain, _, _ = _run(comfy, tweaked)
    output, calls, report = _run(comfy, _with_reuse(tweaked, store_path))
    assert report["hit"] and report["skipped_steps"] == 2, json.dumps(report)  # balanced: half of the stage
    # the screen passed, though not by the margin that sends a donor deep first: its anchor (step 1) is asked first
    screen, anchor, verified = report["probes"]
    assert screen["step"] == 0 and screen["passed"] and anchor["step"] == 1 and anchor["passed"]
    assert verified["step"] == 2 and verified["corrected"] and verified["passed"]
    assert calls == 1 + 1 + 2  # the screen (the request's step 0), the anchor, the probe serves step 2, step 3
    assert output.shape == plain.shape and float((output - plain).norm() / plain.norm()) < 0.05


def test_an_input_edited_far_or_a_rejected_donor_samples_the_stage_plain(comfy, tiny_models, wan_low_noise,
                                                                         store_path):
    _run(comfy, _with_reuse(_graph(tiny_models, wan_low_noise), store_path))
    edited = _graph(tiny_models, wan_low_noise)  # the first stage's output doubled before the second stage
    edited["edit"] = {"class_type": "LatentMultiply", "inputs": {"samples": [HIGH_NOISE, 0], "multiplier": 2.0}}
    edited[LOW_NOISE]["inputs"]["latent_image"] = ["edit", 0]
    plain, plain_calls, _ = _run(comfy, edited)
    output, calls, report = _run(comfy, _with_reuse(edited, store_path))
    assert torch.equal(output, plain) and calls == plain_calls, json.dumps(report)
    assert report["skipped_donors"] == {f"input farther than {MAX_INPUT_DISTANCE} from the donor's": 1}

    tweaked = _graph(tiny_models, wan_low_noise, first_stage_cfg=1.5)
    plain, plain_calls, _ = _run(comfy, tweaked)
    strict = copy.deepcopy(_with_reuse(tweaked, store_path, structure_threshold=1.0))
    output, calls, report = _run(comfy, strict)
    assert torch.equal(output, plain) and calls == plain_calls, json.dumps(report)
    assert [(p["step"], p["passed"]) for p in report["probes"]] == [(0, False)] and report["reason"] == \
        "probe rejected"


@pytest.mark.parametrize("sampler_name", ["euler", "uni_pc"])
def test_video_to_video_resumes_from_a_run_on_a_close_video_and_refuses_another_video(comfy, tiny_models,
                                                                                      store_path, sampler_name):
    """Video-to-video: a KSampler at denoise 0.6 on a loaded video latent, one Carnator node. A slightly retouched
    video resumes from the run on the original, close to its own plain run; another video is filtered by its distance
    and samples plain, bit for bit. Under euler and under uni_pc, which replays the donor's predictions from its own
    first state to the resume step and resumes with its multistep history (distance printed)."""
    write_retouched_videos(comfy.base_dir / "input", "vid2vid", (1, 16, 2, 8, 8))  # 64 x 64 x 5 frames, Wan 2.1

    def graph(video: str) -> dict:
        graph = wan_t2v(tiny_models["wan"].name, text=PROMPT, steps=8, seed=5, sampler_name=sampler_name)
        graph[LATENT] = {"class_type": "LoadLatent", "inputs": {"latent": f"vid2vid_{video}.latent"}}
        graph[SAMPLER]["inputs"]["denoise"] = 0.6
        return graph

    def run(graph: dict) -> tuple[torch.Tensor, dict | None]:
        output, _, report = _run(comfy, graph, output=SAMPLER)
        return output, report

    donor, report = run(with_reuse(graph("original"), store_path, prompt=PROMPT, sparse_attention="off"))
    assert not report["hit"] and INPUT_NOTE in report["notes"], json.dumps(report)
    assert torch.equal(donor, run(graph("original"))[0])  # a miss is plain

    plain, _ = run(graph("retouched"))
    output, report = run(with_reuse(graph("retouched"), store_path, prompt=PROMPT, sparse_attention="off"))
    assert report["hit"] and report["skipped_steps"] == 4 and report["model_calls"] == 5, json.dumps(report)
    distance = float((output - plain).norm() / plain.norm())
    print(f"\nvid2vid, {sampler_name}: retouched video resumed at step 4 of 8: {distance:.5f} from its plain run")
    assert output.shape == plain.shape and distance < 2e-3  # fp16 checkpoints

    plain, _ = run(graph("other"))
    output, report = run(with_reuse(graph("other"), store_path, prompt=PROMPT, sparse_attention="off"))
    assert torch.equal(output, plain) and report["model_calls"] == 8, json.dumps(report)
    assert report["skipped_donors"] == {f"input farther than {MAX_INPUT_DISTANCE} from the donor's": 2}  # both runs


@pytest.fixture(scope="module")
def wan_i2v_files(comfy) -> tuple[str, str]:
    """A tiny Wan image-to-video model and the Wan 2.1 VAE it encodes start images with, written once."""
    model = write_tiny_model("wan_i2v", comfy.base_dir / "models" / "diffusion_models")
    vae = write_tiny_model("wan21_vae", comfy.base_dir / "models" / "vae", filename=WAN21_VAE)
    return model.name, vae.name


def test_image_to_video_resumes_from_a_run_on_a_close_start_image_and_refuses_another_image(comfy, wan_i2v_files,
                                                                                          store_path):
    """Image-to-video (WanImageToVideo: the start image encoded into the conditioning, the latent empty), one Carnator
    node: a slightly retouched start image resumes from the run on the original, close to its own plain run; another
    image is filtered by its distance and samples plain, bit for bit."""
    model, vae = wan_i2v_files

    def graph(color: int) -> dict:
        return wan_i2v(model, vae, start_color=color, text=PROMPT, steps=8, seed=5, sampler_name="euler")

    def run(graph: dict) -> tuple[torch.Tensor, dict | None]:
        output, _, report = _run(comfy, graph, output=SAMPLER)
        return output, report

    original, retouched, other = 0x808080, 0x828080, 0x2050C0
    donor, report = run(with_reuse(graph(original), store_path, prompt=PROMPT, sparse_attention="off"))
    assert not report["hit"] and GUIDE_NOTE in report["notes"], json.dumps(report)
    assert torch.equal(donor, run(graph(original))[0])  # a miss is plain

    plain, _ = run(graph(retouched))
    output, report = run(with_reuse(graph(retouched), store_path, prompt=PROMPT, sparse_attention="off"))
    assert report["hit"] and report["skipped_steps"] == 4, json.dumps(report)
    distance = float((output - plain).norm() / plain.norm())
    print(f"\ni2v: retouched start image resumed at step 4 of 8 in {report['model_calls']} model calls: "
          f"{distance:.5f} from its plain run")
    assert output.shape == plain.shape and distance < 0.05

    plain, _ = run(graph(other))
    output, report = run(with_reuse(graph(other), store_path, prompt=PROMPT, sparse_attention="off"))
    assert torch.equal(output, plain) and report["model_calls"] == 8, json.dumps(report)
    assert report["skipped_donors"] == {f"conditioning image farther than {MAX_INPUT_DISTANCE} from the donor's": 2}

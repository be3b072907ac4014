"""Latent reuse under the samplers of the official templates, on the demo model inside real ComfyUI (in-process).

The demo model is trained, so its probes carry meaning: a reworded prompt with the same seed must resume, a
changed attribute must not. Multistep samplers (uni_pc, dpmpp_2m, deis, res_multistep) keep a history of earlier
evaluations, which a resumed run rebuilds by replaying the donor's recorded predictions to the resume step, and uni_pc
keeps its state scaled by 1/sqrt(1 + sigma^2); a resume from the request's own checkpoint must land next to the
uninterrupted run. Stochastic samplers (ancestral ones
drawing per step, SDE ones from a Brownian tree) are handed the uninterrupted run's own noise from the resume on, so
they must land next to it too.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from support.demo_runs import CHANGED, DEMO_WEIGHTS, PROMPT, REWORDED, sample_demo

from carnator_core.demo import world
from carnator_core.demo.graphs import MODEL_CHAIN, base_graph, with_report, with_reuse
from carnator_core.demo.oracle import score
from carnator_core.judging.quality import mse, psnr_from_mse, ssim
from carnator_core.reuse.history_replay import REPLAY_NOTE

STEPS = 12
DETERMINISTIC = ("euler", "uni_pc", "uni_pc_bh2", "dpmpp_2m", "deis", "res_multistep")
STOCHASTIC = ("euler_ancestral", "dpm_2_ancestral", "dpmpp_2s_ancestral", "dpmpp_2m_sde")
# Largest relative distance (‖resumed − uninterrupted‖ / ‖uninterrupted‖) of a self-resume half-way: fp16
# checkpoints (and, for multistep samplers, the fp16 predictions they replay to the resume step).
SELF_RESUME_TOLERANCE = 0.02
MULTISTEP = ("uni_pc", "uni_pc_bh2", "dpmpp_2m", "deis", "res_multistep")

_stores = itertools.count()


def _graph(prompt: str, sampler_name: str, *, cfg: float = 4.0, shift: float = 3.0, store: str | None = None) -> dict:
    graph = base_graph(DEMO_WEIGHTS, prompt, seed=42, steps=STEPS, cfg=cfg, sampler_name=sampler_name)
    graph[MODEL_CHAIN]["inputs"]["shift"] = shift
    if store is None:
        return with_report(graph)  # an output node, so that ComfyUI runs the graph
    # a self-resume is what these tests measure, not an exact repeat; otherwise the node's defaults
    return with_reuse(graph, store, prompt, sparse_attention="off", exact_repeats=False)




def _frames(latent: torch.Tensor) -> torch.Tensor:
    """The demo clip as RGB frames in [0, 1]."""
    return world.decode(world.from_raw(latent[0].float()))


@pytest.mark.parametrize("sampler_name", DETERMINISTIC + STOCHASTIC)
def test_reworded_prompt_resumes_and_changed_attribute_does_not(comfy, sampler_name):
    store = f"stores/samplers-{next(_stores)}"
    donor, _ = sample_demo(comfy, _graph(PROMPT, sampler_name, store=store))
    _, reworded = sample_demo(comfy, _graph(REWORDED, sampler_name, store=store))
    assert reworded["skipped_steps"] == STEPS // 2, json.dumps(reworded["probes"])
    _, changed = sample_demo(comfy, _graph(CHANGED, sampler_name, store=store))
    assert changed["skipped_steps"] == 0 and changed["reason"] == "probe rejected", json.dumps(changed["probes"])

    resumed, repeat = sample_demo(comfy, _graph(PROMPT, sampler_name, store=store))
    assert repeat["skipped_steps"] == STEPS // 2 and repeat["donor_prompt"] == PROMPT
    assert (REPLAY_NOTE in repeat["notes"]) == (sampler_name in MULTISTEP), json.dumps(repeat["notes"])
    distance = float((resumed - donor).norm() / donor.norm())
    clip, reference = _frames(resumed), _frames(donor)
    quality, structure = psnr_from_mse(mse(clip, reference)), ssim(clip, reference)
    print(f"\n{sampler_name}: self-resume at step {STEPS // 2} of {STEPS}: relative distance {distance:.4f}, "
          f"PSNR {quality:.1f} dB, SSIM {structure:.3f} against the uninterrupted run")
    assert distance < SELF_RESUME_TOLERANCE, (sampler_name, distance)


def test_official_wan21_template_settings_resume_a_reworded_prompt(comfy):
    """ComfyUI's Wan 2.1 text-to-video template samples with uni_pc / simple at cfg 6 over shift 8. The same prompt
    resumed half-way from its own checkpoint lands next to the uninterrupted run: uni_pc replays the donor's
    predictions to the resume step and resumes with its multistep history, where a restart at first order there
    lands far from it (docs/measurements.md, "Sampler matrix"); figures printed."""
    store = f"stores/samplers-{next(_stores)}"
    donor, _ = sample_demo(comfy, _graph(PROMPT, "uni_pc", cfg=6.0, shift=8.0, store=store))
    _, reworded = sample_demo(comfy, _graph(REWORDED, "uni_pc", cfg=6.0, shift=8.0, store=store))
    assert reworded["hit"] and reworded["skipped_steps"] == STEPS // 2, json.dumps(reworded["probes"])
    resumed, repeat = sample_demo(comfy, _graph(PROMPT, "uni_pc", cfg=6.0, shift=8.0, store=store))
    assert repeat["skipped_steps"] == STEPS // 2 and repeat["donor_prompt"] == PROMPT
    clip, reference = _frames(resumed), _frames(donor)
    print(f"\nuni_pc, cfg 6, shift 8: self-resume at step {STEPS // 2} of {STEPS}: relative distance "
          f"{float((resumed - donor).norm() / donor.norm()):.4f}, PSNR {psnr_from_mse(mse(clip, reference)):.1f} dB, "
          f"SSIM {ssim(clip, reference):.3f} against the uninterrupted run; {repeat['model_calls']} model calls")
    assert REPLAY_NOTE in repeat["notes"] and repeat["model_calls"] <= STEPS - STEPS // 2 + 1, json.dumps(repeat)
    assert psnr_from_mse(mse(clip, reference)) > 60.0


# Rewordings of the kind people type, under the Wan 2.1 template's settings. MiniLM scores the first below 0.5; its
# plain clip keeps only half of what the oracle checks.
TEMPLATE_REWORDINGS = [
    ("a purple triangle moving right on a gray background", "a violet wedge drifting to the right over grey"),
    ("a green dot not moving on a black background", "a small green dot that is not moving, black backdrop"),
    ("a red circle moving left on a white background", "a red round shape going left over white"),
]


@pytest.mark.parametrize(("earlier", "new"), TEMPLATE_REWORDINGS)
def test_official_wan21_template_rewording_resumes_with_history_and_keeps_adherence(comfy, earlier, new):
    """One node, nothing wired, the template's uni_pc at cfg 6 over shift 8: a rewording of the earlier request
    resumes, replaying the donor's predictions, and its clip keeps the oracle adherence of the new prompt's plain
    clip (same seed); PSNR and SSIM against that clip are printed (docs/measurements.md, "Sampler matrix")."""
    store = f"stores/samplers-{next(_stores)}"

    def graph(prompt: str, reusing: bool) -> dict:
        graph = base_graph(DEMO_WEIGHTS, prompt, seed=11, steps=STEPS, cfg=6.0, sampler_name="uni_pc")
        graph[MODEL_CHAIN]["inputs"]["shift"] = 8.0
        return with_reuse(graph, store, "", sparse_attention="off") if reusing else with_report(graph)

    sample_demo(comfy, graph(earlier, True))
    plain, _ = sample_demo(comfy, graph(new, False))
    resumed, report = sample_demo(comfy, graph(new, True))
    assert report["hit"] and report["skipped_steps"] > 0 and REPLAY_NOTE in report["notes"], json.dumps(report)
    clip, reference = _frames(resumed), _frames(plain)
    kept, expected = score(new, clip).adherence, score(new, reference).adherence
    print(f"\n{new!r} after {earlier!r}: resumed at step {report['skipped_steps']} of {STEPS}, "
          f"{report['model_calls']} model calls; PSNR {psnr_from_mse(mse(clip, reference)):.1f} dB, "
          f"SSIM {ssim(clip, reference):.3f} against its plain clip; adherence {kept:.2f} (plain {expected:.2f})")
    assert kept >= expected

"""Input distance calibration: how far apart may two inputs of a stage be for one run to continue the other?

`python -m carnator_core.bench inputs [--pairs 3] [--steps 20] [--denoise 0.6] [--cfg 1] [--handover] [--json]
[--out DIR]`

A run from an input (a refinement after an upsampler, video-to-video) takes as donors only earlier runs of the same
stage whose input lies within `MAX_INPUT_DISTANCE` (relative L2) of its own; the model then screens and probes them
(`carnator_core.reuse.input_start`). This measures that bound on the demo model, the way the engine reaches such a
stage: for donor/new prompt pairs of known relation (`bench probe`'s), both prompts are sampled plain from the same
noise (the first stage), and the second stage starts from each first stage's output, `denoise` of the schedule from
the end, under one more shared noise. Each unrelated pair also gives `retouched` requests: the donor's own prompt from
its input moved towards the other clip by set distances (`RETOUCH_DISTANCES`). The second stage of each request then

- is screened against the donor's at its first evaluation (`ProbeThresholds` at depth 0, as `Decider._screen`),
- is resumed at several depths from the donor's state corrected by the two first states' and (without CFG) first
  predictions' difference (`StartDifference`), after the probe the engine makes there,
- and each resume is scored against the new prompt's own plain second stage: PSNR and SSIM of the decoded clip
  (`QualityTarget`) and the oracle's adherence; so is the own shortcut to the same depth (no donor: the request's
  own first prediction extrapolated in one Euler step), which says whether the donor added anything.

The summary bins the pairs by input distance and says, per bin, how many the model accepts, how many of those are
good and how many of those borrowed (ended closer to plain than the own shortcut); and the distance below which every
accepted resume was good (`safe_bound`), against the shipped bound. The model's judgement decides within the bound;
the bound only keeps the lookup from asking it about other inputs.

`--handover` measures the Wan 2.2 14B shape instead: the first stage stops `denoise` of the schedule from the end with
its leftover noise and the second continues that state, without fresh noise, as after a first stage sampled in full
(an edit whose first expert missed); its input is that state.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from carnator_core.bench.probe import FlowSampler, load_model, pairs, sigmas_for, write_results
from carnator_core.demo import world
from carnator_core.demo.oracle import score
from carnator_core.demo.text import token_embeddings
from carnator_core.demo.wan_model import WanT2V
from carnator_core.judging.probe_signals import ProbeSignals
from carnator_core.judging.probe_thresholds import ProbeThresholds
from carnator_core.judging.quality import mse, psnr_from_mse, ssim
from carnator_core.judging.quality_target import QualityTarget
from carnator_core.recorded_runs import Recording, add_record_option
from carnator_core.reuse.input_start import MAX_INPUT_DISTANCE, input_distance
from carnator_core.reuse.probe import probe_signals
from carnator_core.reuse.start_difference import StartDifference

DISTANCE_EDGES = (0.1, 0.2, 0.3, 0.4, 0.5)  # the summary's bins of input distance
# "retouched": the donor's prompt again, its input moved towards an unrelated pair's other clip to these input
# distances (a stage input edited between stages, another upsampler's output), filling the distances between the
# relations'
RETOUCH_DISTANCES = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.7)


@dataclass
class Row:
    """One forced resume of a pair's second stage at one depth, what the engine would have judged, and its quality."""

    relation: str
    distance: float  # the two second-stage inputs' relative L2 distance (`input_distance`)
    depth: float  # fraction of the second stage's steps skipped
    screen_structure: float
    screen_guidance: float | None
    probe_structure: float
    probe_guidance: float | None
    psnr_db: float  # the resumed clip against the new prompt's plain second stage, decoded
    ssim: float
    adherence_plain: float
    adherence_resumed: float
    # the same depth reached without the donor: the request's own first prediction extrapolated in one Euler step
    own_psnr_db: float = float("nan")
    own_adherence: float = float("nan")

    def accepted(self, thresholds: ProbeThresholds) -> bool:
        """Whether the engine would take this resume: the screen at depth 0 and the probe at its depth pass."""
        screen = ProbeSignals(0.0, float("nan"), self.screen_structure, self.screen_guidance)
        probe = ProbeSignals(self.depth, float("nan"), self.probe_structure, self.probe_guidance, corrected=True)
        return thresholds.passes(screen) and thresholds.passes(probe)

    def good(self, target: QualityTarget) -> bool:
        """Close to the new prompt's plain clip and as adherent as it."""
        return target.good(self.psnr_db, self.ssim) and self.adherence_resumed >= self.adherence_plain - 1e-9

    @property
    def borrowed(self) -> bool:
        """Whether the donor added something: the resume ended closer to plain than the own shortcut."""
        return self.psnr_db > self.own_psnr_db


def _noise(seed: int) -> torch.Tensor:
    return torch.randn(1, 16, *world.CLIP, generator=torch.Generator().manual_seed(seed))


def measure(model: WanT2V, pair_count: int, steps: int, denoise: float, depths: tuple[float, ...], cfg_scale: float,
            seed: int, handover: bool = False) -> list[Row]:
    """Every pair's second stage resumed from its donor's at each depth (see the module docstring)."""
    rng = np.random.default_rng(seed)
    sigmas = sigmas_for(steps)
    start = min(steps - 1, round(steps * (1.0 - denoise)))
    first = FlowSampler(model, cfg_scale, sigmas[:start + 1] if handover else sigmas)
    second = SecondStage(FlowSampler(model, cfg_scale, sigmas[start:]), depths, guided=cfg_scale != 1.0,
                         fresh_noise=not handover)
    rows = []
    for index, (relation, donor_attrs, new_attrs) in enumerate(pairs(pair_count, rng)):
        donor_prompt = world.canonical_prompt(donor_attrs)
        new_prompt = world.paraphrase(new_attrs, rng) if relation == "reworded" else world.canonical_prompt(new_attrs)
        donor_context, new_context = token_embeddings([donor_prompt, new_prompt]).split(1)
        noise, stage_noise = _noise(seed + index), _noise(seed + 10_000 + index)
        donor_input, _ = first.run(noise, donor_context, second.uncond)
        new_input, _ = first.run(noise, new_context, second.uncond)
        donor = second.donor(donor_input, donor_context, stage_noise)
        rows += second.resumes(relation, donor, new_input, new_context, new_prompt)
        if relation == "unrelated":  # the donor's own prompt from its input retouched towards this other clip
            full = input_distance(new_input, donor_input)
            for distance in RETOUCH_DISTANCES:
                retouched = donor_input + min(1.0, distance / full) * (new_input - donor_input)
                rows += second.resumes("retouched", donor, retouched, donor_context, donor_prompt)
    return rows


@dataclass
class _Donor:
    """A donor's second stage: its input, first state and recorded (x_k, x0_k, guidance_k) per step."""

    input: torch.Tensor
    start: torch.Tensor
    states: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    noise: torch.Tensor


class SecondStage:
    """The second stage on the demo model: donors sampled plain, requests resumed from them as the engine would."""

    def __init__(self, sampler: FlowSampler, depths: tuple[float, ...], guided: bool, fresh_noise: bool) -> None:
        self.sampler, self.depths, self.guided, self.fresh_noise = sampler, depths, guided, fresh_noise
        self.uncond = token_embeddings([""])
        self.steps = len(sampler.sigmas) - 1

    def _start(self, latent: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """The stage's first state: its input mixed with fresh noise, or (a hand-over) the input itself."""
        if not self.fresh_noise:
            return latent
        sigma = self.sampler.sigmas[0]
        return (1.0 - sigma) * latent + sigma * noise

    def _guidance(self, guidance: torch.Tensor | None) -> torch.Tensor | None:
        """At cfg 1 the engine's sampler has no unconditional half, hence no guidance."""
        return guidance if self.guided else None

    def donor(self, latent: torch.Tensor, context: torch.Tensor, noise: torch.Tensor) -> _Donor:
        start = self._start(latent, noise)
        _, states = self.sampler.run(start, context, self.uncond)
        return _Donor(input=latent, start=start, states=states, noise=noise)

    def resumes(self, relation: str, donor: _Donor, latent: torch.Tensor, context: torch.Tensor,
                prompt: str) -> list[Row]:
        """The request from `latent` screened against `donor`, then resumed at each depth from the donor's state
        corrected as the engine corrects it, with the probe there; each scored against its own plain run."""
        sampler, sigma = self.sampler, self.sampler.sigmas[0]
        start = self._start(latent, donor.noise)
        plain, _ = sampler.run(start, context, self.uncond)
        plain_rgb = world.decode(plain[0])
        adherence_plain = score(prompt, plain_rgb).adherence
        _, x0_donor_start, guidance_donor_start = donor.states[0]
        x0_start, guidance_start = sampler.predict(start, sigma, context, self.uncond)
        screen = probe_signals(0.0, donor.start, x0_start, x0_donor_start, self._guidance(guidance_start),
                               self._guidance(guidance_donor_start))
        difference = StartDifference.of(sigma, x0_start, x0_donor_start, self._guidance(guidance_start),
                                        self._guidance(guidance_donor_start))
        difference = replace(difference, state=start - donor.start)
        if self.guided:  # as the engine corrects a run with CFG guidance: for its first state only
            difference = difference.without_prediction()
        distance = input_distance(latent, donor.input)
        rows = []
        for depth in self.depths:
            k = max(1, min(self.steps - 1, round(depth * self.steps)))
            x_k, x0_donor, guidance_donor = donor.states[k]
            corrected = difference.state_at(x_k, sampler.sigmas[k])
            x0_new, guidance_new = sampler.predict(corrected, sampler.sigmas[k], context, self.uncond)
            moved_guidance = self._guidance(guidance_donor)
            if moved_guidance is not None and difference.guidance is not None:
                moved_guidance = moved_guidance + difference.guidance
            probe = probe_signals(k / self.steps, corrected, x0_new, difference.prediction(x0_donor),
                                  self._guidance(guidance_new), moved_guidance, corrected=True)
            resumed, _ = sampler.run(corrected, context, self.uncond, start=k)
            rgb = world.decode(resumed[0])
            shortcut = x0_start + sampler.sigmas[k] / sigma * (start - x0_start)
            own_rgb = world.decode(sampler.run(shortcut, context, self.uncond, start=k)[0][0])
            rows.append(Row(relation=relation, distance=distance, depth=k / self.steps,
                            screen_structure=screen.structure_agreement, screen_guidance=screen.guidance_cosine,
                            probe_structure=probe.structure_agreement, probe_guidance=probe.guidance_cosine,
                            psnr_db=psnr_from_mse(mse(rgb, plain_rgb)), ssim=ssim(rgb, plain_rgb),
                            adherence_plain=adherence_plain, adherence_resumed=score(prompt, rgb).adherence,
                            own_psnr_db=psnr_from_mse(mse(own_rgb, plain_rgb)),
                            own_adherence=score(prompt, own_rgb).adherence))
        return rows


def _bin(distance: float) -> str:
    low = 0.0
    for edge in DISTANCE_EDGES:
        if distance < edge:
            return f"{low:g}-{edge:g}"
        low = edge
    return f">={low:g}"


def summarise(rows: list[Row], thresholds: ProbeThresholds | None = None,
              target: QualityTarget | None = None) -> dict:
    """Per distance bin: pairs, resumes, accepted, accepted and good, good; and the largest distance up to which
    every accepted resume was good (`safe_bound`: the smallest distance of an accepted resume that was not, or
    None when none was)."""
    thresholds, target = thresholds or ProbeThresholds(), target or QualityTarget()
    bins: dict[str, dict] = {}
    for row in sorted(rows, key=lambda r: r.distance):
        cell = bins.setdefault(_bin(row.distance), {"pairs": set(), "relations": {}, "resumes": 0, "accepted": 0,
                                                    "accepted_good": 0, "accepted_borrowed": 0, "good": 0,
                                                    "psnr_accepted": []})
        cell["pairs"].add((row.relation, row.distance))
        cell["relations"][row.relation] = cell["relations"].get(row.relation, 0) + 1
        accepted, good = row.accepted(thresholds), row.good(target)
        cell["resumes"] += 1
        cell["accepted"] += accepted
        cell["good"] += good
        cell["accepted_good"] += accepted and good
        cell["accepted_borrowed"] += accepted and good and row.borrowed
        if accepted:
            cell["psnr_accepted"].append(row.psnr_db)
    for cell in bins.values():
        cell["pairs"] = len(cell["pairs"])
        psnrs = cell.pop("psnr_accepted")
        cell["psnr_accepted_median"] = float(np.median(psnrs)) if psnrs else None
        cell["precision"] = cell["accepted_good"] / cell["accepted"] if cell["accepted"] else None
    failures = [r.distance for r in rows if r.accepted(thresholds) and not r.good(target)]
    accepted_good = [r.distance for r in rows if r.accepted(thresholds) and r.good(target)]
    return {"rows": len(rows), "bins": bins, "shipped_bound": MAX_INPUT_DISTANCE,
            "safe_bound": min(failures) if failures else None,
            "largest_good_accepted": max(accepted_good) if accepted_good else None,
            "quality_target": asdict(target)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m carnator_core.bench inputs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3, help="pairs per relation")
    parser.add_argument("--steps", type=int, default=20, help="steps of the whole schedule")
    parser.add_argument("--denoise", type=float, default=0.6, help="share of the schedule the second stage samples")
    parser.add_argument("--depths", default="0.25,0.5,0.75", help="resume depths (fractions of the second stage)")
    parser.add_argument("--cfg", type=float, default=1.0)
    parser.add_argument("--handover", action="store_true",
                        help="the second stage continues the first stage's state, without fresh noise (Wan 2.2 14B's "
                             "two experts); --denoise is then its share of the schedule")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--weights", type=Path, default=None,
                        help="demo model .safetensors (default: $CARNATOR_DEMO_WEIGHTS, else the shipped file)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write rows.jsonl and summary.json here")
    parser.add_argument("--json", action="store_true")
    add_record_option(parser, "the rows and summary")
    args = parser.parse_args(argv)
    if not 0.0 < args.denoise < 1.0 or args.steps < 4 or args.pairs < 1:
        parser.error("needs 0 < --denoise < 1, --steps >= 4 and --pairs >= 1")
    torch.set_num_threads(args.threads)
    depths = tuple(float(d) for d in args.depths.split(","))
    recording = Recording(args.record, "carnator_core.bench inputs", argv)
    rows = measure(load_model(args.weights), args.pairs, args.steps, args.denoise, depths, args.cfg, args.seed,
                   args.handover)
    summary = summarise(rows)
    if args.out is not None:
        write_results(args.out, rows, summary)
    recording.store({"summary": summary, "rows": [asdict(row) for row in rows]}, torch_threads=args.threads,
                    timed=False)
    if args.json:
        print(json.dumps(summary))
        return 0
    target = summary["quality_target"]
    print(f"{summary['rows']} resumes; good: within {target['psnr_db']:g} dB PSNR and SSIM {target['ssim']:g} of the "
          "new prompt's plain second stage, and as adherent")
    print("input distance  pairs  resumes  accepted  accepted good  of those borrowed  good  median PSNR accepted  "
          "relations")
    for name, cell in summary["bins"].items():
        median = "n/a" if cell["psnr_accepted_median"] is None else f"{cell['psnr_accepted_median']:.1f} dB"
        print(f"{name:<14}  {cell['pairs']:>5}  {cell['resumes']:>7}  {cell['accepted']:>8}  "
              f"{cell['accepted_good']:>13}  {cell['accepted_borrowed']:>17}  {cell['good']:>4}  {median:>20}  "
              f"{cell['relations']}")
    bound = summary["safe_bound"]
    print(f"every accepted resume was good below input distance "
          f"{'(all were good)' if bound is None or math.isinf(bound) else f'{bound:.3f}'}; largest good accepted: "
          f"{summary['largest_good_accepted']}; shipped bound {summary['shipped_bound']}")
    return 0

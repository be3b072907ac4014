"""Probe calibration: which signal predicts that resuming from a donor state still reaches the new prompt?

`python -m carnator_core.bench probe [--pairs 6] [--steps 30] [--weights FILE] [--shortcuts] [--json] [--out DIR]`

On the demo model (fixed seed, Euler flow sampler with CFG, as the reuse engine runs it), for
donor/new prompt pairs of known relation (same scene reworded, background / colour / shape /
motion changed, unrelated), at several depths k:

- the probe signals of carnator_core.reuse.probe at the donor's state x_k (raw agreement, structure
  agreement, guidance cosine) and the prompts' text cosine;
- the outcome: the new prompt resumed from x_k scores at least the oracle adherence of its own
  plain run (resuming did not cost quality).

Reports each signal's AUC for predicting the outcome (overall and per depth), the mean raw
agreement of unrelated pairs per depth (the "everything converges late" trap), how the default
acceptance rule (`ProbeThresholds`) does on these outcomes (precision: share of accepted resumes that
kept quality; recall: share of quality-keeping resumes it accepted), and per depth the lowest
structure-agreement threshold that accepts no resume which lost quality, with its recall.

With `--shortcuts`, every row also asks whether the donor's state adds anything the request does not already
have at step 0. Two more resumes at the same depth, scored the same way (adherence, and PSNR of the decoded clip
against the new prompt's plain clip):

- corrected: the donor's state moved by what the two prompts' step-0 predictions differ by, as far as sampling
  has moved towards them: x_k + (1 - sigma_k / sigma_0) (x0_new_0 - x0_donor_0). Where the prompts agree it is the
  donor's state; where they differ, the request's own estimate. It is region-level reuse without a mask.
- own shortcut: no donor at all, the request's own step-0 prediction extrapolated to sigma_k (one Euler step).

A resume whose clip is no closer to plain than the own shortcut's borrowed nothing from the donor: skipping those
steps is then a few-step sampler, not reuse, and the acceptance rule must not count it as reuse.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from carnator_core.demo import world
from carnator_core.demo.oracle import score
from carnator_core.demo.sampling import shifted_sigma
from carnator_core.demo.server import DemoSetupError, demo_weights
from carnator_core.demo.text import token_embeddings
from carnator_core.demo.wan_model import WanT2V, model_from_state_dict
from carnator_core.judging.calibration_profile import Profile, ProfileError
from carnator_core.judging.probe_signals import ProbeSignals
from carnator_core.judging.probe_thresholds import ProbeThresholds
from carnator_core.judging.quality import mse, psnr_from_mse
from carnator_core.lookup.embeddings import text_embedder
from carnator_core.prompt_file import PromptFileError
from carnator_core.prompt_pairs import PAIR_RULE, read_pairs
from carnator_core.recorded_runs import Recording, add_record_option
from carnator_core.reuse.probe import conditional_agreement, probe_signals
from carnator_core.reuse.start_difference import StartDifference

RELATIONS = ("reworded", "background", "colour", "shape", "motion", "unrelated")
SIGNALS = ("raw_agreement", "structure_agreement", "guidance_cosine", "text_cosine")


@dataclass
class Row:
    relation: str
    depth: float
    raw_agreement: float
    structure_agreement: float
    guidance_cosine: float
    text_cosine: float
    adherence_plain: float
    adherence_resumed: float
    lost: list[str] = field(default_factory=list)  # attributes plain drew as asked and the resumed run did not
    # the pair's step-0 signals (the new prompt's first evaluation against the donor's, same noise): Decider._screen
    start_structure_agreement: float = float("nan")
    start_guidance_cosine: float | None = None
    psnr_resumed: float = float("nan")  # the resumed clip against the new prompt's plain clip (dB)
    # `--shortcuts`: the same depth resumed from the corrected donor state and from the request's own step-0
    # prediction alone (see the module docstring), each (adherence, PSNR against plain)
    corrected: tuple[float, float] | None = None
    own_shortcut: tuple[float, float] | None = None
    # and the probe at the corrected state, against the donor's prediction moved alike (as a screened donor is probed)
    corrected_structure_agreement: float = float("nan")
    corrected_guidance_cosine: float | None = None
    # with CFG: the conditional branches' structure agreement (`reuse.probe.conditional_agreement`), at step 0 and at k
    start_conditional_agreement: float | None = None
    conditional_agreement: float | None = None

    @property
    def outcome(self) -> bool:
        return self.adherence_resumed >= self.adherence_plain - 1e-9


def sigmas_for(steps: int, shift: float = 3.0) -> list[float]:
    return [float(shifted_sigma(torch.tensor(1 - i / steps), shift)) for i in range(steps)] + [0.0]


class FlowSampler:
    """Euler flow sampling with CFG on the demo model, exposing the per-step states the engine records."""

    def __init__(self, model: WanT2V, cfg_scale: float, sigmas: list[float]) -> None:
        self.model, self.cfg_scale, self.sigmas = model, cfg_scale, sigmas

    @torch.no_grad()
    def predict(self, x: torch.Tensor, sigma: float, context: torch.Tensor, uncond: torch.Tensor):
        """(x0 with CFG, guidance = x0_cond - x0_uncond) at state x."""
        t = torch.full((x.shape[0],), sigma * 1000)
        v_cond, v_uncond = self.model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([context, uncond])).chunk(2)
        v = v_uncond + self.cfg_scale * (v_cond - v_uncond)
        return x - sigma * v, -sigma * (v_cond - v_uncond)

    @torch.no_grad()
    def run(self, x: torch.Tensor, context: torch.Tensor, uncond: torch.Tensor, start: int = 0):
        """Sample from step `start`; returns the final x and the (x_k, x0_k, guidance_k) of every step."""
        states = {}
        for step in range(start, len(self.sigmas) - 1):
            sigma, following = self.sigmas[step], self.sigmas[step + 1]
            x0, guidance = self.predict(x, sigma, context, uncond)
            states[step] = (x, x0, guidance)
            x = x0 + following * (x - x0) / sigma  # Euler step of the flow ODE, written on x0
        return x, states


def pairs(count: int, rng: np.random.Generator) -> list[tuple[str, dict, dict]]:
    """(relation, donor attributes, new attributes), `count` of each relation."""
    sets = world.all_attribute_sets()
    chosen = []
    for relation in RELATIONS:
        for _ in range(count):
            donor = dict(sets[int(rng.integers(len(sets)))])
            if relation == "reworded":
                new = dict(donor)
            elif relation == "unrelated":
                new = dict(sets[int(rng.integers(len(sets)))])
                while any(new[a] == donor[a] for a in world.ATTRIBUTES):
                    new = dict(sets[int(rng.integers(len(sets)))])
            else:
                new = world.swap(donor, relation, rng)
            chosen.append((relation, donor, new))
    return chosen


def prompt_pairs(count: int, rng: np.random.Generator) -> list[tuple[str, str, str]]:
    """(relation, donor prompt, new prompt) of `pairs`: a reworded pair's new prompt is a paraphrase, every other
    prompt the attributes' canonical wording."""
    return [(relation, world.canonical_prompt(donor),
             world.paraphrase(new, rng) if relation == "reworded" else world.canonical_prompt(new))
            for relation, donor, new in pairs(count, rng)]


def relation_of(donor_prompt: str, new_prompt: str) -> str:
    """The relation of two prompts as the demo world reads them: reworded (the same attributes), the one attribute
    that differs, else unrelated (several differ, or the world cannot read one of them)."""
    donor, new = world.parse_prompt(donor_prompt), world.parse_prompt(new_prompt)
    if donor is None or new is None:
        return "unrelated"
    differ = [attribute for attribute in world.ATTRIBUTES if donor[attribute] != new[attribute]]
    return "reworded" if not differ else differ[0] if len(differ) == 1 else "unrelated"


def pairs_from_file(path: Path) -> list[tuple[str, str, str]]:
    """(relation, donor prompt, new prompt) of a calibration pairs file, each pair's relation read by the world."""
    return [(relation_of(pair.earlier, pair.new), pair.earlier, pair.new) for pair in read_pairs(path)]


def auc(scores: list[float], labels: list[bool]) -> float | None:
    """Probability that a random positive scores above a random negative (ties count half)."""
    positives = [s for s, label in zip(scores, labels, strict=True) if label]
    negatives = [s for s, label in zip(scores, labels, strict=True) if not label]
    if not positives or not negatives:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def _scored(prompt: str, latent: torch.Tensor, plain_rgb: torch.Tensor):
    """The oracle's result for a clip and its PSNR against the plain clip."""
    rgb = world.decode(latent[0])
    return score(prompt, rgb), psnr_from_mse(mse(rgb, plain_rgb))


def calibrate(model: WanT2V, chosen: list[tuple[str, str, str]], steps: int, depths: list[int], cfg_scale: float,
              seed: int, shortcuts: bool = False, same_noise: bool = False) -> list[Row]:
    """A row per (pair, depth) of `chosen` ((relation, donor prompt, new prompt)); each pair samples from its own noise,
    or every pair from the noise of `seed` (`same_noise`: a fixed-seed stream's pairs)."""
    sampler = FlowSampler(model, cfg_scale, sigmas_for(steps))
    embedder = text_embedder()
    uncond = token_embeddings([""])
    rows = []
    for index, (relation, donor_prompt, new_prompt) in enumerate(chosen):
        contexts = token_embeddings([donor_prompt, new_prompt])
        noise = torch.randn(1, 16, *world.CLIP, generator=torch.Generator().manual_seed(
            seed if same_noise else seed + index))
        _, donor_states = sampler.run(noise, contexts[:1], uncond)
        plain, _ = sampler.run(noise, contexts[1:], uncond)
        plain_rgb = world.decode(plain[0])
        plain_result = score(new_prompt, plain_rgb)
        text_cosine = float(embedder.embed([donor_prompt, new_prompt]).prod(dim=0).sum())
        x_start, x0_start_donor, guidance_start_donor = donor_states[0]
        x0_start_new, guidance_start_new = sampler.predict(x_start, sampler.sigmas[0], contexts[1:], uncond)
        start = probe_signals(0.0, x_start, x0_start_new, x0_start_donor, guidance_start_new, guidance_start_donor)
        guided = {} if cfg_scale == 1.0 else {"start_conditional_agreement": conditional_agreement(
            x_start, x0_start_new, x0_start_donor, guidance_start_new, cfg_scale)}
        sigma_start = sampler.sigmas[0]
        for k in depths:
            x_k, x0_donor, guidance_donor = donor_states[k]
            x0_new, guidance_new = sampler.predict(x_k, sampler.sigmas[k], contexts[1:], uncond)
            signals = probe_signals(k / steps, x_k, x0_new, x0_donor, guidance_new, guidance_donor)
            if cfg_scale != 1.0:
                guided["conditional_agreement"] = conditional_agreement(x_k, x0_new, x0_donor, guidance_new, cfg_scale)
            resumed, _ = sampler.run(x_k, contexts[1:], uncond, start=k)
            resumed_result, resumed_psnr = _scored(new_prompt, resumed, plain_rgb)
            alternatives = {}
            if shortcuts:
                difference = StartDifference.of(sigma_start, x0_start_new, x0_start_donor, guidance_start_new,
                                                guidance_start_donor)
                moved = difference.moved(sampler.sigmas[k])
                starts = {"corrected": difference.state_at(x_k, sampler.sigmas[k]),
                          "own_shortcut": x0_start_new + (1.0 - moved) * (x_start - x0_start_new)}
                for name, state in starts.items():
                    result, psnr = _scored(new_prompt, sampler.run(state, contexts[1:], uncond, start=k)[0], plain_rgb)
                    alternatives[name] = (result.adherence, psnr)
                x0_corrected, guidance_corrected = sampler.predict(starts["corrected"], sampler.sigmas[k],
                                                                   contexts[1:], uncond)
                probed = probe_signals(k / steps, starts["corrected"], x0_corrected,
                                       difference.prediction(x0_donor), guidance_corrected,
                                       guidance_donor + difference.guidance, corrected=True)
                alternatives["corrected_structure_agreement"] = probed.structure_agreement
                alternatives["corrected_guidance_cosine"] = probed.guidance_cosine
            rows.append(Row(relation=relation, depth=k / steps, raw_agreement=signals.raw_agreement,
                            structure_agreement=signals.structure_agreement,
                            guidance_cosine=signals.guidance_cosine, text_cosine=text_cosine,
                            adherence_plain=plain_result.adherence, adherence_resumed=resumed_result.adherence,
                            lost=[a for a in world.ATTRIBUTES
                                  if plain_result.matches[a] and not resumed_result.matches[a]],
                            start_structure_agreement=start.structure_agreement,
                            start_guidance_cosine=start.guidance_cosine, psnr_resumed=resumed_psnr,
                            **alternatives, **guided))
    return rows


def default_rule_passes(row: Row) -> bool:
    return ProbeThresholds().passes(ProbeSignals(depth=row.depth, raw_agreement=row.raw_agreement,
                                                 structure_agreement=row.structure_agreement,
                                                 guidance_cosine=row.guidance_cosine))


def start_screen_passes(row: Row, thresholds: ProbeThresholds | None = None) -> bool:
    """Whether the pair passes the step-0 screen a same-seed request runs before any deep probe (with CFG, on the
    conditional branches' agreement, as the engine judges it)."""
    return (thresholds or ProbeThresholds()).passes(ProbeSignals(depth=0.0, raw_agreement=float("nan"),
                                                 structure_agreement=row.start_structure_agreement,
                                                 guidance_cosine=row.start_guidance_cosine,
                                                 conditional_agreement=row.start_conditional_agreement))


def start_screen_by_relation(rows: list[Row]) -> dict[str, dict[str, float | int]]:
    """Per relation: the range of step-0 structure agreement over its pairs and how many pairs pass the screen."""
    summary = {}
    for relation in RELATIONS:
        # every depth's row of a pair carries the pair's step-0 signals: one per pair
        pairs = {(r.start_structure_agreement, r.start_guidance_cosine): r for r in rows if r.relation == relation}
        if not pairs:
            continue
        agreements = [r.start_structure_agreement for r in pairs.values()]
        summary[relation] = {"pairs": len(pairs), "passed": sum(start_screen_passes(r) for r in pairs.values()),
                             "structure_min": float(min(agreements)), "structure_max": float(max(agreements))}
        conditional = [r.start_conditional_agreement for r in pairs.values() if r.start_conditional_agreement is not None]
        if conditional:
            summary[relation].update(conditional_min=float(min(conditional)), conditional_max=float(max(conditional)))
    return summary


def precision_recall(accepted: list[bool], good: list[bool]) -> dict[str, float | int | None]:
    """Of the accepted resumes, the share that kept quality; of those that would have, the share accepted."""
    true_accepts = sum(a and g for a, g in zip(accepted, good, strict=True))
    return {"accepted": sum(accepted), "good": sum(good),
            "precision": true_accepts / sum(accepted) if any(accepted) else None,
            "recall": true_accepts / sum(good) if any(good) else None}


def safe_threshold(rows: list[Row]) -> dict[str, float | None]:
    """Lowest structure-agreement threshold above every resume that lost quality, and its recall."""
    bad = [r.structure_agreement for r in rows if not r.outcome]
    threshold = max(bad) + 1e-6 if bad else min(r.structure_agreement for r in rows)
    good = [r for r in rows if r.outcome]
    recall = sum(r.structure_agreement >= threshold for r in good) / len(good) if good else None
    return {"threshold": float(threshold), "recall": recall}


def accepted_but_lost(rows: list[Row]) -> dict[str, int]:
    """What the default rule let through that cost quality: "relation: lost attribute" -> count of resumes."""
    lost = Counter(f"{r.relation}: {a}" for r in rows if default_rule_passes(r) and not r.outcome for a in r.lost)
    return dict(lost.most_common())


RESUMES = ("donor", "corrected", "own_shortcut")  # where a `--shortcuts` row resumed from (module docstring)


def _resumes(row: Row) -> dict[str, tuple[float, float] | None]:
    return {"donor": (row.adherence_resumed, row.psnr_resumed), "corrected": row.corrected,
            "own_shortcut": row.own_shortcut}


def shortcuts_by_relation(rows: list[Row]) -> dict[str, dict[str, dict[str, float | int]]]:
    """Per relation and resume start: resumes that kept plain's adherence, and the median PSNR against plain.
    Empty unless the rows were made with `--shortcuts`."""
    table: dict[str, dict[str, dict[str, float | int]]] = {}
    for relation in RELATIONS:
        of = [r for r in rows if r.relation == relation and r.own_shortcut is not None]
        if of:
            table[relation] = {
                name: {"kept": sum(_resumes(r)[name][0] >= r.adherence_plain - 1e-9 for r in of), "rows": len(of),
                       "psnr_median": float(np.median([_resumes(r)[name][1] for r in of]))}
                for name in RESUMES}
    return table


def kept(row: Row) -> bool:
    """Whether the corrected resume kept plain's adherence."""
    return row.corrected[0] >= row.adherence_plain - 1e-9


def borrowed(row: Row) -> bool:
    """Whether the corrected resume kept plain's adherence and ended closer to plain than the own shortcut: it reused
    something, rather than being a few-step sampler."""
    return kept(row) and row.corrected[1] > row.own_shortcut[1]


def corrected_signals(row: Row) -> ProbeSignals:
    return ProbeSignals(depth=row.depth, raw_agreement=float("nan"),
                        structure_agreement=row.corrected_structure_agreement,
                        guidance_cosine=row.corrected_guidance_cosine, corrected=True)


def corrected_rule(rows: list[Row], thresholds: ProbeThresholds | None = None) -> dict:
    """How the engine's rule for screened same-noise donors does: of the rows whose pair passes the step-0 screen, the
    corrected resumes `ProbeThresholds.passes` accepts on the corrected probe, with precision and recall against the
    resumes that kept plain's adherence, how many of the accepted ones `borrowed`, and the accepted ones per relation;
    beside it the same for the raw donor state the rule judged before. Empty unless the rows were made with
    `--shortcuts`."""
    thresholds = thresholds or ProbeThresholds()
    screened = [r for r in rows if r.corrected is not None and start_screen_passes(r, thresholds)]
    if not screened:
        return {}
    accepted = [thresholds.passes(corrected_signals(r)) for r in screened]
    raw = [thresholds.passes(ProbeSignals(depth=r.depth, raw_agreement=r.raw_agreement,
                                          structure_agreement=r.structure_agreement,
                                          guidance_cosine=r.guidance_cosine)) for r in screened]
    return {**precision_recall(accepted, [kept(r) for r in screened]),
            "borrowed": sum(a and borrowed(r) for r, a in zip(screened, accepted, strict=True)),
            "accepted_by_relation": dict(Counter(r.relation for r, a in zip(screened, accepted, strict=True) if a)),
            "donor_state": precision_recall(raw, [r.outcome for r in screened])}


def summarise(rows: list[Row], profile: Profile | None = None) -> dict:
    depths = sorted({row.depth for row in rows})
    summary = {"rows": len(rows), "outcome_rate": float(np.mean([row.outcome for row in rows])),
               "auc": {signal: auc([getattr(r, signal) for r in rows], [r.outcome for r in rows])
                       for signal in SIGNALS},
               "auc_by_depth": {}, "unrelated_raw_agreement_by_depth": {}, "outcome_by_relation_and_depth": {},
               "default_rule": precision_recall([default_rule_passes(r) for r in rows], [r.outcome for r in rows]),
               "default_rule_by_depth": {}, "safe_structure_threshold_by_depth": {},
               "accepted_but_lost": accepted_but_lost(rows),
               "start_screen_by_relation": start_screen_by_relation(rows),
               "default_rule_after_start_screen": precision_recall(
                   [default_rule_passes(r) and start_screen_passes(r) for r in rows], [r.outcome for r in rows]),
               "shortcuts_by_relation": shortcuts_by_relation(rows), "corrected_rule": corrected_rule(rows)}
    if profile is not None:  # a calibrated rule, scored by the oracle on these pairs, which its fit never saw
        summary["profile_rule"] = {"profile": profile.describe(), "thresholds": profile.thresholds,
                                   **corrected_rule(rows, profile.probe_thresholds())}
    for depth in depths:
        at = [r for r in rows if r.depth == depth]
        summary["auc_by_depth"][f"{depth:.2f}"] = {
            signal: auc([getattr(r, signal) for r in at], [r.outcome for r in at]) for signal in SIGNALS}
        unrelated = [r.raw_agreement for r in at if r.relation == "unrelated"]
        summary["unrelated_raw_agreement_by_depth"][f"{depth:.2f}"] = float(np.mean(unrelated)) if unrelated else None
        summary["default_rule_by_depth"][f"{depth:.2f}"] = precision_recall(
            [default_rule_passes(r) for r in at], [r.outcome for r in at])
        summary["safe_structure_threshold_by_depth"][f"{depth:.2f}"] = safe_threshold(at)
        summary["outcome_by_relation_and_depth"][f"{depth:.2f}"] = {
            relation: float(np.mean([r.outcome for r in at if r.relation == relation]))
            for relation in RELATIONS if any(r.relation == relation for r in at)}
    return summary


def load_model(weights: Path | None) -> WanT2V:
    """The demo model a benchmark runs on: `weights`, else $CARNATOR_DEMO_WEIGHTS, else the shipped file."""
    try:
        path = demo_weights(weights)
    except DemoSetupError as error:
        raise SystemExit(str(error)) from error
    return model_from_state_dict(load_file(str(path)))


def write_results(directory: Path, rows: list, summary: dict) -> None:
    """A benchmark's rows (dataclasses, one JSON line each) and summary, as `--out DIR` asks."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "rows.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in rows))
    (directory / "summary.json").write_text(json.dumps(summary, indent=2))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m carnator_core.bench probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=4, help="pairs per relation")
    parser.add_argument("--pairs-file", type=Path, default=None,
                        help=f"your own pairs instead ({PAIR_RULE}), all sampled from the noise of --seed as a "
                             "fixed-seed stream is; each pair's relation as the demo world reads the two prompts")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--depths", default="0.2,0.35,0.5,0.65,0.8", help="resume depths (fractions of steps)")
    parser.add_argument("--cfg", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--weights", type=Path, default=None,
                        help="demo model .safetensors (default: $CARNATOR_DEMO_WEIGHTS, else the shipped file)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shortcuts", action="store_true",
                        help="also resume from the corrected donor state and from the request's own step-0 "
                             "prediction alone, to see what the donor adds (twice the resumes)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="a calibration profile.json: score its rule beside the shipped one (needs --shortcuts)")
    parser.add_argument("--out", type=Path, default=None, help="write rows.jsonl and summary.json here")
    parser.add_argument("--json", action="store_true")
    add_record_option(parser, "the rows and summary")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    depths = sorted({round(float(d) * args.steps) for d in args.depths.split(",")})
    try:
        profile = Profile.from_json(args.profile.read_bytes()) if args.profile is not None else None
    except (OSError, ProfileError) as error:
        raise SystemExit(f"error: --profile {args.profile}: {error}") from None
    try:
        chosen = pairs_from_file(args.pairs_file) if args.pairs_file is not None else \
            prompt_pairs(args.pairs, np.random.default_rng(args.seed))
    except (OSError, PromptFileError) as error:
        raise SystemExit(f"error: --pairs-file {args.pairs_file}: {error}") from None
    recording = Recording(args.record, "carnator_core.bench probe", argv)
    rows = calibrate(load_model(args.weights), chosen, args.steps, depths, args.cfg, args.seed, args.shortcuts,
                     same_noise=args.pairs_file is not None)
    summary = summarise(rows, profile)
    if args.out is not None:
        write_results(args.out, rows, summary)
    recording.store({"summary": summary, "rows": [asdict(row) for row in rows],
                     "settings": {"steps": args.steps, "cfg": args.cfg, "seed": args.seed}},
                    torch_threads=args.threads, timed=False)
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"{summary['rows']} probes; resumed result as good as plain in {summary['outcome_rate']:.0%}")
    print("AUC for predicting 'resuming keeps adherence':")
    print("depth  " + "  ".join(f"{s:>19}" for s in SIGNALS))
    print("all    " + "  ".join(f"{_fmt(summary['auc'][s]):>19}" for s in SIGNALS))
    for depth, aucs in summary["auc_by_depth"].items():
        print(f"{depth}   " + "  ".join(f"{_fmt(aucs[s]):>19}" for s in SIGNALS))
    print("unrelated pairs' raw agreement by depth:",
          {d: _fmt(v) for d, v in summary["unrelated_raw_agreement_by_depth"].items()})
    print("default acceptance rule (ProbeThresholds) against the outcomes:")
    print("depth  accepted  good  precision  recall   safe structure threshold (recall)")
    rule = summary["default_rule"]
    print(f"all    {rule['accepted']:>8}  {rule['good']:>4}  {_fmt(rule['precision']):>9}  {_fmt(rule['recall']):>6}")
    for depth, rule in summary["default_rule_by_depth"].items():
        safe = summary["safe_structure_threshold_by_depth"][depth]
        print(f"{depth}   {rule['accepted']:>8}  {rule['good']:>4}  {_fmt(rule['precision']):>9}  "
              f"{_fmt(rule['recall']):>6}   {safe['threshold']:.3f} ({_fmt(safe['recall'])})")
    print("accepted resumes that lost an attribute (relation: attribute):", summary["accepted_but_lost"] or "none")
    print("step-0 screen (same noise; depth-0 thresholds), per relation: pairs passed, structure agreement range")
    for relation, screen in summary["start_screen_by_relation"].items():
        conditional = f"   conditional branch {screen['conditional_min']:.2f} .. {screen['conditional_max']:.2f}" \
            if "conditional_min" in screen else ""
        print(f"  {relation:<10} {screen['passed']}/{screen['pairs']}   "
              f"{screen['structure_min']:.2f} .. {screen['structure_max']:.2f}{conditional}")
    rule = summary["default_rule_after_start_screen"]
    print(f"default rule after the step-0 screen: accepted {rule['accepted']}, precision {_fmt(rule['precision'])}, "
          f"recall {_fmt(rule['recall'])}")
    if summary["shortcuts_by_relation"]:
        print("resumed from: kept plain's adherence / resumes, median PSNR against plain (dB)")
        print("relation    " + "".join(f"{name:>22}" for name in RESUMES))
        for relation, starts in summary["shortcuts_by_relation"].items():
            cells = [f"{start['kept']}/{start['rows']}, {start['psnr_median']:.1f}" for start in starts.values()]
            print(f"{relation:<12}" + "".join(f"{cell:>22}" for cell in cells))
    rule = summary["corrected_rule"]
    if rule:
        raw = rule["donor_state"]
        print(f"screened donors probed and resumed at the corrected state: accepted {rule['accepted']} "
              f"{rule['accepted_by_relation']}, precision {_fmt(rule['precision'])} and recall {_fmt(rule['recall'])} "
              f"by adherence, {rule['borrowed']} closer to plain than the own shortcut; at the donor state: accepted "
              f"{raw['accepted']}, precision {_fmt(raw['precision'])}, recall {_fmt(raw['recall'])}")
    rule = summary.get("profile_rule")
    if rule:
        print(f"{rule['profile']} {rule['thresholds']}: accepted {rule.get('accepted')} "
              f"{rule.get('accepted_by_relation')}, precision {_fmt(rule.get('precision'))} and recall "
              f"{_fmt(rule.get('recall'))} by adherence")
    return 0


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"

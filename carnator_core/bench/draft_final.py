"""The draft-final stream of `bench workload`: every prompt drafted at few steps, then rendered at full steps with the
same seed where the demo world's oracle finds the draft adherent, as a user renders the final of a draft they liked.

    python -m carnator_core.bench workload --stream draft-final [--prompts FILE] [--draft-steps 8] [--steps 30]
        [--cfg 1.0] [--configs balanced,fast] [--json] [--out DIR] [--record NAME]

Per prompt: the plain full render (the reference), then per mode (its own store; the modes' order rotated per prompt)
the draft through CarnatorReuse in that mode, and, for an adherent draft, the final in that mode, which finds the
draft in its store and resumes from its state where its own schedule reaches it. Reported per mode: how many finals
resumed, their model calls (the draft's not counted: the user made it anyway), the yardstick's measures against the
plain full render (PSNR, SSIM, detail ratio, adherence) and how close each final stays to its draft (PSNR and SSIM
against the draft's clip), next to the same closeness of the plain full render. The targets: at least 90 % of finals
resume; mean calls per final at most 17 in balanced and 11 in fast; each final at least as adherent as its draft,
its detail within `DETAIL_TOLERANCE` of the plain full render's, and closer to its draft than the plain full render.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from carnator_core.bench.workload_configurations import store_dir
from carnator_core.bench.workload_stream import Bench, Sample, mean
from carnator_core.demo import graphs
from carnator_core.demo.oracle import score
from carnator_core.judging.quality import detail_ratio, mse, psnr_from_mse, ssim
from carnator_core.judging.yardstick import ADHERENCE_TOLERANCE, DETAIL_TOLERANCE

DRAFT_FINAL = "draft-final"
MODES = ("balanced", "fast")
CALL_TARGETS = {"balanced": 17.0, "fast": 11.0}  # mean model calls per final at 30 steps
RESUMED_TARGET = 0.9


def _measures(clip: Sample, reference: Sample, prompt: str) -> dict[str, Any]:
    result = score(prompt, clip.rgb)
    return {"model_calls": clip.model_calls, "verdict": clip.verdict.value, "skipped_steps": clip.skipped_steps,
            "psnr": round(psnr_from_mse(mse(clip.rgb, reference.rgb)), 3), "ssim": round(ssim(clip.rgb, reference.rgb), 4),
            "detail": round(detail_ratio(clip.rgb, reference.rgb), 4), "adherence": result.adherence,
            "resumed_at": (clip.report or {}).get("resumed_at") or {}}


def _closeness(clip: Sample, draft: Sample) -> dict[str, float]:
    return {"psnr_to_draft": round(psnr_from_mse(mse(clip.rgb, draft.rgb)), 3),
            "ssim_to_draft": round(ssim(clip.rgb, draft.rgb), 4)}


def _reuse_graph(unet: str, prompt: str, seed: int, steps: int, cfg: float, store: str, mode: str) -> dict:
    """The demo graph with CarnatorReuse in `mode` (its other inputs at the node's defaults) recording into `store`."""
    return graphs.with_reuse(graphs.base_graph(unet, prompt, seed=seed, steps=steps, cfg=cfg), store, prompt,
                             mode=mode)


def run_draft_final(bench: Bench, unet: str, prompts: list[str], seeds: list[int], steps: int, draft_steps: int,
                    cfg: float, modes: tuple[str, ...], progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every prompt's plain full render, and per mode its draft and (where adherent) its final; per prompt a row."""
    rows, entries = [], dict.fromkeys(modes, 0)  # entries in each mode's store
    for i, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True)):
        full = bench.sample("plain", graphs.base_graph(unet, prompt, seed=seed, steps=steps, cfg=cfg), steps)
        row: dict[str, Any] = {"prompt": prompt, "seed": seed, "plain": _measures(full, full, prompt), "modes": {}}
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
            store = store_dir(f"{DRAFT_FINAL}-{mode}")
            entries[mode] += 1
            draft = bench.sample_recorded(f"{mode}-draft", _reuse_graph(unet, prompt, seed, draft_steps, cfg, store,
                                                                        mode), draft_steps, store=store,
                                          entries=entries[mode])
            drafted = _measures(draft, full, prompt)
            outcome: dict[str, Any] = {"draft": drafted}
            adherence = drafted["adherence"]
            if adherence is not None and adherence >= 1.0 - ADHERENCE_TOLERANCE:
                entries[mode] += 1
                final = bench.sample_recorded(f"{mode}-final", _reuse_graph(unet, prompt, seed, steps, cfg, store,
                                                                            mode), steps, store=store,
                                              entries=entries[mode])
                outcome["final"] = {**_measures(final, full, prompt), **_closeness(final, draft)}
                outcome["plain_to_draft"] = _closeness(full, draft)
            else:
                outcome["final"] = None  # the user would not render a draft that lost the prompt
            row["modes"][mode] = outcome
        rows.append(row)
        finals = ", ".join(f"{mode} {outcome['final']['model_calls']} calls" if outcome["final"] else
                           f"{mode} draft not adherent" for mode, outcome in row["modes"].items())
        progress(f"[{i + 1}/{len(prompts)}] {prompt!r}: {finals}")
    return rows


def summarise_draft_final(rows: list[dict[str, Any]], modes: tuple[str, ...], steps: int) -> dict[str, Any]:
    """Per mode: finals rendered and resumed, mean calls, the measures against plain and the draft, the targets."""
    summary: dict[str, Any] = {}
    plain_detail = 1.0
    for mode in modes:
        rendered = [(row, row["modes"][mode]) for row in rows if row["modes"][mode]["final"] is not None]
        finals = [outcome["final"] for _, outcome in rendered]
        resumed = [f for f in finals if f["skipped_steps"] > 0]
        closer = [o["final"]["psnr_to_draft"] > o["plain_to_draft"]["psnr_to_draft"] for _, o in rendered]
        adherent = [o["final"]["adherence"] is not None and o["draft"]["adherence"] is not None
                    and o["final"]["adherence"] >= o["draft"]["adherence"] - ADHERENCE_TOLERANCE for _, o in rendered]
        detailed = [f["detail"] >= plain_detail - DETAIL_TOLERANCE for f in finals]
        calls = mean([f["model_calls"] for f in finals])
        resumed_share = len(resumed) / len(finals) if finals else 0.0
        target_calls = CALL_TARGETS.get(mode, float(steps)) * steps / 30
        summary[mode] = {
            "drafts": len(rows), "finals": len(finals), "resumed": len(resumed),
            "mean_calls": None if calls is None else round(calls, 2),
            "mean_psnr": _mean_of(finals, "psnr"), "mean_ssim": _mean_of(finals, "ssim"),
            "mean_detail": _mean_of(finals, "detail"), "mean_adherence": _mean_of(finals, "adherence"),
            "mean_psnr_to_draft": _mean_of(finals, "psnr_to_draft"),
            "plain_mean_psnr_to_draft": _mean_of([o["plain_to_draft"] for _, o in rendered], "psnr_to_draft"),
            "targets": {"resumed_share": {"target": RESUMED_TARGET, "value": round(resumed_share, 3),
                                          "met": bool(finals) and resumed_share >= RESUMED_TARGET},
                        "mean_calls": {"target": round(target_calls, 2), "value": calls,
                                       "met": calls is not None and calls <= target_calls},
                        "at_least_as_adherent_as_draft": {"value": sum(adherent), "of": len(finals),
                                                          "met": bool(finals) and all(adherent)},
                        "detail_within_tolerance": {"value": sum(detailed), "of": len(finals),
                                                    "met": bool(finals) and all(detailed)},
                        "closer_to_draft_than_plain": {"value": sum(closer), "of": len(finals),
                                                       "met": bool(finals) and all(closer)}},
        }
    return summary


def _mean_of(records: list[dict[str, Any]], key: str) -> float | None:
    value = mean([r[key] for r in records if r.get(key) is not None])
    return None if value is None else round(value, 4)


def draft_final_markdown(summary: dict[str, Any], settings: dict[str, Any]) -> str:
    """The stream's table: per mode, the finals and how they compare with the plain full render and their drafts."""
    lines = [f"### draft-final: drafts at {settings['draft_steps']} steps, finals at {settings['steps']} "
             f"(cfg {settings['cfg']})", "",
             "| mode | finals (of drafts) | resumed | mean calls | PSNR to plain | SSIM | detail | adherence | "
             "PSNR to draft (plain full's) | targets met |", "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, row in summary.items():
        met = sum(t["met"] for t in row["targets"].values())
        lines.append(f"| {mode} | {row['finals']} ({row['drafts']}) | {row['resumed']} | {row['mean_calls']} | "
                     f"{row['mean_psnr']} dB | {row['mean_ssim']} | {row['mean_detail']} | {row['mean_adherence']} | "
                     f"{row['mean_psnr_to_draft']} dB ({row['plain_mean_psnr_to_draft']} dB) | "
                     f"{met} of {len(row['targets'])} |")
    return "\n".join(lines) + "\n"

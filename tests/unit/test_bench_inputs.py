"""The input distance benchmark runs end to end and bins what it measured (figures are not asserted: the full run is
a command, its tables in docs/measurements.md)."""

import pytest
import torch

from carnator_core.bench.inputs import RETOUCH_DISTANCES, Row, measure, summarise
from carnator_core.bench.probe import RELATIONS
from carnator_core.demo.wan_model import WanConfig, WanT2V
from carnator_core.judging.probe_thresholds import ProbeThresholds
from carnator_core.reuse.input_start import MAX_INPUT_DISTANCE


@pytest.mark.parametrize("handover", [False, True])
def test_every_pair_and_retouch_is_resumed_at_every_depth_and_binned(handover):
    model = WanT2V(WanConfig(dim=128, ffn_dim=256, num_layers=1)).eval()
    generator = torch.Generator().manual_seed(0)
    for parameter in model.parameters():  # the zero-initialised output head would predict x0 = x exactly
        parameter.data = torch.randn(parameter.shape, generator=generator) * 0.05
    rows = measure(model, pair_count=1, steps=6, denoise=0.5, depths=(0.34, 0.67), cfg_scale=3.0, seed=0,
                   handover=handover)
    assert len(rows) == 2 * (len(RELATIONS) + len(RETOUCH_DISTANCES))
    assert {row.depth for row in rows} == {1 / 3, 2 / 3}
    (unrelated,) = {row.distance for row in rows if row.relation == "unrelated"}
    retouched = [row.distance for row in rows if row.relation == "retouched"][::2]  # one per request
    # the set distances, as far as the unrelated clip lies (float16 rounding)
    assert retouched == pytest.approx([min(d, unrelated) for d in RETOUCH_DISTANCES], abs=0.01)
    assert all(row.screen_guidance is not None and row.probe_guidance is not None for row in rows)  # cfg 3: guided
    assert all(row.own_psnr_db > 0 and 0 <= row.own_adherence <= 1 for row in rows)
    summary = summarise(rows)
    assert sum(cell["resumes"] for cell in summary["bins"].values()) == len(rows)
    assert summary["shipped_bound"] == MAX_INPUT_DISTANCE


def _row(distance: float, structure: float, psnr: float) -> Row:
    return Row(relation="retouched", distance=distance, depth=0.5, screen_structure=structure, screen_guidance=None,
               probe_structure=structure, probe_guidance=None, psnr_db=psnr, ssim=1.0, adherence_plain=1.0,
               adherence_resumed=1.0, own_psnr_db=32.0, own_adherence=1.0)


def test_the_safe_bound_is_the_nearest_accepted_resume_that_was_not_good():
    rows = [_row(0.02, 0.99, 50.0), _row(0.2, 0.99, 35.0), _row(0.3, 0.99, 20.0), _row(0.4, 0.99, 40.0),
            _row(0.1, 0.5, 10.0)]
    summary = summarise(rows, ProbeThresholds())
    assert summary["safe_bound"] == 0.3 and summary["largest_good_accepted"] == 0.4
    assert summary["bins"]["0.3-0.4"] == {"pairs": 1, "relations": {"retouched": 1}, "resumes": 1, "accepted": 1,
                                          "accepted_good": 0, "accepted_borrowed": 0, "good": 0,
                                          "psnr_accepted_median": 20.0, "precision": 0.0}
    # a distance falls in the bin it opens; a resume that fails the screen is not accepted, whatever its quality
    assert summary["bins"]["0.1-0.2"] == {"pairs": 1, "relations": {"retouched": 1}, "resumes": 1, "accepted": 0,
                                          "accepted_good": 0, "accepted_borrowed": 0, "good": 0,
                                          "psnr_accepted_median": None, "precision": None}
    assert summary["bins"]["0.2-0.3"]["accepted_good"] == summary["bins"]["0.2-0.3"]["accepted_borrowed"] == 1
    assert summarise(rows[:2])["safe_bound"] is None

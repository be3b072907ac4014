"""`python -m carnator_core.bench screen` on a small index: every same-noise donor is screened, and one costs the
screen its step-0 record, not its checkpoints."""

from __future__ import annotations

import json

from carnator_core.bench import screen


def test_the_screen_bench_reads_a_step_0_record_per_donor(capsys):
    assert screen.main(["--entries", "2000", "--donors", "4", "12", "--repeats", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"entries", "latent_shape", "model_call_ms", "rows"} and result["model_call_ms"] > 0
    baseline, four, twelve = result["rows"]
    assert (baseline["donors"], baseline["screened"]) == (0, 0)
    assert (four["donors"], four["screened"], twelve["donors"], twelve["screened"]) == (4, 4, 12, 12)
    # the probe budget's donors are read whole either way; each further donor adds its step-0 record alone
    added = (twelve["bytes_read"] - four["bytes_read"]) / 8
    record = 2 * 16 * 5 * 16 * 16 + 2 * 16 * 5 * 8 * 8  # fp16: x0 at step 0, guidance at half resolution
    assert record <= added < record + 1024  # and the blob's header
    assert all(row["plan_ms"] > 0 and row["share_of_model_call_per_donor"] == row["ms_per_donor"] /
               result["model_call_ms"] for row in (four, twelve))

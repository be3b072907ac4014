"""The mask-transfer benchmark on the shipped demo model (figures not asserted: the full run is a command)."""

from __future__ import annotations

import json

from carnator_core.bench.__main__ import main as bench_main
from carnator_core.bench.masks import SOURCES


def test_masks_benchmark_runs_and_own_masks_bound_every_source(capsys):
    assert bench_main(["masks", "--n", "2", "--steps", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["rows"]) == 4
    for row in result["rows"]:
        # top-k blocks by the request's own mass hold the most of it: every other source can only lose
        assert all(row[source] <= row["own"] + 1e-6 for source in SOURCES), row
        assert abs(row["random"] - row["density"]) < 0.1, row  # random blocks hold about their share

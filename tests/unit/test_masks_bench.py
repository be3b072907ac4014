"""The mask-transfer benchmark on the shipped demo model (figures not asserted: the full run is a command); what
must hold whatever the figures: the documented JSON, recalls that are shares, and the orderings top-k implies."""

from __future__ import annotations

import itertools
import json

from carnator_core.bench.__main__ import main as bench_main
from carnator_core.bench.masks import BLOCK, DENSITIES, SIGMAS, SOURCES


def test_masks_benchmark_runs_and_own_masks_bound_every_source(capsys):
    assert bench_main(["masks", "--n", "2", "--steps", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"requests", "steps", "block_tokens", "rows"}
    assert (result["requests"], result["steps"], result["block_tokens"]) == (2, 4, BLOCK)
    rows = result["rows"]
    assert [(row["sigma"], row["density"]) for row in rows] == list(itertools.product(SIGMAS, DENSITIES))
    for row in rows:
        assert set(row) == {"sigma", "density", *SOURCES}
        assert 0 < row["density"] <= 1
        # recall: the share of the request's true attention mass the kept blocks hold
        assert all(0.0 <= row[source] <= 1.0 + 1e-6 for source in SOURCES), row
        # top-k blocks by the request's own mass hold the most of it: every other source can only lose
        assert all(row[source] <= row["own"] + 1e-6 for source in SOURCES), row
        assert abs(row["random"] - row["density"]) < 0.1, row  # random blocks hold about their share
    for sigma in SIGMAS:  # a source's top blocks at a lower density are among its top blocks at a higher one
        sparse, dense = (row for row in rows if row["sigma"] == sigma)
        assert all(dense[source] >= sparse[source] - 1e-6 for source in SOURCES if source != "random"), (sparse, dense)

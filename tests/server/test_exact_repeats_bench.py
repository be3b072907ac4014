"""`python -m carnator_core.bench exact-repeats` on a real headless ComfyUI with the demo model: every prompt queued
again is served as an exact repeat in at most two model calls, bit for bit the first run, and the table says so with
the entry's size."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.comfy_host import REPO_ROOT

from carnator_core.bench.tables.exact_repeats import exact_repeats_markdown

pytestmark = pytest.mark.server

STEPS = 8


def test_every_repeat_is_served_exactly_in_two_calls_at_most_and_the_table_says_what_an_entry_weighs():
    bench = subprocess.run([sys.executable, "-m", "carnator_core.bench", "exact-repeats", "--n", "2", "--steps",
                            str(STEPS), "--json"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert bench.returncode == 0, bench.stderr[-3000:]
    result = json.loads(bench.stdout)
    rows, summary = result["rows"], result["summary"]
    assert [row["verdict"] for row in rows] == ["exact repeat"] * 2, rows
    assert all(row["identical"] and row["plain_identical"] for row in rows)  # plain samples what the first run did
    assert all(row["repeat_calls"] <= 2 and row["plain_calls"] == STEPS <= row["first_calls"] <= STEPS + 1
               for row in rows), rows  # a first run's miss costs at most one call more
    assert summary["targets"]["at_most_two_calls"]["met"] and summary["targets"]["bit_identical"]["met"]
    assert summary["calls_ratio"] >= STEPS / 2
    # the output at full precision: 4 bytes per value of the demo latent (16 x 5 x 16 x 16), and a header
    assert 16 * 5 * 16 * 16 * 4 <= summary["final_bytes_per_entry"] < summary["bytes_per_entry"]
    assert summary["entries"] == 2  # a repeat records nothing
    table = exact_repeats_markdown(result)
    assert "| 2 of 2 | 2 of 2 |" in table and "x (" in table

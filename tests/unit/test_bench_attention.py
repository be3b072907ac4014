"""`python -m carnator_core.bench attention` on a tiny size: the JSON rows the README table is built from."""

from __future__ import annotations

import json

import pytest

from carnator_core.bench.attention import DENSITIES, HEAD_DIM, HEADS, main, video_layout


def test_json_rows_cover_every_density_with_correct_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--sizes", "1000", "--repeats", "1", "--threads", "1", "--json", "--block-size", "64"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"rows", "config"}
    config = report["config"]
    assert {key: config[key] for key in ("device", "backend", "dtype", "threads", "repeats", "block_size", "clock")} == {
        "device": "cpu", "backend": "auto", "dtype": "float32", "threads": 1, "repeats": 1, "block_size": 64,
        "clock": "wall"}
    assert len(config["loadavg_before"]) == len(config["loadavg_after"]) == 3
    rows = report["rows"]
    # 1000 tokens in blocks of 64 are 16 key blocks per row: each requested density keeps round(density x 16)
    assert [(row["n"], row["heads"], row["head_dim"]) for row in rows] == [(1000, HEADS, HEAD_DIM)] * len(DENSITIES)
    assert [row["density"] for row in rows] == [round(d * 16) / 16 for d in DENSITIES] == [0.125, 0.125, 0.25, 0.5]
    assert len({row["dense_s"] for row in rows}) == 1  # one dense timing per size, shared by its densities
    for row in rows:
        assert set(row) == {"n", "heads", "head_dim", "density", "dense_s", "sparse_s", "speedup", "ideal",
                            "max_abs_err"}
        assert 0 <= row["max_abs_err"] <= 1e-5
        assert 0 < row["density"] <= 1 and row["ideal"] == pytest.approx(1 / row["density"], rel=1e-2)
        # seconds are rounded to 4 decimals, the speedup (their ratio) to 2
        dense, sparse, half = row["dense_s"], row["sparse_s"], 0.5e-4
        assert dense > 0 and sparse > half
        assert (dense - half) / (sparse + half) - 0.005 <= row["speedup"] <= (dense + half) / (sparse - half) + 0.005


@pytest.mark.parametrize("density", [0.1, 0.125, 0.25, 0.5])
def test_video_layout_has_the_requested_density_band_and_sink(density: float) -> None:
    layout = video_layout(8192, 3, 128, density)
    blocks = layout.to_dense()
    assert layout.density() == pytest.approx(round(density * 64) / 64)
    assert blocks[..., 0].all(), "first-frame sink in every row"
    assert blocks.diagonal(dim1=-2, dim2=-1).all(), "local band includes the diagonal"

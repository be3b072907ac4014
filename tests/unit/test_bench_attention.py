"""`python -m carnator_core.bench attention` on a tiny size: the JSON rows the README table is built from."""

from __future__ import annotations

import json

import pytest

from carnator_core.bench.attention import main, video_layout


def test_json_rows_cover_every_density_with_correct_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--sizes", "1000", "--repeats", "1", "--threads", "1", "--json", "--block-size", "64"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["rows"]
    assert [row["n"] for row in rows] == [1000] * 4
    for row in rows:
        assert set(row) == {"n", "heads", "head_dim", "density", "dense_s", "sparse_s", "speedup", "ideal",
                            "max_abs_err"}
        assert row["max_abs_err"] <= 1e-5
        assert row["ideal"] == pytest.approx(1 / row["density"], rel=1e-2)


@pytest.mark.parametrize("density", [0.1, 0.125, 0.25, 0.5])
def test_video_layout_has_the_requested_density_band_and_sink(density: float) -> None:
    layout = video_layout(8192, 3, 128, density)
    blocks = layout.to_dense()
    assert layout.density() == pytest.approx(round(density * 64) / 64)
    assert blocks[..., 0].all(), "first-frame sink in every row"
    assert blocks.diagonal(dim1=-2, dim2=-1).all(), "local band includes the diagonal"

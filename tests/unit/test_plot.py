"""The yardstick panels: drawn with matplotlib where the `plot` extra is installed, else no file and None."""

from __future__ import annotations

from carnator_core.judging import plot


def test_the_yardstick_panels_are_a_png_with_matplotlib_and_nothing_without(tmp_path, monkeypatch):
    curve = [{"steps": steps, "model_calls": steps, "psnr": psnr, "detail": detail, "adherence": 0.98}
             for steps, psnr, detail in ((15, 35.0, 0.9), (22, 44.0, 0.97), (30, 100.0, 1.0))]
    points = [{"label": "fast: saves 1.30x (1.10–1.50x)", "model_calls": 22, "psnr": 28.5, "detail": 1.0,
               "adherence": 1.0}]
    path = plot.yardstick_panels(curve, points, tmp_path / "panels.png", "the yardstick")
    assert path == tmp_path / "panels.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setattr(plot, "pyplot", lambda: None)
    assert plot.yardstick_panels(curve, points, tmp_path / "none.png", "t") is None
    assert not (tmp_path / "none.png").exists()
    assert plot.plot_unavailable("plot") == "no plot: matplotlib is not installed; pip install 'carnator[plot]' " \
                                            "(matplotlib)"

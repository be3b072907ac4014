"""The benchmark scatter: drawn with matplotlib where the `plot` extra is installed, else no file and None."""

from __future__ import annotations

from carnator_core.bench import plot


def test_the_scatter_is_a_png_with_matplotlib_and_nothing_without(tmp_path, monkeypatch):
    configs = [{"name": name, "model_calls": calls, "psnr": psnr, "adherence": 0.98} for name, calls, psnr in (
        ("plain", 30, 100.0), ("plain-15", 15, 35.0), ("plain-10", 10, 31.0), ("fast", 22, 28.5))]
    path = plot.quality_against_calls(configs, tmp_path / "scatter.png", "quality vs model calls")
    assert path == tmp_path / "scatter.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setattr(plot, "pyplot", lambda: None)
    assert plot.quality_against_calls(configs, tmp_path / "none.png", "t") is None
    assert not (tmp_path / "none.png").exists()
    assert plot.plot_unavailable("scatter") == "no scatter: matplotlib is not installed; pip install 'carnator[plot]' " \
                                               "(matplotlib)"

"""The benchmark scatter: drawn with matplotlib where the `plot` extra is installed, else no file and None."""

from __future__ import annotations

from carnator_core.bench import plot


def test_the_scatter_is_a_png_with_matplotlib_and_nothing_without(tmp_path, monkeypatch):
    points = [("plain", 1.0, 0.9), ("carnator", 2.1, 0.88), ("nan", float("nan"), 0.5)]
    path = plot.scatter(points, tmp_path / "scatter.png", "speed vs quality", "speedup", "adherence")
    assert path == tmp_path / "scatter.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setattr(plot, "pyplot", lambda: None)
    assert plot.scatter(points, tmp_path / "none.png", "t", "x", "y") is None and not (tmp_path / "none.png").exists()
    assert plot.plot_unavailable("scatter") == "no scatter: matplotlib is not installed; pip install 'carnator[plot]' " \
                                               "(matplotlib)"

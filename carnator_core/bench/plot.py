"""Speed-versus-quality scatter (one labelled point per configuration) drawn with Pillow.

Pillow is already a dependency of the pack; a plotting library is not, and a dozen labelled points on two
linear axes do not need one.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

WIDTH, HEIGHT = 900, 600
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 80, 30, 50, 70
COLOURS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207))


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    return [lo + (hi - lo) * i / count for i in range(count + 1)]


def scatter(points: list[tuple[str, float, float]], path: Path, title: str, x_label: str, y_label: str,
            x_lines: tuple[float, ...] = (1.0,), y_lines: tuple[float, ...] = (),
            colour_by_label: bool = False) -> Path:
    """Write a PNG with one labelled point per (label, x, y); non-finite points are left out.

    `x_lines` and `y_lines` draw grey guides at those values (default: x = 1, a speedup of 1, as fast as plain);
    `colour_by_label` gives every point of one label one colour (a series), else each point its own.
    """
    points = [(label, x, y) for label, x, y in points if x == x and y == y and abs(x) != float("inf")]
    xs = [x for _, x, _ in points] or [1.0]
    ys = [y for _, _, y in points] or [1.0]
    x_lo, x_hi = min(0.0, min(xs)), max(xs) * 1.1 + 1e-9
    y_lo, y_hi = min(0.0, min(ys)), max(1.0, max(ys)) * 1.05
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    left, right, top, bottom = MARGIN_LEFT, WIDTH - MARGIN_RIGHT, MARGIN_TOP, HEIGHT - MARGIN_BOTTOM

    def px(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x_lo) / (x_hi - x_lo) * (right - left), bottom - (y - y_lo) / (y_hi - y_lo) * (bottom - top))

    draw.rectangle((left, top, right, bottom), outline="black")
    for x in _ticks(x_lo, x_hi):
        u, _ = px(x, y_lo)
        draw.line((u, bottom, u, bottom + 5), fill="black")
        draw.text((u - 12, bottom + 8), f"{x:.2f}", fill="black")
    for y in _ticks(y_lo, y_hi):
        _, v = px(x_lo, y)
        draw.line((left - 5, v, left, v), fill="black")
        draw.text((left - 45, v - 6), f"{y:.2f}", fill="black")
    for x in x_lines:
        if x_lo <= x <= x_hi:
            u, _ = px(x, y_lo)
            draw.line((u, top, u, bottom), fill=(200, 200, 200))
    for y in y_lines:
        if y_lo <= y <= y_hi:
            _, v = px(x_lo, y)
            draw.line((left, v, right, v), fill=(200, 200, 200))
    draw.text((left, 10), title, fill="black")
    draw.text(((left + right) / 2 - 60, HEIGHT - 30), x_label, fill="black")
    draw.text((8, top - 22), y_label, fill="black")
    series = list(dict.fromkeys(label for label, _, _ in points))
    for i, (label, x, y) in enumerate(points):
        u, v = px(x, y)
        colour = COLOURS[(series.index(label) if colour_by_label else i) % len(COLOURS)]
        draw.ellipse((u - 5, v - 5, u + 5, v + 5), fill=colour)
        draw.text((u + 8, v - 6 + (i % 3 - 1) * 10), label, fill=colour)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path

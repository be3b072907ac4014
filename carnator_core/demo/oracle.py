"""Quality oracle for the demo world: read background, object colour, shape and motion back from RGB frames.

Why render-and-compare: the world is fully known, so instead of a learned classifier the oracle estimates the
object's coverage from the two recovered colours, then asks which of the world's own shapes, rendered at the
measured centroid and area, explains that coverage best (on frames that show the object whole). Motion is the
centroid's mean velocity between visible frames, so an object that leaves the frame is still read right. A
prompt whose attributes the world does not know cannot be scored and is reported as such, never as wrong.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from carnator_core.demo import world

SHAPE_AREA = {"circle": math.pi, "square": 1.7**2, "triangle": 0.5 * 2 * 1.8}  # area / extent^2 in world.py
TRIANGLE_CENTROID_DY = 0.3  # centroid below the bounding-box centre, in extents
MIN_CONTRAST = 0.25  # RGB distance from the background that counts as object
MIN_AREA = 2.0  # latent pixels; below this there is no object
MAX_BORDER_COVERAGE = 0.5  # object pixels on the frame's edge below which the object is seen whole
STILL_FRACTION = 0.4  # travel below this share of the world's minimum travel counts as still


@dataclass(frozen=True)
class OracleResult:
    prompt: str
    expected: dict[str, str] | None  # None: the prompt is unscorable
    observed: dict[str, str]
    matches: dict[str, bool]

    @property
    def scorable(self) -> bool:
        return self.expected is not None

    @property
    def adherence(self) -> float | None:
        """Share of the four attributes that match the prompt; None when unscorable."""
        return sum(self.matches.values()) / len(world.ATTRIBUTES) if self.scorable else None


def _nearest(rgb: torch.Tensor, palette: dict[str, tuple[float, float, float]]) -> str:
    names = list(palette)
    dist = [float(torch.linalg.vector_norm(rgb - torch.tensor(palette[n]))) for n in names]
    return names[dist.index(min(dist))]


def _shape_error(shape: str, alpha: torch.Tensor, cx: float, cy: float, area: float) -> float:
    extent = math.sqrt(area / SHAPE_AREA[shape])
    if shape == "triangle":
        cy -= TRIANGLE_CENTROID_DY * extent
    template = world.shape_alpha(shape, cx, cy, extent, *alpha.shape)
    return float((alpha - template).abs().sum())


def _border(frame: torch.Tensor) -> torch.Tensor:
    """The outermost ring of pixels of one frame [H, W]."""
    return torch.cat([frame[0], frame[-1], frame[1:-1, 0], frame[1:-1, -1]])


def observe(rgb: torch.Tensor) -> dict[str, str]:
    """Attributes seen in a clip [3, F, H, W] with values in [0, 1]; 'none' where no object is visible."""
    rgb = rgb.float().clamp(0, 1)
    border = torch.cat([rgb[:, :, 0], rgb[:, :, -1], rgb[:, :, :, 0], rgb[:, :, :, -1]], dim=-1).reshape(3, -1)
    bg_name = _nearest(border.median(dim=1).values, world.BACKGROUNDS)
    bg = torch.tensor(world.BACKGROUNDS[bg_name]).view(3, 1, 1, 1)
    contrast = torch.linalg.vector_norm(rgb - bg, dim=0)
    missing = {"background": bg_name, "colour": "none", "shape": "none", "motion": "none"}
    if float((contrast > MIN_CONTRAST).sum()) < MIN_AREA * rgb.shape[1]:
        return missing
    core = contrast >= 0.7 * contrast.max()
    colour_name = _nearest(rgb[:, core].mean(dim=1), world.COLOURS)
    direction = torch.tensor(world.COLOURS[colour_name]).view(3, 1, 1, 1) - bg
    alpha = (((rgb - bg) * direction).sum(0) / direction.pow(2).sum()).clamp(0, 1)
    alpha = alpha * (contrast > MIN_CONTRAST / 2)  # ignore faint noise far from the object
    frames, height, width = alpha.shape
    ys = torch.arange(height, dtype=torch.float32).view(-1, 1) + 0.5
    xs = torch.arange(width, dtype=torch.float32).view(1, -1) + 0.5
    centroids: dict[int, tuple[float, float]] = {}
    for index, a in enumerate(alpha):
        area = float(a.sum())
        if area >= MIN_AREA:
            centroids[index] = (float((a * xs).sum()) / area, float((a * ys).sum()) / area)
    visible = sorted(centroids)
    if len(visible) < 2:
        return missing
    # Shape is judged on frames that show the whole object; the border clips it in the others (objects may
    # leave the frame), so those count only when no frame shows it whole.
    whole = [i for i in centroids if float(_border(alpha[i]).sum()) < MAX_BORDER_COVERAGE]
    judged = whole or [max(centroids, key=lambda i: float(alpha[i].sum()))]
    errors = {shape: sum(_shape_error(shape, alpha[i], *centroids[i], float(alpha[i].sum())) for i in judged)
              for shape in world.SHAPES}
    # Mean velocity between successive visible frames, not first-to-last travel: an object may leave the frame,
    # and a partly visible object's centroid lags its centre, but never points the other way.
    velocities = [((centroids[j][0] - centroids[i][0]) / (j - i), (centroids[j][1] - centroids[i][1]) / (j - i))
                  for i, j in itertools.pairwise(visible)]
    dx = sum(v[0] for v in velocities) / len(velocities) * (frames - 1)
    dy = sum(v[1] for v in velocities) / len(velocities) * (frames - 1)
    if max(abs(dx), abs(dy)) < STILL_FRACTION * world.MIN_SPEED * (frames - 1):
        motion = "still"
    elif abs(dx) >= abs(dy):
        motion = "right" if dx > 0 else "left"
    else:
        motion = "down" if dy > 0 else "up"
    return {"background": bg_name, "colour": colour_name, "shape": min(errors, key=errors.get), "motion": motion}


def score(prompt: str, rgb: torch.Tensor) -> OracleResult:
    """Compare what the clip shows with what the prompt asks for."""
    expected = world.parse_prompt(prompt)
    observed = observe(rgb)
    matches = {a: expected is not None and observed[a] == expected[a] for a in world.ATTRIBUTES}
    return OracleResult(prompt, expected, observed, matches)

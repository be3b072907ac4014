"""The demo model's synthetic world: one coloured shape moving over a plain background, rendered straight into
Wan 2.1 latent space.

Why it looks like this: the demo model has to be trainable on a CPU in hours and its outputs must be checkable by
a program (see `oracle.py`), so every clip is fully described by four words (shape, object colour, motion,
background) plus nuisance variation (position, size, speed). Objects are large relative to the 16 x 16 latent
frame and move at least 2 latent pixels (= one Wan patch) per latent frame so that shape and motion carry real
weight in the loss. Prompts come from templates with paraphrases and everyday synonyms so that text conditioning
has to generalise over wording, not memorise strings.

There is no VAE: a fixed linear map takes RGB to the 16 latent channels (decode = its pseudo-inverse). That map is
defined in the *model's* normalised latent space; `to_raw`/`from_raw` apply Wan 2.1's published latent statistics
so that what ComfyUI stores in a LATENT (the "raw" VAE space, converted by its Wan21 latent format) round-trips.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

SHAPES = ("circle", "square", "triangle")
COLOURS = {
    "red": (0.95, 0.1, 0.1),
    "green": (0.1, 0.8, 0.15),
    "blue": (0.15, 0.3, 1.0),
    "yellow": (1.0, 0.9, 0.1),
    "purple": (0.6, 0.15, 0.85),
}
BACKGROUNDS = {
    "black": (0.0, 0.0, 0.0),
    "gray": (0.5, 0.5, 0.5),
    "white": (1.0, 1.0, 1.0),
    "dark blue": (0.0, 0.05, 0.35),
}
MOTIONS = ("left", "right", "up", "down", "still")
ATTRIBUTES = ("shape", "colour", "motion", "background")

# Clip size in latent pixels (frames, height, width). 5 latent frames = 17 video frames at Wan's 4x temporal
# compression; 16 x 16 latent = 128 x 128 pixels at Wan's 8x spatial compression.
CLIP = (5, 16, 16)
MIN_SPEED = 2.0  # latent pixels per latent frame = one (1, 2, 2) patch
MAX_SPEED = 2.25
EXTENT = (3.0, 3.5)  # object half-width in latent pixels

# Wan 2.1 VAE latent statistics (mean, std per channel); ComfyUI's Wan21 latent format normalises with them.
WAN21_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
              0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN21_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
             3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)
LATENT_GAIN = 2.5  # makes normalised latent channels roughly unit-variance over the palette


def _rgb_basis() -> torch.Tensor:
    """Fixed 16x3 map with orthogonal columns: the same for every run, independent of torch's global RNG."""
    rng = np.random.default_rng(20250521)
    q, _ = np.linalg.qr(rng.standard_normal((16, 3)))
    return torch.tensor(q * LATENT_GAIN, dtype=torch.float32)


RGB_TO_LATENT = _rgb_basis()
LATENT_TO_RGB = torch.linalg.pinv(RGB_TO_LATENT)


def encode(rgb: torch.Tensor) -> torch.Tensor:
    """RGB in [0, 1], [..., 3, F, H, W] -> normalised latent [..., 16, F, H, W] (what the model sees)."""
    return torch.einsum("cj,...jfhw->...cfhw", RGB_TO_LATENT, rgb * 2 - 1)


def decode(latent: torch.Tensor) -> torch.Tensor:
    """Normalised latent [..., 16, F, H, W] -> RGB clamped to [0, 1]."""
    rgb = torch.einsum("jc,...cfhw->...jfhw", LATENT_TO_RGB.to(latent), latent)
    return ((rgb + 1) / 2).clamp(0, 1)


def _stats(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel Wan 2.1 statistics shaped for [..., 16, F, H, W]."""
    mean = torch.tensor(WAN21_MEAN, dtype=latent.dtype, device=latent.device).view(16, 1, 1, 1)
    std = torch.tensor(WAN21_STD, dtype=latent.dtype, device=latent.device).view(16, 1, 1, 1)
    return mean, std


def to_raw(latent: torch.Tensor) -> torch.Tensor:
    """Normalised latent [..., 16, F, H, W] -> ComfyUI LATENT space (inverse of Wan21.process_in)."""
    mean, std = _stats(latent)
    return latent * std + mean


def from_raw(raw: torch.Tensor) -> torch.Tensor:
    """ComfyUI LATENT [..., 16, F, H, W] -> normalised latent."""
    mean, std = _stats(raw)
    return (raw - mean) / std


@dataclass(frozen=True)
class Scene:
    """Everything that determines one clip."""

    shape: str
    colour: str
    motion: str
    background: str
    x: float  # object centre at frame 0, latent pixels
    y: float
    extent: float  # half-width
    speed: float  # latent pixels per latent frame

    def attributes(self) -> dict[str, str]:
        return {"shape": self.shape, "colour": self.colour, "motion": self.motion, "background": self.background}


def _direction(motion: str) -> tuple[float, float]:
    return {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0), "still": (0.0, 0.0)}[
        motion]


def centres(scene: Scene, frames: int) -> list[tuple[float, float]]:
    dx, dy = _direction(scene.motion)
    return [(scene.x + dx * scene.speed * f, scene.y + dy * scene.speed * f) for f in range(frames)]


OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up", "still": "still"}


def sample_scene(rng: np.random.Generator, clip: tuple[int, int, int] = CLIP, **fixed: str) -> Scene:
    """Random scene whose object is whole in the first frame; attributes in `fixed` are kept as given.

    Why the object may leave the frame: it travels about half the frame's width, so keeping it inside every
    frame ties its start to its direction (a left-mover must start near the right edge). A model trained on that
    learns "the start gives the direction" and ignores the motion word's sign. Here the start is drawn the same
    way for every motion, so only the prompt tells which way the object goes.
    """
    attrs = {
        "shape": fixed.get("shape") or SHAPES[rng.integers(len(SHAPES))],
        "colour": fixed.get("colour") or list(COLOURS)[rng.integers(len(COLOURS))],
        "motion": fixed.get("motion") or MOTIONS[rng.integers(len(MOTIONS))],
        "background": fixed.get("background") or list(BACKGROUNDS)[rng.integers(len(BACKGROUNDS))],
    }
    frames, height, width = clip
    extent = float(rng.uniform(*EXTENT))
    speed = 0.0 if attrs["motion"] == "still" else float(rng.uniform(MIN_SPEED, MAX_SPEED))
    x, y = (float(rng.uniform(extent, size - extent)) for size in (width, height))
    return Scene(x=x, y=y, extent=extent, speed=speed, **attrs)


def shape_alpha(shape: str, cx: float, cy: float, extent: float, height: int, width: int,
                supersample: int = 4) -> torch.Tensor:
    """Anti-aliased coverage [H, W] of one shape centred at (cx, cy) with half-width `extent`."""
    n = supersample
    ys = (torch.arange(height * n, dtype=torch.float32) + 0.5) / n - cy
    xs = (torch.arange(width * n, dtype=torch.float32) + 0.5) / n - cx
    y, x = torch.meshgrid(ys, xs, indexing="ij")
    if shape == "circle":
        inside = x * x + y * y <= extent * extent
    elif shape == "square":
        half = 0.85 * extent
        inside = (x.abs() <= half) & (y.abs() <= half)
    elif shape == "triangle":  # upright isosceles, width 2e, height 1.8e, centred on its bounding box
        half_h = 0.9 * extent
        inside = (y <= half_h) & (x.abs() <= extent * (y + half_h) / (2 * half_h))
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return inside.float().reshape(height, n, width, n).mean(dim=(1, 3))


def render(scene: Scene, clip: tuple[int, int, int] = CLIP) -> tuple[torch.Tensor, torch.Tensor]:
    """RGB clip [3, F, H, W] in [0, 1] and the object's coverage [F, H, W]."""
    frames, height, width = clip
    alpha = torch.stack([shape_alpha(scene.shape, cx, cy, scene.extent, height, width)
                         for cx, cy in centres(scene, frames)])
    bg = torch.tensor(BACKGROUNDS[scene.background]).view(3, 1, 1, 1)
    fg = torch.tensor(COLOURS[scene.colour]).view(3, 1, 1, 1)
    return bg + (fg - bg) * alpha[None], alpha


# ---------------------------------------------------------------------------------------------------------------
# Prompts

SHAPE_WORDS = {
    "circle": ("circle", "ball", "disc", "dot", "round shape"),
    "square": ("square", "box", "block", "cube", "square shape"),
    "triangle": ("triangle", "triangular shape", "wedge", "pyramid"),
}
COLOUR_WORDS = {
    "red": ("red", "crimson"),
    "green": ("green",),
    "blue": ("blue",),
    "yellow": ("yellow",),
    "purple": ("purple", "violet"),
}
BACKGROUND_WORDS = {
    "black": ("black",),
    "gray": ("gray", "grey"),
    "white": ("white",),
    "dark blue": ("dark blue", "navy"),
}
MOTION_PHRASES = {
    "left": ("moving left", "drifting leftwards", "sliding to the left", "going left", "travelling left",
             "heading left"),
    "right": ("moving right", "drifting rightwards", "sliding to the right", "going right", "travelling right",
              "heading right"),
    "up": ("moving up", "rising", "floating upwards", "going up", "drifting up", "climbing"),
    "down": ("moving down", "sinking", "falling", "going down", "dropping", "drifting down"),
    "still": ("staying still", "resting", "standing still", "not moving", "motionless", "sitting still"),
}
# The first entry of each table is the canonical wording (used by the curriculum and for evaluation).
TEMPLATES = (
    "a {colour} {shape} {motion} on a {background} background",
    "a {size} {colour} {shape} {motion} over {background}",
    "a {colour} {shape} {motion} against a {background} backdrop",
    "{background} background, a {colour} {shape} {motion}",
    "a {size} {colour} {shape} that is {motion}, {background} backdrop",
    "on a {background} background a {colour} {shape} is {motion}",
)
SIZE_WORDS = ("small", "big", "little", "large")


def canonical_prompt(attrs: dict[str, str]) -> str:
    return TEMPLATES[0].format(colour=attrs["colour"], shape=attrs["shape"], motion=MOTION_PHRASES[attrs["motion"]][0],
                               background=attrs["background"])


def paraphrase(attrs: dict[str, str], rng: np.random.Generator, variety: float = 1.0) -> str:
    """A random wording of `attrs`; `variety` in [0, 1] is the share of synonyms and templates beyond canonical."""

    def pick(options: tuple[str, ...]) -> str:
        if rng.random() >= variety:
            return options[0]
        return options[rng.integers(len(options))]

    template = pick(TEMPLATES)
    return template.format(colour=pick(COLOUR_WORDS[attrs["colour"]]), shape=pick(SHAPE_WORDS[attrs["shape"]]),
                           motion=pick(MOTION_PHRASES[attrs["motion"]]),
                           background=pick(BACKGROUND_WORDS[attrs["background"]]),
                           size=SIZE_WORDS[rng.integers(len(SIZE_WORDS))])


def _phrase_table() -> list[tuple[str, str, str]]:
    """(phrase, attribute, value) sorted longest first so 'dark blue' wins over 'blue'."""
    table = [(w, "shape", k) for k, ws in SHAPE_WORDS.items() for w in ws]
    table += [(w, "motion", k) for k, ws in MOTION_PHRASES.items() for w in ws]
    table += [(w, "colour", k) for k, ws in COLOUR_WORDS.items() for w in ws]
    table += [(w, "background", k) for k, ws in BACKGROUND_WORDS.items() for w in ws]
    extra_motion = {"left": ("leftwards", "leftward", "to the left"), "right": ("rightwards", "rightward", "to the right"),
                    "up": ("upwards", "upward", "ascending"), "down": ("downwards", "downward", "descending"),
                    "still": ("stationary", "static", "still")}
    table += [(w, "motion", k) for k, ws in extra_motion.items() for w in ws]
    return sorted(table, key=lambda t: -len(t[0]))


_PHRASES = _phrase_table()


def parse_prompt(text: str) -> dict[str, str] | None:
    """Recover the four attributes from a prompt, or None when the world cannot score it.

    Colour words before the shape word describe the object, colour words after it (or next to
    background/backdrop) the background; anything ambiguous, missing or unknown makes the prompt unscorable.
    """
    text = " " + re.sub(r"[^a-z ]+", " ", text.lower()) + " "
    found: list[tuple[int, str, str, str]] = []
    taken = [False] * len(text)
    for phrase, attr, value in _PHRASES:
        for m in re.finditer(r"(?<= )" + re.escape(phrase) + r"(?= )", text):
            if not any(taken[m.start():m.end()]):
                taken[m.start():m.end()] = [True] * (m.end() - m.start())
                found.append((m.start(), attr, value, phrase))
    found.sort()
    shapes = [f for f in found if f[1] == "shape"]
    motions = {f[2] for f in found if f[1] == "motion"}
    if len({f[2] for f in shapes}) != 1 or len(motions) != 1:
        return None
    shape_pos = shapes[0][0]
    bg_mentions = [m.start() for m in re.finditer(r"background|backdrop", text)]
    colours, backgrounds = set(), set()
    for pos, attr, value, phrase in found:
        if attr not in ("colour", "background"):
            continue
        near_bg = any(0 <= b - (pos + len(phrase)) <= 2 for b in bg_mentions)
        if pos < shape_pos and not near_bg:
            if attr != "colour":
                return None
            colours.add(value)
        else:
            backgrounds.add(value if attr == "background" else "unknown")
    if len(colours) != 1 or len(backgrounds) != 1 or "unknown" in backgrounds:
        return None
    return {"shape": shapes[0][2], "colour": colours.pop(), "motion": motions.pop(), "background": backgrounds.pop()}


def swap(attrs: dict[str, str], attribute: str, rng: np.random.Generator) -> dict[str, str]:
    """Same attributes with one changed to a different value (for sensitivity and wrong-prompt checks)."""
    values = {"shape": SHAPES, "colour": tuple(COLOURS), "motion": MOTIONS, "background": tuple(BACKGROUNDS)}[attribute]
    others = [v for v in values if v != attrs[attribute]]
    return {**attrs, attribute: others[rng.integers(len(others))]}


def all_attribute_sets() -> list[dict[str, str]]:
    return [{"shape": s, "colour": c, "motion": m, "background": b}
            for s in SHAPES for c in COLOURS for m in MOTIONS for b in BACKGROUNDS]


def pick_attribute_sets(rng: np.random.Generator, n: int) -> list[dict[str, str]]:
    """`n` different attribute sets drawn at random (one `rng.choice` without replacement over `all_attribute_sets`)."""
    sets = all_attribute_sets()
    return [sets[int(i)] for i in rng.choice(len(sets), n, replace=False)]


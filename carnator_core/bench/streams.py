"""Prompt streams for the workload benchmark, generated from the demo world.

Why these five: cross-request reuse pays off on near-duplicates (the prompt-editing loop), must cost nothing on
unrelated prompts, meets both in a realistic queue (mixed), and is most dangerous where prompts read alike but
ask for something else (adversarial: one word flips the motion or the object colour, so a text-similarity
decision reuses the wrong layout while a model-verified one must not), and the edit loop shows which kinds of edit
resume (rewordings and back-edits should; one-attribute edits only at a depth the probe verifies). Streams are deterministic for a seed and
never repeat a prompt verbatim (ComfyUI would serve a repeat from its output cache for every configuration).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from carnator_core.demo import world

STREAMS = ("near-dup", "unrelated", "mixed", "adversarial", "edit-loop")
# One scene, then the way people iterate on it with a fixed seed: rewordings, one-attribute edits, and back-edits
# (the scene again, in a new wording, after an edit); longer loops repeat the pattern after the scene.
EDIT_LOOP = ("scene", "rewording", "background", "back-edit", "colour", "back-edit", "shape", "rewording")
KINDED_STREAMS = ("edit-loop",)  # streams whose prompts have a kind of edit (`edit_kinds`)
OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}


def _distance(a: dict[str, str], b: dict[str, str]) -> int:
    return sum(a[k] != b[k] for k in world.ATTRIBUTES)


def _distinct_sets(rng: np.random.Generator, n: int, min_distance: int = 3) -> list[dict[str, str]]:
    """`n` attribute sets that pairwise differ in at least `min_distance` attributes (relaxed if impossible)."""
    sets = world.all_attribute_sets()
    order = rng.permutation(len(sets))
    chosen: list[dict[str, str]] = []
    for distance in range(min_distance, 0, -1):
        for i in order:
            if len(chosen) == n:
                return chosen
            if all(_distance(sets[i], c) >= distance for c in chosen) and sets[i] not in chosen:
                chosen.append(sets[i])
    return chosen


def _wording(rng: np.random.Generator, attrs: dict[str, str], taken: set[str]) -> str:
    """A paraphrase of `attrs` not used yet in this stream."""
    for _ in range(100):
        text = world.paraphrase(attrs, rng)
        if text not in taken:
            return text
    raise ValueError(f"no unused wording left for {attrs}")


def near_dup(n: int, rng: np.random.Generator) -> list[str]:
    """Groups of four around a few scenes: the scene, a paraphrase, a one-word edit (object colour or
    background), another paraphrase of the scene."""
    groups = _distinct_sets(rng, -(-n // 4))
    taken: set[str] = set()
    prompts: list[str] = []
    for attrs in groups:
        edit = world.swap(attrs, ("colour", "background")[int(rng.integers(2))], rng)
        for target in (attrs, attrs, edit, attrs):
            prompts.append(_wording(rng, target, taken))
            taken.add(prompts[-1])
    return prompts[:n]


def unrelated(n: int, rng: np.random.Generator) -> list[str]:
    """Every prompt a different scene (pairwise at least three of four attributes apart)."""
    taken: set[str] = set()
    prompts = []
    for attrs in _distinct_sets(rng, n):
        prompts.append(_wording(rng, attrs, taken))
        taken.add(prompts[-1])
    return prompts


def mixed(n: int, rng: np.random.Generator) -> list[str]:
    """Near-duplicates and unrelated prompts alternating, as in a shared queue."""
    dups = near_dup(-(-n // 2), rng)
    others = [p for p in unrelated(n, rng) if p not in dups][: n // 2]
    out = []
    for i in range(max(len(dups), len(others))):
        out += dups[i:i + 1] + others[i:i + 1]
    return out[:n]


def _twin_wordings(rng: np.random.Generator, attrs: dict[str, str], twin: dict[str, str]) -> list[str]:
    """Both attribute sets in one random wording; only the word(s) of the changed attribute differ.

    The motion tables list opposite directions in the same order ("drifting leftwards"/"drifting rightwards"),
    so one index picks matching phrases; colours use their plain word.
    """
    template = world.TEMPLATES[int(rng.integers(len(world.TEMPLATES)))]
    shape = world.SHAPE_WORDS[attrs["shape"]][int(rng.integers(len(world.SHAPE_WORDS[attrs["shape"]])))]
    background = world.BACKGROUND_WORDS[attrs["background"]][-1 if rng.random() < 0.5 else 0]
    motion = int(rng.integers(len(world.MOTION_PHRASES["left"])))
    size = world.SIZE_WORDS[int(rng.integers(len(world.SIZE_WORDS)))]
    return [template.format(colour=world.COLOUR_WORDS[a["colour"]][0], shape=shape, background=background,
                            motion=world.MOTION_PHRASES[a["motion"]][motion], size=size) for a in (attrs, twin)]


def adversarial(n: int, rng: np.random.Generator) -> list[str]:
    """Pairs worded identically except one word: the motion reversed, or another object colour."""
    prompts: list[str] = []
    for i, attrs in enumerate(_distinct_sets(rng, -(-n // 2))):
        if i % 2 == 0:
            attrs = {**attrs, "motion": "left" if attrs["motion"] == "still" else attrs["motion"]}
            twin = {**attrs, "motion": OPPOSITE[attrs["motion"]]}
        else:
            twin = world.swap(attrs, "colour", rng)
        prompts += _twin_wordings(rng, attrs, twin)
    return prompts[:n]


def edit_kinds(name: str, n: int) -> list[str]:
    """The kind of edit of each of the first `n` prompts of a kinded stream."""
    if name not in KINDED_STREAMS:
        raise ValueError(f"stream {name!r} has no kinds of edit")
    return [EDIT_LOOP[0]] + [EDIT_LOOP[1 + i % (len(EDIT_LOOP) - 1)] for i in range(n - 1)]


def edit_loop(n: int, rng: np.random.Generator) -> list[str]:
    """The edit loop (`EDIT_LOOP`) around one scene: every prompt a new wording; an edit changes one attribute
    (background, colour or shape) of the scene, a back-edit returns to the scene."""
    [scene] = _distinct_sets(rng, 1)
    taken: set[str] = set()
    prompts = []
    for kind in edit_kinds("edit-loop", n):
        target = world.swap(scene, kind, rng) if kind in world.ATTRIBUTES else scene
        prompts.append(_wording(rng, target, taken))
        taken.add(prompts[-1])
    return prompts


GENERATORS: dict[str, Callable[[int, np.random.Generator], list[str]]] = {
    "near-dup": near_dup, "unrelated": unrelated, "mixed": mixed, "adversarial": adversarial,
    "edit-loop": edit_loop}


def make_stream(name: str, n: int, seed: int = 0) -> list[str]:
    if name not in GENERATORS:
        raise ValueError(f"unknown stream {name!r}; choose one of {', '.join(STREAMS)}")
    if n < 1:
        raise ValueError("a stream needs at least one prompt")
    return GENERATORS[name](n, np.random.default_rng(seed))

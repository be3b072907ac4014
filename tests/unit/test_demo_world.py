"""Demo world and oracle: deterministic clips, synonym parsing, and an oracle that is right on ground truth."""

import numpy as np
import pytest
import torch

from carnator_core.demo import oracle, world


def _scenes(seed: int, n: int) -> list[world.Scene]:
    rng = np.random.default_rng(seed)
    return [world.sample_scene(rng) for _ in range(n)]


def test_world_is_deterministic_given_seed() -> None:
    a, b = _scenes(3, 5), _scenes(3, 5)
    assert a == b
    assert all(torch.equal(world.render(x)[0], world.render(y)[0]) for x, y in zip(a, b, strict=True))
    assert _scenes(4, 5) != a


def test_objects_start_whole_anywhere_and_move_at_least_one_patch_per_frame() -> None:
    frames, height, width = world.CLIP
    starts: dict[str, list[float]] = {"left": [], "right": []}
    for scene in _scenes(0, 400):
        _, alpha = world.render(scene)
        margin = 2 * height  # the same shape, at the same sub-pixel offset, on a canvas nothing can leave
        whole = world.shape_alpha(scene.shape, scene.x + margin, scene.y + margin, scene.extent, 5 * height, 5 * width)
        assert torch.isclose(alpha[0].sum(), whole.sum()), scene  # whole in the first frame
        xs = [c[0] for c in world.centres(scene, frames)]
        ys = [c[1] for c in world.centres(scene, frames)]
        step = max(abs(xs[1] - xs[0]), abs(ys[1] - ys[0]))
        assert step == 0 if scene.motion == "still" else step >= 2.0
        if scene.motion in starts:
            starts[scene.motion].append(scene.x)
    # The start says nothing about the direction (it did when objects had to stay inside: 3-4 vs 11.5-12.5).
    assert abs(np.mean(starts["left"]) - np.mean(starts["right"])) < 1.0
    assert min(starts["left"]) < 5 and max(starts["right"]) > 11


def test_latent_map_round_trips_through_comfy_latent_space() -> None:
    rgb, _ = world.render(_scenes(1, 1)[0])
    latent = world.encode(rgb)
    assert latent.shape == (16, *world.CLIP)
    assert torch.allclose(world.decode(world.from_raw(world.to_raw(latent))), rgb, atol=1e-5)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("a red circle moving left on a black background", ("circle", "red", "left", "black")),
        ("a small red ball drifting leftwards over black", ("circle", "red", "left", "black")),
        ("a big violet box sinking against a grey backdrop", ("square", "purple", "down", "gray")),
        ("navy background, a yellow block resting", ("square", "yellow", "still", "dark blue")),
        ("on a white background a green wedge is rising", ("triangle", "green", "up", "white")),
        ("a blue triangle sliding to the right on a dark blue background", ("triangle", "blue", "right", "dark blue")),
        ("a crimson dot falling over white", ("circle", "red", "down", "white")),
    ],
)
def test_prompt_parsing_understands_synonyms(prompt: str, expected: tuple[str, str, str, str]) -> None:
    assert world.parse_prompt(prompt) == dict(zip(("shape", "colour", "motion", "background"), expected, strict=True))


@pytest.mark.parametrize("prompt", ["a cat sleeping on a sofa", "a red circle on a black background",
                                    "an orange circle moving left on a black background",
                                    "a red circle and a blue square moving left on white"])
def test_unknown_or_ambiguous_prompts_are_unscorable(prompt: str) -> None:
    rgb, _ = world.render(_scenes(2, 1)[0])
    result = oracle.score(prompt, rgb)
    assert world.parse_prompt(prompt) is None and not result.scorable and result.adherence is None


def test_every_generated_wording_parses_back() -> None:
    rng = np.random.default_rng(5)
    for attrs in world.all_attribute_sets():
        assert world.parse_prompt(world.canonical_prompt(attrs)) == attrs
        assert world.parse_prompt(world.paraphrase(attrs, rng)) == attrs


def test_oracle_scores_ground_truth_one_and_wrong_prompts_low() -> None:
    rng = np.random.default_rng(11)
    for scene in _scenes(12, 120):
        attrs = scene.attributes()
        rgb = world.decode(world.from_raw(world.to_raw(world.encode(world.render(scene)[0]))))
        assert oracle.score(world.paraphrase(attrs, rng), rgb).adherence == 1.0, scene
        wrong = attrs
        for attribute in world.ATTRIBUTES:
            wrong = world.swap(wrong, attribute, rng)
            one_off = oracle.score(world.canonical_prompt(world.swap(attrs, attribute, rng)), rgb)
            assert one_off.adherence == 0.75 and not one_off.matches[attribute]
        assert oracle.score(world.canonical_prompt(wrong), rgb).adherence == 0.0


def test_oracle_reads_an_object_that_leaves_the_frame() -> None:
    """Motion from the visible frames' velocity and shape from the frames that show the object whole."""
    for shape in world.SHAPES:
        for motion, x, y in (("left", 4.0, 8.0), ("right", 12.0, 8.0), ("up", 8.0, 4.0), ("down", 8.0, 12.0)):
            scene = world.Scene(shape, "blue", motion, "white", x, y, extent=3.2, speed=2.2)
            rgb, alpha = world.render(scene)
            assert float(alpha[-1].sum()) < 1.0  # gone by the last frame
            assert oracle.observe(rgb) == scene.attributes() | {"background": "white"}


def test_oracle_reports_an_empty_clip_as_missing_object() -> None:
    rgb = torch.full((3, *world.CLIP), 0.5)
    observed = oracle.observe(rgb)
    assert observed["background"] == "gray" and observed["shape"] == observed["motion"] == "none"

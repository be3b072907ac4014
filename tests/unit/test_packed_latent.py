"""Packed latents (LTX-2's video and audio in one tensor): unpacked exactly, checked for consistency, and judged per
part by the probe, so a prompt that changes only the sound is not resumed on the picture's agreement."""

import math

import pytest
import torch

from carnator_core.calibration.session import structure_signal
from carnator_core.judging.probe_signals import ProbeSignals
from carnator_core.judging.probe_thresholds import ProbeThresholds
from carnator_core.reuse.packed_latent import packed_shapes, packing_error, unpack
from carnator_core.reuse.probe import probe_signals
from carnator_core.reuse.recording import RunRecorder
from carnator_core.store.tensor_codec import decode_tensors

SHAPES = ((2, 128, 2, 2, 2), (2, 8, 9, 16))


def _pack(parts: list[torch.Tensor]) -> torch.Tensor:
    """What the host's pack_latents does: each latent flattened per batch item, concatenated on the last axis."""
    return torch.cat([part.reshape(part.shape[0], 1, -1) for part in parts], dim=-1)


def _parts(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def test_unpack_returns_every_part_exactly():
    parts = _parts(0)
    packed = _pack(parts)
    assert packing_error(SHAPES, packed) == ""
    assert all(torch.equal(a, b) for a, b in zip(unpack(packed, SHAPES), parts, strict=True))


def test_packed_shapes_are_plain_tuples_and_a_single_latent_is_not_packed():
    assert packed_shapes([torch.Size(SHAPES[0]), torch.Size(SHAPES[1])]) == SHAPES
    assert packed_shapes([torch.Size(SHAPES[0])]) is None and packed_shapes(None) is None


@pytest.mark.parametrize(("packed", "expected"), [
    (torch.zeros(2, 1, sum(math.prod(s[1:]) for s in SHAPES) - 1), "add up to"),
    (torch.zeros(2, 2, 10), "is not (batch, 1, length)"),
    (torch.zeros(3, 1, sum(math.prod(s[1:]) for s in SHAPES)), "do not match its batch"),
])
def test_inconsistent_packing_is_named(packed, expected):
    assert expected in packing_error(SHAPES, packed)


def test_the_probe_judges_each_part_and_a_changed_sound_fails_it():
    state, donor = _pack(_parts(1)), _parts(2)
    same = probe_signals(0.5, state, _pack(donor), _pack(donor), None, None, SHAPES)
    assert same.structure_agreement == pytest.approx(1.0) and same.other_parts_agreement == (pytest.approx(1.0),)
    other_sound = [donor[0], _parts(3)[1]]  # the picture agrees, the sound does not
    signals = probe_signals(0.5, state, _pack(other_sound), _pack(donor), None, None, SHAPES)
    assert signals.structure_agreement == pytest.approx(1.0) and signals.other_parts_agreement[0] < 0.5
    thresholds = ProbeThresholds()
    assert thresholds.passes(same) and not thresholds.passes(signals) and thresholds.donor_hopeless(signals)
    assert "other_parts_agreement" not in ProbeSignals(0.5, 0.9, 0.9, None).as_dict()  # one latent: as before
    assert signals.as_dict()["other_parts_agreement"] == list(signals.other_parts_agreement)
    assert signals.weakest_structure == signals.other_parts_agreement[0]  # what the bar is compared with


def test_calibration_takes_the_weakest_part_as_the_structure_signal():
    """A calibration resume's structure signal is the bar's: the sound's agreement where it is the lower, NaN (which
    fails every bar) where any part's is."""
    probe = ProbeSignals(0.5, 0.9, 0.95, None, other_parts_agreement=(0.6,)).as_dict()
    assert structure_signal(probe) == 0.6
    assert structure_signal(ProbeSignals(0.5, 0.9, 0.95, None).as_dict()) == 0.95
    assert math.isnan(structure_signal({**probe, "other_parts_agreement": [float("nan")]}))
    # a guided step-0 screen is judged on its conditional branches' agreement
    screen = ProbeSignals(0.0, 0.5, 0.7, 0.9, conditional_agreement=0.93).as_dict()
    assert structure_signal(screen) == 0.93


def test_a_recorded_packed_checkpoint_comes_back_part_for_part_exactly():
    """Recorded (fp16, as every checkpoint) and read back from its blob, the packed state unpacks into each part's
    recorded values bit for bit: a resume restores video and audio together, never one part shifted into another."""
    parts = _parts(1)
    packed = _pack(parts)
    recorder = RunRecorder(checkpoint_steps={3})
    recorder.capture(3, 0.5, packed, packed * 0.5, guidance=None)
    _, blobs = recorder.blobs()
    restored = decode_tensors(blobs["checkpoints"])["x_3"]
    assert restored.shape == packed.shape and restored.dtype == torch.float16
    for part, recorded in zip(unpack(restored, SHAPES), parts, strict=True):
        assert torch.equal(part, recorded.to(torch.float16))

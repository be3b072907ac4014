"""The demo world's oracle, registered with the judging layer so that the calibration judges the demo model's clips
without importing the demo (`carnator_core.judging.clip_oracles`)."""

from __future__ import annotations

import torch

from carnator_core.demo import world
from carnator_core.demo.oracle import score
from carnator_core.judging.clip_oracles import ClipOracle, register

DEMO_DECODER = "CarnatorDemoDecode"  # decodes the demo model's latents: the demo world's oracle can score them


def demo_frames(latent: torch.Tensor) -> torch.Tensor:
    """The frames the demo world decodes from one saved latent: what its oracle scores and `bench workload` measures,
    not the 8-bit previews."""
    return world.decode(world.from_raw(latent))


DEMO_ORACLE = ClipOracle(name="demo", decoder=DEMO_DECODER, frames=demo_frames, score=score)


def register_demo_oracle() -> None:
    register(DEMO_ORACLE)

"""The oracles that judge a clip by what its prompt asks for, each registered by the side that has one.

Why a registry: only the demo model has an oracle (its synthetic world can read colour, shape and motion back from a
clip), and the calibration must not import the demo to use it. The demo registers its oracle under the decoder node its
graphs end in; the calibration asks for the oracle of the graph's decoder and judges without one where none is
registered. A graph's clip is what the oracle's `frames` makes of the run's saved latent, so that every tool measures
one picture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ClipOracle:
    name: str  # how reports name it ("demo")
    decoder: str  # the node class whose graphs it judges: their latents are its world's
    frames: Callable[[Any], Any]  # one latent of the batch (a tensor) -> the frames it scores
    score: Callable[[str, Any], Any]  # (prompt, frames) -> a verdict with an `adherence` in [0, 1]


_registered: dict[str, ClipOracle] = {}


def register(oracle: ClipOracle) -> None:
    """Make `oracle` the judge of graphs that decode with its decoder (registering it again changes nothing)."""
    _registered[oracle.decoder] = oracle


def oracle_for(decoder: str | None) -> ClipOracle | None:
    """The oracle registered for graphs decoded by the node class `decoder`; None where there is none."""
    return _registered.get(decoder) if decoder is not None else None

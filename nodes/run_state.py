"""Carnator's per-run state in ComfyUI's `transformer_options`: one object under one key for the life of one run.

Every Carnator hook of a sampling run finds what it needs here: the reuse holder, the sparse-attention run, the block
being evaluated, the attention override it chains to, whether the run was handed back to plain sampling. The options
are cloned per run (`nodes.host.per_run_options`, as EasyCache does) and the clones share this object by reference, so
what one hook sets the others read, and it is gone with the run's clones. Each part is set by the wrapper that owns it
and put back in its `finally`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from carnator_core.attention.sparse_attention import SparseAttentionRun

from .keys import RUN_KEY
from .reuse_holder import ReuseHolder


@dataclass
class CarnatorRun:
    """What Carnator keeps for one sampling run."""

    reuse: ReuseHolder | None = None  # the run's reuse holder, where a reuse node samples it
    attention: SparseAttentionRun | None = None  # the run's sparse attention, where an attention node installed it
    block: int | None = None  # the transformer block being evaluated (Carnator's block patches set it)
    previous_override: Callable | None = None  # the attention override that was on the hook before Carnator's
    withdraw: Callable[[], None] | None = None  # takes Carnator's override off the run's options (where it was hooked)

    @property
    def sampling_plain_again(self) -> bool:
        """Whether a Carnator error handed the run back to plain sampling: every Carnator hook passes through."""
        return self.reuse is not None and self.reuse.sampling_plain_again


def run_state(options: dict) -> CarnatorRun | None:
    """The run's state in these transformer options, None outside a Carnator run."""
    state = options.get(RUN_KEY)
    return state if isinstance(state, CarnatorRun) else None


@contextlib.contextmanager
def carnator_run(*options: dict) -> Iterator[CarnatorRun]:
    """The run's state, shared by every one of `options` (the run's own clones): the one they hold, or a new one put
    into each for the body and taken out in `finally`."""
    state = next((found for found in map(run_state, options) if found is not None), None) or CarnatorRun()
    added = [each for each in options if each.get(RUN_KEY) is not state]
    held = [(each, each.get(RUN_KEY)) for each in added]
    for each in added:
        each[RUN_KEY] = state
    try:
        yield state
    finally:
        for each, before in held:
            if before is None:
                each.pop(RUN_KEY, None)
            else:
                each[RUN_KEY] = before

"""The names of an entry's tensors inside its blobs: the one scheme the recorder writes and the planner, the history
replay and the stage hand-over read.

A checkpoint at step k keeps its state, the model's prediction there and its guidance; step 0's record (in the blob
`start`) keeps the prediction and guidance, and, for a run from an input, the state, the input and a guide image. A
multistep sampler's predictions before the deepest checkpoint are kept apart, in the blob `HISTORY_BLOB`.
"""

from __future__ import annotations

END_TENSOR = "end"  # a stage's output in its checkpoint blob (`carnator_core.reuse.trajectory`)
INPUT_TENSOR = "input"  # a run's input latent in its step-0 blob (`carnator_core.reuse.input_start`)
GUIDE_TENSOR = "guide"  # the image its conditioning carried, in the same blob
HISTORY_BLOB = "history"  # the sampler's predictions before the deepest checkpoint (`history_replay`)


def state_tensor(step: int) -> str:
    """The state the model was evaluated at."""
    return f"x_{step}"


def prediction_tensor(step: int) -> str:
    """The model's (guided) prediction of the clean latent there."""
    return f"x0_{step}"


def guidance_tensor(step: int) -> str:
    """The guidance there (cond - uncond), pooled."""
    return f"g_{step}"


def history_tensor(step: int) -> str:
    """A multistep sampler's prediction at a step before the deepest checkpoint, in `HISTORY_BLOB`."""
    return f"p_{step}"

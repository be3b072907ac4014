"""Start a headless ComfyUI with the pack and the demo weights, for `demo run` and the workload benchmark.

Why a wrapper around `client.headless_server`: both commands must fail early with a message that says
exactly what to do (which variable to set, which command trains the weights) instead of a traceback from
inside ComfyUI, and both need the weights file visible to the stock UNETLoader under a known name.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from carnator_core.client import ComfyClient, free_port, headless_server
from carnator_core.comfyui_location import find_comfyui
from carnator_core.demo.wan_model import WEIGHTS_PATH

WEIGHTS_ENV = "CARNATOR_DEMO_WEIGHTS"
TRAIN_COMMAND = "python -m carnator_core.demo.train && python -m carnator_core.demo.train --export"


class DemoSetupError(RuntimeError):
    """Something the user has to provide is missing; the message says what to do."""


def demo_weights(explicit: str | Path | None = None) -> Path:
    """The demo model file: `explicit`, else $CARNATOR_DEMO_WEIGHTS, else the weights shipped in the package."""
    source = "--weights" if explicit else WEIGHTS_ENV if os.environ.get(WEIGHTS_ENV) else None
    path = Path(explicit or os.environ.get(WEIGHTS_ENV) or WEIGHTS_PATH).expanduser()
    if path.is_file():
        return path.resolve()
    where = f"{source}={path}" if source else str(path)
    raise DemoSetupError(f"demo model weights not found ({where} does not exist). Train and export them with:\n"
                         f"    {TRAIN_COMMAND}\n"
                         f"or point --weights / {WEIGHTS_ENV} at a Carnator demo .safetensors file.")


def pick_port(preferred: int | None) -> tuple[int, str]:
    """`preferred` if free, else another free port, with a note saying so."""
    port = free_port(preferred)
    note = f"port {preferred} is in use; using {port}" if preferred and port != preferred else ""
    return port, note


@contextmanager
def demo_server(base_dir: Path, weights: Path, port: int | None = None, extra_args: tuple[str, ...] = (),
                env: dict[str, str] | None = None) -> Iterator[tuple[ComfyClient, str]]:
    """A headless ComfyUI on `base_dir` with the pack and `weights` linked in; yields (client, unet_name).

    `extra_args` go to ComfyUI's command line, `env` into its environment. The server's log is
    `base_dir/comfyui.log`.
    """
    find_comfyui()  # fail with the message before creating anything
    models = base_dir / "models" / "diffusion_models"
    models.mkdir(parents=True, exist_ok=True)
    link = models / weights.name
    if not link.exists():
        link.symlink_to(weights)
    with headless_server(base_dir, port=port, log_path=base_dir / "comfyui.log", extra_args=extra_args,
                         env=env) as client:
        yield client, weights.name

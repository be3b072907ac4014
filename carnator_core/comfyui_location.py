"""Where the ComfyUI checkout is: $COMFYUI_PATH, else the tree this pack sits in, else ~/ComfyUI.

The one lookup for the demo, the benchmarks, the test harness and `.ci/run`. Standard library only, so
`.ci/run` can run this file as a script before any environment exists: it prints the checkout, or says
why there is none and exits 1.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

_PACK_DIRS = (Path(os.path.abspath(__file__)).parents[1], Path(__file__).resolve().parents[1])  # as linked, as stored
SET_IT = "Set COMFYUI_PATH to your ComfyUI directory (0.3.64 or newer), e.g. export COMFYUI_PATH=~/ComfyUI"


class ComfyNotFound(RuntimeError):
    """No usable ComfyUI checkout; the message says where it looked and what to set."""


def is_comfyui(path: Path) -> bool:
    return (path / "main.py").is_file() and (path / "nodes.py").is_file() and (path / "comfy").is_dir()


def find_comfyui(environ: Mapping[str, str] | None = None) -> Path:
    """The ComfyUI checkout; an explicit COMFYUI_PATH that is not one is an error, not a cue to look elsewhere."""
    environ = os.environ if environ is None else environ
    explicit = environ.get("COMFYUI_PATH")
    if explicit:
        path = Path(explicit).expanduser()
        if is_comfyui(path):
            return path.resolve()
        raise ComfyNotFound(f"COMFYUI_PATH={explicit} is not a ComfyUI checkout (no main.py, nodes.py and comfy/ "
                            f"there). {SET_IT}")
    candidates = [pack.parent.parent for pack in _PACK_DIRS if pack.parent.name == "custom_nodes"]
    candidates.append(Path.home() / "ComfyUI")
    for path in candidates:
        if is_comfyui(path):
            return path.resolve()
    raise ComfyNotFound(f"No ComfyUI checkout found (looked at {', '.join(str(p) for p in candidates)}). {SET_IT}")


if __name__ == "__main__":
    try:
        print(find_comfyui())
    except ComfyNotFound as error:
        sys.exit(f"error: {error}")

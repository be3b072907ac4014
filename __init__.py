"""Carnator: cross-request reuse for text-to-video generation in ComfyUI.

ComfyUI loads this file as the custom-node entry point. The engine packages
(`carnator_core`, `kernels`) are imported as top-level packages, so the pack's own
directory goes on `sys.path` once; `nodes/` is imported relatively because ComfyUI
already owns a top-level module called `nodes`.
"""

import os
import sys

_PACK_DIR = os.path.dirname(os.path.abspath(__file__))
if _PACK_DIR not in sys.path:
    sys.path.insert(0, _PACK_DIR)

from .nodes import comfy_entrypoint  # noqa: E402

WEB_DIRECTORY = "./web"

__all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]

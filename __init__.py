"""Carnator: cross-request reuse for text-to-video generation in ComfyUI.

ComfyUI loads this file as the custom-node entry point. The engine (`carnator_core`, attention
kernels included as `carnator_core.kernels`) is a top-level package, so the pack's own directory
goes on `sys.path` once, at the end: the pack's `tests` and `web` folders never shadow an
installed package of that name for the other packs in the process.
`nodes/` is imported relatively (ComfyUI already owns a top-level module called `nodes`) and only
when ComfyUI asks for the extension, so importing this package outside a ComfyUI host (pytest
collecting the repository, say) has no side effects.
"""

import os
import sys

_PACK_DIR = os.path.dirname(os.path.abspath(__file__))
if _PACK_DIR not in sys.path:
    sys.path.append(_PACK_DIR)

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    """V3 entry point: the ComfyExtension listing every Carnator node."""
    from .nodes import CarnatorExtension

    return CarnatorExtension()

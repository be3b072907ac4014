"""Host-agnostic Carnator engine. Never imports ComfyUI: `nodes/` is the only place that does.

The attention math lives in the pack's top-level `kernels/` folder and is imported here as
`carnator_core.kernels`, never as a top-level `kernels`: that name belongs to whatever package
of that name is installed (Hugging Face's `kernels`, which transformers probes for, is one), and
a ComfyUI pack must not shadow other packages for every pack in the process.
"""

import importlib.util
import os
import sys
import types

__version__ = "0.1.0"


def _import_kernels() -> types.ModuleType:
    name = f"{__name__}.kernels"
    if name in sys.modules:
        return sys.modules[name]
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


kernels = _import_kernels()

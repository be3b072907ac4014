"""Host-agnostic Carnator engine. Never imports ComfyUI: `nodes/` is the only place that does.

The attention math lives here, in `carnator_core.kernels`, and not in a top-level `kernels` package:
that name belongs to whatever package of that name is installed (Hugging Face's `kernels`, which
transformers probes for, is one), and a ComfyUI pack must not shadow other packages for every pack
in the process.
"""

__version__ = "0.1.0"

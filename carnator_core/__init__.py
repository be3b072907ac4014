"""Host-agnostic Carnator engine. Never imports ComfyUI: `nodes/` is the only place that does."""

__version__ = "0.1.0"

"""Calibration on the user's own model: forced resumes through ComfyUI's queue, thresholds fitted to a quality
target, and the per-model profile the reuse nodes use when their thresholds are left to `auto`."""

"""Borrowed block-sparse attention: masks, per-head hysteresis, one sparse attention run."""

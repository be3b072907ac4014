"""Benchmarks: performance as ratios measured in one run, never as timed tests."""

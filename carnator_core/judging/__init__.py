"""What judges a resume: the probe's signals and thresholds, plain at fewer steps, and the calibration profile.

Why a folder of its own, below every other: the store checks the profiles it holds, the reuse settings judge by one,
and the benchmarks and calibration measure and fit them, so these types import nothing else of carnator_core.
"""

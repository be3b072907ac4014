"""The quality target: when a resume counts as good against the new prompt's plain clip.

On its own because the inputs benchmark, the calibration command and the Calibrate node build one apart from any
profile.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QualityTarget:
    """When a resume counts as good: its clip within `psnr_db` of the new prompt's plain clip and at least `ssim`
    similar to it. The fit keeps at least `precision` of accepted resumes good."""

    psnr_db: float = 30.0
    ssim: float = 0.95
    precision: float = 0.95

    def good(self, psnr_db: float, ssim: float) -> bool:
        return psnr_db >= self.psnr_db and ssim >= self.ssim

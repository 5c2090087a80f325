"""Order statistics of repeated measurements (quote the median, show p10/p90)."""

from __future__ import annotations

import statistics
from typing import Sequence


def spread(samples: Sequence[float]) -> dict[str, float]:
    """Median, min, max, p10, p90 of repeated measurements (quote the median)."""
    s = sorted(samples)
    if not s:
        raise ValueError("spread() needs at least one sample")

    def q(p: float) -> float:
        return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]

    return {"median": statistics.median(s), "min": s[0], "max": s[-1], "p10": q(0.1), "p90": q(0.9)}

"""Order statistics of repeated measurements (quote the median, show p10/p90)."""

from __future__ import annotations

import math
import statistics
from typing import Sequence


def spread(samples: Sequence[float]) -> dict[str, float]:
    """Median, min, max, p10, p90 of repeated measurements (quote the median).

    Every sample must be a finite number: a NaN or infinite sample (a failed or overflowed
    measurement) or one too large for a float is refused with a ValueError naming its position
    (and the sample, where it is small enough to show), never summarised
    (NaN has no place in an order, so it would make the statistics depend on the samples' order).

    p10 and p90 are samples, picked symmetrically: of the ``n`` sorted samples, p10 is the one at
    rank ``k`` from the bottom and p90 the one at rank ``k`` from the top, with ``k`` the nearest
    integer to ``0.1 * (n - 1)`` and a tie (``n - 1`` ending in 5) going to the outer sample, so
    the reported spread is never narrower than the nearest ranks give (n <= 5: min and max;
    n = 11: the 2nd smallest and the 2nd largest).
    """
    samples = list(samples)
    if not samples:
        raise ValueError("spread() needs at least one sample")
    for i, x in enumerate(samples):
        try:
            finite = math.isfinite(x)
        except TypeError:
            raise TypeError(f"spread(): sample {i} is {x!r}, not a number") from None
        except OverflowError:  # an int (or fraction) beyond the float range: its repr may be huge
            raise ValueError(f"spread(): sample {i} (type {type(x).__name__}) is too large for a float; every "
                             f"sample must be a finite number") from None
        if not finite:
            raise ValueError(f"spread(): sample {i} is {x!r}; every sample must be a finite number "
                             f"(drop failed measurements before summarising, and report how many)")
    s = sorted(samples)
    n = len(s)
    k = (n + 3) // 10  # round(0.1 * (n - 1)) with a tie rounded down, in exact integer arithmetic
    return {"median": statistics.median(s), "min": s[0], "max": s[-1], "p10": s[k], "p90": s[n - 1 - k]}

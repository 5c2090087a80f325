"""LHD (Beckmann, Chen and Cidon, "LHD: Improving Cache Hit Rate by Maximizing Hit Density",
NSDI '18), on the learning machinery it shares with QuillHD (``quillcache.policies.quillhd``).

LHD evicts the object with the lowest *hit density*: the expected hits it will still get divided
by the expected cache space-time it will still use, estimated online per class and age from
histograms of the ages at which objects hit or were evicted (EWMA-decayed every ``period``
references). What is LHD's here: classes by the object's last reuse distance (class 0 = first
reference, 1 = a gap below 128 references since the previous reference, then one class per
factor of 4 of that gap, 8 classes: the paper's "classify by reuse distance"), the estimator, and
no request hints (LHD knows nothing of prefixes or partial blocks).

Adaptations, stated: the ranking is learned on *ghost* ages (every reference ends a lifetime,
cached or not, with an adaptive horizon as in QuillHD), and the victim is the lowest-density
head among the 8 class lists (each in LRU order) instead of LHD's 64 random samples: the same
estimator, a deterministic candidate set of one per class. Defaults (period 4096, decay 0.9,
quantile 0.95, che_mult 1) are QuillHD's, not re-tuned.
"""

from __future__ import annotations

from quillcache.policies.quillhd import QuillHdPolicy


class LhdPolicy(QuillHdPolicy):
    name = "lhd"

    def __init__(self, *, capacity_keys: int | None = None, period: int = 4096, decay: float = 0.9,
                 quantile: float = 0.95, che_mult: float = 1.0) -> None:
        super().__init__(capacity_keys=capacity_keys, mode="hd", period=period, decay=decay, quantile=quantile,
                         che_mult=che_mult, classes="reuse", leaf_first=False)

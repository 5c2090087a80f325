"""Which objects an eviction takes (Mooncake's near-LRU, made exact and deterministic).

Candidates are COMPLETE objects whose read lease is over (``now >= lease_end_s``) and that are not
hard-pinned. First pass: those not soft-pinned (or whose soft pin's TTL is over); second pass: the
soft-pinned ones. Within a pass the order is (last access, key) ascending — least recently read
first, ties broken by key so the order is part of the contract. Victims are taken until their
bytes (``alloc_bytes`` × replicas) reach the target. PENDING objects are never candidates.
"""

from __future__ import annotations

from collections.abc import Iterable

from quillcache.master.table import ObjectRecord
from quillcache.master.types import ObjectStatus, PinKind

__all__ = ["choose_victims"]

_COMPLETE = int(ObjectStatus.COMPLETE)
_HARD = int(PinKind.HARD)
_SOFT = int(PinKind.SOFT)


def choose_victims(objects: Iterable[ObjectRecord], now: float, target_bytes: int) -> list[str]:
    """Keys to evict, in eviction order (module docstring). O(n log n) over the objects."""
    first, second = [], []
    for obj in objects:
        if obj.status != _COMPLETE or obj.pin == _HARD or now < obj.lease_end_s:
            continue
        (second if obj.pin == _SOFT and now < obj.soft_pin_end_s else first).append(obj)
    order = lambda o: (o.last_access_s, o.key)  # noqa: E731
    chosen, freed = [], 0
    for obj in sorted(first, key=order) + sorted(second, key=order):
        if freed >= target_bytes:
            break
        chosen.append(obj.key)
        freed += obj.alloc_bytes * len(obj.replicas)
    return chosen

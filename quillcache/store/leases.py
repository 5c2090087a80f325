"""Pins and read leases of the data plane (Mooncake semantics, REFERENCE §4).

- A **read lease** ``lease(key, ttl_s)`` sets ``lease_end_s = max(old, now + ttl_s)``; while
  ``now < lease_end_s`` the block is in use. Leases are how zero-copy readers keep a DRAM view
  valid: a leased block is never evicted, deleted or demoted.
- A **hard pin** is a counter (``pin``/``unpin`` pairs, like a ``ref_cnt``): a hard-pinned block
  is never evicted, deleted or demoted.
- A **soft pin** lasts ``soft_pin_ttl_s`` from the latest ``pin(key, hard=False)`` (Mooncake: 30
  min by default) or until ``unpin(key, hard=False)``. Explicit deletes and demotions refuse a
  soft-pinned block; eviction takes soft-pinned blocks only after every unpinned, unleased one
  (a second pass).

Time comes from the injected ``clock`` (seconds), so tests drive it. Records whose pins and
lease are all over are dropped lazily. This table knows nothing of tiers: the data plane asks
``in_use_reason(key)`` before deletes/demotions and uses ``evictable(key, allow_soft)`` as the
eviction policies' predicate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from quillcache._checks import check_float

__all__ = ["HoldTable"]


@dataclass(slots=True)
class _Hold:
    hard_pins: int = 0
    soft_pin_end_s: float = -math.inf
    lease_end_s: float = -math.inf


def check_ttl(ttl_s: object, what: str = "ttl_s") -> float:
    """A positive, finite number of seconds, as a float."""
    return check_float(what, ttl_s, 0.0, lo_open=True)


class HoldTable:
    """Pins and leases per key, against an injected clock."""

    def __init__(self, clock: Callable[[], float], *, soft_pin_ttl_s: float = 1800.0) -> None:
        if not callable(clock):
            raise TypeError(f"clock must be callable, got {type(clock).__name__}")
        self._clock = clock
        self.soft_pin_ttl_s = check_ttl(soft_pin_ttl_s, "soft_pin_ttl_s")
        self._holds: dict[Hashable, _Hold] = {}

    def now(self) -> float:
        return float(self._clock())

    # ---- changes --------------------------------------------------------------------------
    def pin(self, key: Hashable, *, hard: bool = True) -> None:
        h = self._holds.setdefault(key, _Hold())
        if hard:
            h.hard_pins += 1
        else:
            h.soft_pin_end_s = self.now() + self.soft_pin_ttl_s

    def unpin(self, key: Hashable, *, hard: bool = True) -> None:
        h = self._holds.get(key)
        now = self.now()
        if hard:
            if h is None or h.hard_pins == 0:
                raise ValueError(f"block {_name(key)} is not hard-pinned; unpin(hard=True) has nothing to undo")
            h.hard_pins -= 1
        else:
            if h is None or h.soft_pin_end_s <= now:
                raise ValueError(f"block {_name(key)} is not soft-pinned (or its soft pin expired)")
            h.soft_pin_end_s = -math.inf
        self._maybe_drop(key, h, now)

    def lease(self, key: Hashable, ttl_s: float) -> float:
        """Grant or extend a read lease; returns the lease's end time."""
        ttl = check_ttl(ttl_s)
        h = self._holds.setdefault(key, _Hold())
        h.lease_end_s = max(h.lease_end_s, self.now() + ttl)
        return h.lease_end_s

    def forget(self, key: Hashable) -> None:
        """Drop every hold of a key that left the node."""
        self._holds.pop(key, None)

    def clear(self) -> None:
        self._holds.clear()

    def _maybe_drop(self, key: Hashable, h: _Hold, now: float) -> None:
        if h.hard_pins == 0 and h.soft_pin_end_s <= now and h.lease_end_s <= now:
            del self._holds[key]

    # ---- queries --------------------------------------------------------------------------
    def hard_pins(self, key: Hashable) -> int:
        h = self._holds.get(key)
        return 0 if h is None else h.hard_pins

    def lease_end_s(self, key: Hashable) -> float | None:
        """The end of the key's lease if one is in force now, else None."""
        h = self._holds.get(key)
        return h.lease_end_s if h is not None and h.lease_end_s > self.now() else None

    def in_use_reason(self, key: Hashable) -> str | None:
        """Why the key may not be deleted/demoted now ("hard-pinned x2", "leased until ..."), or None."""
        h = self._holds.get(key)
        if h is None:
            return None
        now = self.now()
        why = []
        if h.hard_pins:
            why.append(f"hard-pinned x{h.hard_pins}")
        if h.soft_pin_end_s > now:
            why.append(f"soft-pinned for {h.soft_pin_end_s - now:.3f} s more")
        if h.lease_end_s > now:
            why.append(f"leased for {h.lease_end_s - now:.3f} s more")
        if not why:
            del self._holds[key]
            return None
        return ", ".join(why)

    def evictable(self, key: Hashable, allow_soft: bool = False) -> bool:
        h = self._holds.get(key)
        if h is None:
            return True
        now = self._clock()
        if h.hard_pins or h.lease_end_s > now:
            return False
        return allow_soft or h.soft_pin_end_s <= now

    def __len__(self) -> int:
        return len(self._holds)


def _name(key: Hashable) -> str:
    hexer = getattr(key, "hex", None)
    return hexer() if callable(hexer) else repr(key)

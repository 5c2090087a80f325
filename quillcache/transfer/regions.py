"""Registered memory regions: the only bytes a transfer engine ever reads from or writes into.

Invariants:
- ``register`` keeps a memoryview of the caller's buffer (C-contiguous, cast to bytes); nothing is
  copied, so a transfer lands in, or leaves from, the caller's memory itself.
- ``checkout(region_id, offset, length, write=...)`` hands out a view of exactly
  ``[offset, offset + length)`` after checking the region exists, the range lies inside it and, for a
  write, that the region is writable; anything else raises ``RegionError`` naming the region and range.
  A checked-out range counts as in use until its ``release``.
- ``unregister`` waits (up to a timeout) for in-flight users of the region and then forgets it; a
  region in use past the timeout is not removed (``RegionError``), so no transfer ever touches a
  buffer its owner believes is free.
- Region ids are never reused within one table, and fit the wire's u32. They count up from 1, or from
  where ``start_ids_at`` put them: a process serving at a fixed address starts at a random id so that a
  peer's region id from an EARLIER process at that address names no region here (its stale transfer is
  refused, instead of landing in memory the new process hands out); ``TransferEngine`` does so whenever
  its backend serves at a fixed address.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from quillcache._checks import check_int
from quillcache.transfer.types import RegionDescriptor, RegionError, RemoteRegion

__all__ = ["MAX_REGION_ID", "RegionTable", "as_region_view"]

MAX_REGION_ID = (1 << 32) - 1  # region ids are u32 on the wire


def as_region_view(buffer: object) -> memoryview:
    """A flat byte view of ``buffer`` (anything with the buffer protocol), or ``TypeError``/``RegionError``."""
    try:
        mv = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"a region must support the buffer protocol, got {type(buffer).__name__}") from None
    if not mv.c_contiguous:
        raise RegionError("a region must be C-contiguous")
    if mv.itemsize != 1 or mv.ndim != 1 or mv.format not in ("B", "b", "c"):
        mv = mv.cast("B")
    if mv.nbytes == 0:
        raise RegionError("a region must hold at least one byte")
    return mv


@dataclass
class _Region:
    desc: RegionDescriptor
    view: memoryview
    users: int = 0


class RegionTable:
    """Region id → buffer, with range checks and in-use counts (thread-safe)."""

    def __init__(self) -> None:
        self._regions: dict[int, _Region] = {}
        self._next_id = 1
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # unregister waits on it for in-flight users
        self._waiting = 0

    def start_ids_at(self, first: int) -> None:
        """Number the regions registered from now on from ``first`` (or from the next id, if that is higher:
        ids are never reused); ``first`` in [1, MAX_REGION_ID]."""
        first = check_int("first region id", first, 1, MAX_REGION_ID)
        with self._lock:
            self._next_id = max(self._next_id, first)

    def register(self, buffer: object, *, name: str = "", writable: bool | None = None) -> RegionDescriptor:
        mv = as_region_view(buffer)
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        if writable is None:
            writable = not mv.readonly
        elif writable and mv.readonly:
            raise RegionError(f"region {name!r}: writable=True for a read-only buffer")
        with self._cond:
            if name and any(r.desc.name == name for r in self._regions.values()):
                raise RegionError(f"a region named {name!r} is already registered")
            if self._next_id > MAX_REGION_ID:
                raise RegionError(f"region ids are exhausted (the next would be {self._next_id} > {MAX_REGION_ID})")
            desc = RegionDescriptor(self._next_id, mv.nbytes, name, bool(writable))
            self._next_id += 1
            self._regions[desc.region_id] = _Region(desc, mv)
        return desc

    def unregister(self, region: RegionDescriptor | int, *, timeout_s: float = 30.0) -> None:
        rid = region.region_id if isinstance(region, RegionDescriptor) else check_int("region", region, 0)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if rid not in self._regions:
                raise RegionError(f"no region {rid} is registered")
            while self._regions[rid].users:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RegionError(f"region {rid} still has {self._regions[rid].users} transfers in flight")
                self._waiting += 1
                try:
                    self._cond.wait(left)
                finally:
                    self._waiting -= 1
            self._regions.pop(rid).view.release()

    def describe(self) -> list[RemoteRegion]:
        with self._cond:
            return [RemoteRegion(r.desc.region_id, r.desc.length_bytes, r.desc.name, r.desc.writable)
                    for r in self._regions.values()]

    def checkout(self, region_id: int, offset: int, length: int, *, write: bool) -> memoryview:
        """A view of ``[offset, offset+length)``; the range counts as in use until ``release(region_id)``."""
        with self._lock:
            r = self._regions.get(region_id)
            if r is None:
                raise RegionError(f"no region {region_id} is registered", "no_region")
            if offset < 0 or length <= 0 or offset + length > r.desc.length_bytes:
                raise RegionError(f"range [{offset}, {offset + length}) lies outside region {region_id} "
                                  f"of {r.desc.length_bytes} bytes", "out_of_range")
            if write and not r.desc.writable:
                raise RegionError(f"region {region_id} is read-only", "read_only")
            r.users += 1
            return r.view[offset:offset + length]

    def release(self, region_id: int) -> None:
        with self._lock:
            r = self._regions.get(region_id)
            if r is not None:
                r.users -= 1
                if not r.users and self._waiting:
                    self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._regions.clear()  # views in flight stay valid (they hold the buffer); new checkouts fail

    def __len__(self) -> int:
        return len(self._regions)

"""``LocalCache``: the pool client's DRAM, one registered buffer carved by an ``OffsetAllocator``.

Why not a ``LocalKvStore``: a store's ``put`` copies the caller's bytes in; the pool client instead
READs a remote object straight into this buffer (the transfer lands where the object will live) and
stages a put's bytes here once before WRITEing them to every replica, so a get or put costs no extra
copy. The buffer is registered with the client's transfer engine once.

Invariants:
- Every range handed out (an :class:`Alloc`) is exclusively its holder's until freed; ranges never
  overlap (the allocator's contract).
- Cached objects (``insert``) are kept in LRU order and counted against ``cache_bytes``; inserting past
  it evicts the least recently used unpinned entries. ``cache_bytes == 0`` caches nothing (the buffer is
  then only staging).
- A view handed to a caller (``export``) pins its range: the range is not freed or reused while any
  view of it (or a slice of one) is alive; an entry evicted or dropped while pinned is freed when its last
  view goes. So a returned ``memoryview`` never changes under its holder. A call that finds or caches an
  entry and returns a view of it (``lookup``, ``insert_and_export``) pins it in the same critical section:
  an entry is never evictable between being found (or cached) and being pinned.
- Thread-safe (one lock); view releases are queued and applied at the next call (a release may happen
  in any thread, at any time).
"""

from __future__ import annotations

import collections
import mmap
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np

from quillcache.alloc import OffsetAllocator, OutOfSpaceError

__all__ = ["Alloc", "LocalCache"]

PAGE_BYTES = 4096
ALIGN_BYTES = 64


@dataclass(eq=False)
class Alloc:
    """A range of the cache buffer: ``[offset, offset + size)``."""

    offset: int
    size: int
    handle: int
    key: str | None = None
    payload_bytes: int = 0
    cached: bool = False
    freed: bool = False
    exporter: weakref.ref | None = field(default=None, repr=False)

    def pinned(self) -> bool:
        ref = self.exporter
        return ref is not None and ref() is not None


class LocalCache:
    """See the module docstring. ``buffer_bytes`` = the registered buffer; ``cache_bytes`` = LRU budget."""

    def __init__(self, buffer_bytes: int, cache_bytes: int) -> None:
        buffer_bytes = max(PAGE_BYTES, -(-int(buffer_bytes) // PAGE_BYTES) * PAGE_BYTES)
        self.buffer_bytes = buffer_bytes
        self.cache_bytes = max(0, int(cache_bytes))
        self._mm = mmap.mmap(-1, buffer_bytes)
        self._arr = np.frombuffer(self._mm, dtype=np.uint8)
        self._arr[::PAGE_BYTES] = 0  # touch every page now
        self.view = memoryview(self._arr)
        max_allocs = max(64, min(1 << 20, buffer_bytes // 4096))
        self._alloc = OffsetAllocator(buffer_bytes, max_allocs, alignment=ALIGN_BYTES)
        self._lru: collections.OrderedDict[str, Alloc] = collections.OrderedDict()
        self._cached_bytes = 0
        self._released: collections.deque[Alloc] = collections.deque()
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- internals (lock held)
    def _drain(self) -> None:
        while self._released:
            a = self._released.popleft()
            if not a.cached and not a.freed and not a.pinned():
                self._free(a)

    def _free(self, a: Alloc) -> None:
        if not a.freed:
            a.freed = True
            self._alloc.free(a.handle)

    def _evict_one(self) -> bool:
        for key, a in self._lru.items():
            if not a.pinned():
                del self._lru[key]
                a.cached = False
                self._cached_bytes -= a.size
                self._free(a)
                return True
        return False

    # ---------------------------------------------------------------- API
    def allocate(self, size: int) -> Alloc | None:
        """A fresh range of ``size`` bytes (evicting unpinned cached entries as needed), or None when
        nothing can make room (too big, or everything pinned)."""
        with self._lock:
            self._drain()
            while True:
                try:
                    a = self._alloc.allocate(size)
                    return Alloc(int(a.offset), int(size), int(a.handle))
                except OutOfSpaceError:
                    if not self._evict_one():
                        return None
                except ValueError:
                    return None

    def release(self, a: Alloc) -> None:
        """Give back a range that was never exported nor cached (a failed read, a finished staging)."""
        with self._lock:
            if not a.cached and not a.pinned():
                self._free(a)

    def _export_locked(self, a: Alloc, nbytes: int) -> memoryview:
        ex = a.exporter() if a.exporter is not None else None
        if ex is None:
            ex = self._arr[a.offset:a.offset + nbytes]
            a.exporter = weakref.ref(ex, lambda _r, a=a, q=self._released: q.append(a))
        view = memoryview(ex).toreadonly()
        return view[:nbytes] if nbytes != view.nbytes else view

    def export(self, a: Alloc, nbytes: int) -> memoryview:
        """A read-only view of the first ``nbytes`` of ``a`` that pins it (module docstring). ``a`` must be
        the caller's (allocated, or pinned by a view it holds): an unpinned cached entry may already be
        evicted, so cache-then-view is ``insert_and_export``."""
        with self._lock:
            return self._export_locked(a, nbytes)

    def writable(self, a: Alloc) -> memoryview:
        return self.view[a.offset:a.offset + a.size]

    def insert(self, key: str, a: Alloc, payload_bytes: int) -> bool:
        """Keep ``a`` (holding ``key``'s verified framed bytes) as the cached copy; False (and ``a``
        stays the caller's) when it does not fit the budget or caching is off."""
        with self._lock:
            return self._insert_locked(key, a, payload_bytes)

    def insert_and_export(self, key: str, a: Alloc, payload_bytes: int) -> memoryview:
        """``insert`` then ``export`` of the first ``payload_bytes`` in ONE critical section: the view pins
        ``a`` before any other thread can evict it (cached or not, ``a`` is freed when its last view goes)."""
        with self._lock:
            self._insert_locked(key, a, payload_bytes)
            return self._export_locked(a, payload_bytes)

    def _insert_locked(self, key: str, a: Alloc, payload_bytes: int) -> bool:
        self._drain()
        if a.size > self.cache_bytes or key in self._lru:
            return False
        while self._cached_bytes + a.size > self.cache_bytes:
            if not self._evict_one():
                return False
        a.key, a.payload_bytes, a.cached = key, payload_bytes, True
        self._lru[key] = a
        self._cached_bytes += a.size
        return True

    def lookup(self, key: str) -> memoryview | None:
        """The cached payload of ``key`` (a pinning read-only view; most recently used now) or None."""
        with self._lock:
            a = self._lru.get(key)
            if a is None:
                return None
            self._lru.move_to_end(key)
            return self._export_locked(a, a.payload_bytes)  # pinned before the lock goes: never evicted unpinned

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._lru

    def drop(self, key: str) -> bool:
        """Forget ``key``'s cached copy (freed now, or when its last view goes)."""
        with self._lock:
            a = self._lru.pop(key, None)
            if a is None:
                return False
            a.cached = False
            self._cached_bytes -= a.size
            if not a.pinned():
                self._free(a)
            return True

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def __len__(self) -> int:
        return len(self._lru)

    def close(self) -> None:
        with self._lock:
            self._lru.clear()
        # the mmap stays mapped while exported views exist (numpy holds it); dropping our refs is enough
        self.view = None  # type: ignore[assignment]

"""Accounting layout of the SSD tier (``SsdTier(..., account_only=True)``): offsets, no files.

For trace replays at million-block scale (like SGLang's ``create_simulated``): every block still
gets a real ``(segment_id, offset_bytes, size_bytes)`` from an ``OffsetAllocator`` per virtual
slab. Capacity, footprints (4 KiB pages) and the largest block (``BlockTooLargeError`` above
``min(max_block_bytes or slab_bytes, slab_bytes, capacity)``) are those of the slab layout, and the
``SsdTier`` code path above it (staging, group commit, deletes, pending-delete space reuse) is the
same. What differs: the virtual slabs are as large as the allocator allows (16 TiB), not
``slab_bytes``, so placement and the fragmentation-only ``StoreFullError`` of many small slabs
are not reproduced (per-slab node pools sized to ``slab_bytes`` would cost memory in proportion to
the capacity declared). What is skipped: the directory, files, fsyncs, the log and crc32c.

Invariants: a live block's page range never overlaps another's in the same virtual slab; a
range is reused only after ``release`` (the tier calls it once a delete is "committed", which in
this layout is immediate). Reads return zero bytes (there are none); nothing is durable and
nothing survives ``close`` (there is no recovery in this mode). A virtual slab's allocator is
made when a block first needs it: memory is O(slabs in use + live blocks), never O(capacity).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from quillcache import alloc as _alloc
from quillcache.store.errors import StoreFullError
from quillcache.store.keys import StoreKey
from quillcache.store.ssd_format import PAGE_BYTES, BlockRecord, SsdTuning

__all__ = ["AccountLayout"]

_MAX_NODES_PER_SLAB = 1 << 20  # live blocks + free regions one virtual slab can track


def _round_up(n: int) -> int:
    return -(-n // PAGE_BYTES) * PAGE_BYTES


class AccountLayout:
    """Virtual slabs carved by ``OffsetAllocator``; called by ``SsdTier`` with its lock held."""

    name = "account"

    def __init__(self, capacity_bytes: int, tuning: SsdTuning) -> None:
        self.capacity_bytes = capacity_bytes // PAGE_BYTES * PAGE_BYTES
        self.tuning = tuning
        max_slab = _alloc.MAX_UNITS * PAGE_BYTES
        self._max_slab = max_slab
        self._num_slabs = -(-self.capacity_bytes // max_slab)
        self.slabs: list[_alloc.OffsetAllocator] = []  # made on first use (see _open_slab)
        biggest = min(self.capacity_bytes, max_slab, tuning.slab_bytes)  # the slab layout's limit
        self.max_block_bytes = min(tuning.max_block_bytes or biggest, biggest)
        self._zeros: memoryview | None = None

    def _slab_bytes(self, no: int) -> int:
        return min(self._max_slab, self.capacity_bytes - no * self._max_slab)

    def _open_slab(self) -> "_alloc.OffsetAllocator | None":
        """The next virtual slab's allocator, made when a block first needs it, so the layout costs
        memory for the slabs in use, not for the capacity declared; None when all are open."""
        no = len(self.slabs)
        if no >= self._num_slabs:
            return None
        size = self._slab_bytes(no)
        units = size // PAGE_BYTES
        a = _alloc.OffsetAllocator(size, min(2 * units + 8, _MAX_NODES_PER_SLAB), alignment=PAGE_BYTES)
        self.slabs.append(a)
        return a

    def stage(self, key: StoreKey, data: memoryview, crc: int) -> BlockRecord:
        size = len(data)
        no = 0
        while True:
            a = self.slabs[no] if no < len(self.slabs) else self._open_slab()
            if a is None:
                break
            try:
                x = a.allocate(size)
            except _alloc.AllocatorError:
                no += 1
                continue
            return BlockRecord(no, x.offset, size, crc, handle=x.handle)
        raise StoreFullError(f"SSD tier (account only): no room for a {size} B block {key.hex()} "
                             f"(capacity {self.capacity_bytes} B, {self.free_bytes()} B free)")

    def commit(self, puts: list, deletes: list) -> None:
        """Nothing to make durable: there are no files."""

    def after_commit(self, live: dict) -> None:
        """No log to rotate."""

    def release(self, recs: Iterable[BlockRecord]) -> None:
        for r in recs:
            if r.handle >= 0:
                self.slabs[r.segment_id].free(r.handle)
                r.handle = -1

    abort = release

    def zero_view(self, size: int) -> memoryview:
        """A read-only view of ``size`` zero bytes (a shared buffer that only grows)."""
        z = self._zeros
        if z is None or z.nbytes < size:
            z = self._zeros = memoryview(np.zeros(size, dtype=np.uint8)).toreadonly()
        return z[:size]

    def read_into(self, rec: BlockRecord, out: memoryview) -> int:
        out[: rec.size_bytes] = self.zero_view(rec.size_bytes)
        return rec.size_bytes

    @staticmethod
    def footprint_bytes(size_bytes: int) -> int:
        """Bytes of capacity one block of ``size_bytes`` takes (whole pages, as the slab layout)."""
        return _round_up(size_bytes)

    def free_bytes(self) -> int:
        unopened = sum(self._slab_bytes(no) for no in range(len(self.slabs), self._num_slabs)) if \
            len(self.slabs) < self._num_slabs else 0
        return sum(a.storage_report().total_free_bytes for a in self.slabs) + unopened

    def close(self) -> None:
        self.slabs = []
        self._zeros = None

"""DRAM byte store: preallocated, pre-touched segments, each carved by an ``OffsetAllocator``.

``LocalKvStore`` keeps immutable KV blocks (``StoreKey`` → bytes) in a few large DRAM segments
(numpy ``uint8`` arrays). Every page of a segment is written once at creation, so a put never
pays first-touch page faults (REFERENCE §6: copying into fresh pages is far slower than into
touched memory; ``results/store_dram`` compares a put with memcpy into touched memory). Byte ranges inside a segment are handed out by the O(1)
``quillcache.alloc.OffsetAllocator``.

Invariants:
- A stored block occupies exactly one range ``[offset_bytes, offset_bytes + size_bytes)`` of one
  segment; ranges of live blocks never overlap (the allocator's contract). ``location_of(key)``
  reports that range; it is what the residency index records.
- Blocks are immutable: a put of a stored key raises ``BlockExistsError``; the range is only
  reused after ``delete``.
- ``put`` copies the caller's bytes into the segment with ONE memcpy (memoryview slice
  assignment), no intermediate ``bytes``. ``get`` is zero-copy: it returns a read-only memoryview
  into the segment, valid until the key is deleted (after that its range may hold another
  block). Callers that keep bytes longer use ``get_into`` or copy. The data plane guards views
  with leases (see ``quillcache.store.dataplane``).
- With ``checksum=True`` a crc32c of the block is computed at put and checked by
  ``get(..., verify=True)``/``get_into(..., verify=True)``; a mismatch drops the block and raises
  ``CorruptBlockError``: corrupt bytes are never returned.
- A failed call changes nothing (``put_many`` is all-or-nothing).
- ``used_bytes`` counts allocated bytes (block sizes rounded up to ``alignment_bytes``), so
  ``used_bytes + free_bytes == capacity_bytes``; ``stored_bytes`` counts the blocks' own sizes.

Memory: a segment's allocator is made when a block first needs that segment, so bookkeeping
costs O(segments in use + live blocks), never O(declared capacity).

Accounting mode (``account_only=True``, like SGLang's ``create_simulated``: the trace harness at
million-block scale). Offsets and sizes go through the same ``OffsetAllocator`` code path
(``put``/``delete``/``location_of``/capacity and every error are identical), but no segment
buffer is allocated and ``put`` copies nothing (it still validates the buffer it is given, so a
caller may pass any buffer of the block's size). ``get`` returns a read-only view of the block's
size over a shared ZERO-FILLED buffer (not the bytes that were put: there are none), and
``get_into`` zero-fills the destination. ``checksum=True`` is refused in this mode (there is
nothing to checksum). The mode is fixed at construction and reported by ``account_only``.

Not thread-safe beyond the GIL: callers serialize (the data plane does).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import crc32c as _crc
import numpy as np

from quillcache._checks import check_int
from quillcache.alloc import OffsetAllocator, OutOfSpaceError
from quillcache.alloc.buffers import aligned_empty
from quillcache.store.errors import (
    BlockExistsError,
    BlockNotFoundError,
    BlockTooLargeError,
    CorruptBlockError,
    StoreClosedError,
    StoreFullError,
)
from quillcache.store.keys import StoreKey

__all__ = ["DramStoreConfig", "LocalKvStore", "Location", "as_byte_view"]

PAGE_BYTES = 4096
MAX_BLOCK_BYTES = (1 << 32) - 1  # the residency index records sizes as uint32


class Location(NamedTuple):
    """Where a block's bytes are: ``[offset_bytes, offset_bytes + size_bytes)`` of a segment."""

    segment_id: int
    offset_bytes: int
    size_bytes: int


@dataclass(frozen=True, kw_only=True)
class DramStoreConfig:
    """Shape of a ``LocalKvStore``. ``segment_bytes`` defaults to min(capacity, 1 GiB)."""

    capacity_bytes: int
    segment_bytes: int
    alignment_bytes: int = 64
    max_blocks_per_segment: int = 65536
    checksum: bool = False
    pretouch: bool = True
    account_only: bool = False

    @property
    def num_segments(self) -> int:
        return -(-self.capacity_bytes // self.segment_bytes)


@dataclass(slots=True)
class _Slot:
    """One stored block (hot record)."""

    segment_id: int
    offset_bytes: int
    size_bytes: int
    handle: int
    crc: int  # crc32c of the bytes, -1 when checksums are off


def as_byte_view(data: object, what: str = "data") -> memoryview:
    """``data`` (bytes, bytearray, memoryview, numpy array, any C-contiguous buffer) as a flat
    unsigned-byte memoryview over the same memory, without copying. TypeError for a non-buffer
    (str included) and for a buffer of Python object pointers (a numpy object array), ValueError
    for a non-contiguous or empty buffer."""
    if isinstance(data, str):
        raise TypeError(f"{what} must be a bytes-like buffer, got str (encode it first)")
    if isinstance(data, np.ndarray) and data.dtype.hasobject:
        # its buffer holds PyObject pointers: storing them would store addresses, not data
        raise TypeError(f"{what} is a numpy array of dtype {data.dtype} (Python object pointers, not bytes); "
                        "pass a numeric array or bytes")
    try:
        mv = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be a bytes-like buffer, got {type(data).__name__}") from None
    if mv.format in ("O", "P") or "O" in mv.format:
        raise TypeError(f"{what} is a buffer of Python object pointers (format {mv.format!r}), not bytes")
    if not mv.c_contiguous:
        raise ValueError(f"{what} is a non-contiguous buffer (shape {mv.shape}, strides {mv.strides}); pass a contiguous copy")
    if mv.nbytes == 0:
        raise ValueError(f"{what} is empty (0 bytes); a KV block has at least one byte")
    if mv.ndim != 1 or mv.format != "B":
        try:
            mv = mv.cast("B")
        except TypeError:  # e.g. 0-d views or exotic formats: go through numpy, still no copy
            mv = memoryview(np.frombuffer(data, dtype=np.uint8))  # type: ignore[arg-type]
    return mv


def _check_key(key: object) -> StoreKey:
    if not isinstance(key, StoreKey):
        raise TypeError(f"key must be a StoreKey, got {type(key).__name__} {key!r}")
    return key


class LocalKvStore:
    """Immutable KV blocks in pre-touched DRAM segments (see the module docstring).

    ``LocalKvStore(capacity_bytes, *, segment_bytes=None, alignment_bytes=64,
    max_blocks_per_segment=65536, checksum=False, pretouch=True, account_only=False)``. A block
    must fit one segment (else ``BlockTooLargeError``); placement is first fit by segment id.
    ``account_only=True``: offsets without bytes (module docstring, "Accounting mode").
    """

    def __init__(self, capacity_bytes: int, *, segment_bytes: int | None = None, alignment_bytes: int = 64,
                 max_blocks_per_segment: int = 65536, checksum: bool = False, pretouch: bool = True,
                 account_only: bool = False) -> None:
        capacity_bytes = check_int("capacity_bytes", capacity_bytes, 1)
        alignment_bytes = check_int("alignment_bytes", alignment_bytes, 1)
        if alignment_bytes & (alignment_bytes - 1) or alignment_bytes > PAGE_BYTES:
            raise ValueError(f"alignment_bytes={alignment_bytes} must be a power of two <= {PAGE_BYTES}")
        if capacity_bytes % alignment_bytes:
            raise ValueError(f"capacity_bytes={capacity_bytes} is not a multiple of alignment_bytes={alignment_bytes}")
        if segment_bytes is None:
            segment_bytes = min(capacity_bytes, 1 << 30)
        segment_bytes = check_int("segment_bytes", segment_bytes, 1)
        if segment_bytes % alignment_bytes:
            raise ValueError(f"segment_bytes={segment_bytes} is not a multiple of alignment_bytes={alignment_bytes}")
        if segment_bytes > capacity_bytes:
            raise ValueError(f"segment_bytes={segment_bytes} exceeds capacity_bytes={capacity_bytes}")
        if segment_bytes // alignment_bytes > 0xFFFFFFFF:
            raise ValueError(f"segment_bytes={segment_bytes} is more than 2**32 units of alignment_bytes={alignment_bytes}")
        max_blocks = check_int("max_blocks_per_segment", max_blocks_per_segment, 1)
        if max_blocks > (1 << 26):
            raise ValueError(f"max_blocks_per_segment={max_blocks} must be at most {1 << 26}")
        if not isinstance(checksum, bool) or not isinstance(pretouch, bool):
            raise TypeError(f"checksum and pretouch must be bool, got {checksum!r}, {pretouch!r}")
        if not isinstance(account_only, bool):
            raise TypeError(f"account_only must be bool, got {account_only!r}")
        if account_only and checksum:
            raise ValueError("checksum=True needs real bytes; an account_only store holds none")
        self.config = DramStoreConfig(capacity_bytes=capacity_bytes, segment_bytes=segment_bytes,
                                      alignment_bytes=alignment_bytes, max_blocks_per_segment=max_blocks,
                                      checksum=checksum, pretouch=pretouch, account_only=account_only)
        self._zeros: memoryview | None = None  # account_only: shared read-only zero buffer for get()
        self._buffers: list[np.ndarray] = []
        self._views: list[memoryview] = []  # writable
        self._ro_views: list[memoryview] = []
        self._allocators: list[OffsetAllocator] = []
        remaining = capacity_bytes
        while remaining:
            size = min(segment_bytes, remaining)
            if not account_only:
                # page-aligned, so a slot at an aligned offset is aligned in memory too (the kernel's socket
                # copies run at half speed off a cache line on some CPUs: quillcache.alloc.buffers)
                buf = aligned_empty(size, PAGE_BYTES, pretouch=pretouch)
                self._buffers.append(buf)
                mv = memoryview(buf)
                self._views.append(mv)
                self._ro_views.append(mv.toreadonly())
            remaining -= size
        self._max_blocks = max_blocks
        self._slots: dict[StoreKey, _Slot] = {}
        self._used_bytes = 0
        self._stored_bytes = 0
        self._closed = False

    # ------------------------------------------------------------------ capacity
    @property
    def capacity_bytes(self) -> int:
        return self.config.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        return self.config.capacity_bytes - self._used_bytes

    @property
    def stored_bytes(self) -> int:
        return self._stored_bytes

    @property
    def num_segments(self) -> int:
        return self.config.num_segments

    def _segment_bytes(self, seg_id: int) -> int:
        return min(self.config.segment_bytes, self.config.capacity_bytes - seg_id * self.config.segment_bytes)

    def _open_segment(self) -> OffsetAllocator | None:
        """The allocator of the next segment, made on first use (so a store costs memory for the
        segments it uses, not for the capacity it declares); None when every segment is open."""
        seg_id = len(self._allocators)
        if seg_id >= self.config.num_segments:
            return None
        # free regions are always merged, so 2*max+1 nodes hold max live blocks at any fragmentation
        alloc = OffsetAllocator(self._segment_bytes(seg_id), 2 * self._max_blocks + 1,
                                alignment=self.config.alignment_bytes)
        self._allocators.append(alloc)
        return alloc

    @property
    def account_only(self) -> bool:
        """True when offsets are accounted without bytes (module docstring)."""
        return self.config.account_only

    def _zero_view(self, size: int) -> memoryview:
        """A read-only view of ``size`` zero bytes (account_only reads); the buffer only grows.
        ``np.zeros`` maps untouched zero pages, so a large buffer costs address space, not RAM."""
        z = self._zeros
        if z is None or z.nbytes < size:
            z = self._zeros = memoryview(np.zeros(size, dtype=np.uint8)).toreadonly()
        return z[:size]

    @property
    def max_block_bytes(self) -> int:
        return min(self.config.segment_bytes, MAX_BLOCK_BYTES)

    def largest_free_region_bytes(self) -> int:
        if self._closed:
            return 0
        opened = [a.storage_report().largest_free_region_bytes for a in self._allocators]
        unopened = [self._segment_bytes(i) for i in range(len(self._allocators), self.config.num_segments)]
        return max(opened + unopened[:1], default=0)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the DRAM store is closed")

    # ------------------------------------------------------------------ writes
    def _check_size(self, key: StoreKey, size: int) -> None:
        if size > self.max_block_bytes:
            raise BlockTooLargeError(
                f"block {key.hex()} is {size} bytes; the largest block a DRAM segment can hold is "
                f"{self.max_block_bytes} bytes (segment_bytes={self.config.segment_bytes})"
            )

    def _allocate(self, key: StoreKey, size: int) -> tuple[int, int, int]:
        """(segment_id, offset, handle) of a fresh range, or StoreFullError (nothing allocated)."""
        seg_id = 0
        while True:
            alloc = self._allocators[seg_id] if seg_id < len(self._allocators) else self._open_segment()
            if alloc is None:
                break
            if size > self._segment_bytes(seg_id):  # the last segment can be smaller than max_block_bytes
                seg_id += 1
                continue
            try:
                a = alloc.allocate(size)
            except OutOfSpaceError:
                seg_id += 1
                continue
            return seg_id, a.offset, a.handle
        raise StoreFullError(
            f"no room for block {key.hex()} of {size} bytes in DRAM: {self.free_bytes} of "
            f"{self.capacity_bytes} bytes free, largest free region {self.largest_free_region_bytes()} bytes, "
            f"{len(self._slots)} blocks stored"
        )

    def _place(self, key: StoreKey, mv: memoryview) -> Location:
        size = mv.nbytes
        seg_id, off, handle = self._allocate(key, size)
        if not self.config.account_only:
            self._views[seg_id][off:off + size] = mv  # the one memcpy
        crc = _crc.crc32c(mv) if self.config.checksum else -1
        self._slots[key] = _Slot(seg_id, off, size, handle, crc)
        self._used_bytes += self._allocators[seg_id].allocation_size(handle)
        self._stored_bytes += size
        return Location(seg_id, off, size)

    def put(self, key: StoreKey, data: object) -> Location:
        """Copy ``data`` into a fresh range; returns where it went.

        Errors: TypeError/ValueError (bad key or buffer), BlockExistsError, BlockTooLargeError,
        StoreFullError (no room now; nothing is evicted here: the data plane decides that)."""
        self._check_open()
        _check_key(key)
        mv = as_byte_view(data)
        if key in self._slots:
            raise BlockExistsError(f"block {key.hex()} is already stored in DRAM (blocks are immutable)")
        self._check_size(key, mv.nbytes)
        return self._place(key, mv)

    def put_many(self, items: Iterable[tuple[StoreKey, object]]) -> list[Location]:
        """Put several blocks, all or nothing (every item is checked first; if one cannot be
        placed, the ranges taken by the others are released and the error is raised)."""
        self._check_open()
        checked: list[tuple[StoreKey, memoryview]] = []
        seen: set[StoreKey] = set()
        for i, item in enumerate(items):
            if not isinstance(item, tuple) or len(item) != 2:
                raise TypeError(f"put_many items must be (key, data) pairs; item {i} is {type(item).__name__}")
            key, data = item
            _check_key(key)
            mv = as_byte_view(data, f"data of item {i}")
            if key in self._slots or key in seen:
                raise BlockExistsError(f"block {key.hex()} (item {i}) is already stored or repeated in the batch")
            self._check_size(key, mv.nbytes)
            seen.add(key)
            checked.append((key, mv))
        done: list[StoreKey] = []
        try:
            for key, mv in checked:
                self._place(key, mv)
                done.append(key)
        except BaseException:
            for key in reversed(done):
                self._release(key)
            raise
        return [self.location_of(k) for k, _ in checked]

    def _release(self, key: StoreKey) -> _Slot:
        slot = self._slots.pop(key)
        alloc = self._allocators[slot.segment_id]
        self._used_bytes -= alloc.allocation_size(slot.handle)
        self._stored_bytes -= slot.size_bytes
        alloc.free(slot.handle)
        return slot

    def delete(self, key: StoreKey) -> None:
        """Free the block's range. Views returned by ``get`` for it must not be used afterwards."""
        self._check_open()
        _check_key(key)
        if key not in self._slots:
            raise BlockNotFoundError(f"block {key.hex()} is not stored in DRAM")
        self._release(key)

    # ------------------------------------------------------------------ reads
    def _slot(self, key: object) -> _Slot:
        self._check_open()
        slot = self._slots.get(_check_key(key))
        if slot is None:
            raise BlockNotFoundError(f"block {key.hex()} is not stored in DRAM")  # type: ignore[union-attr]
        return slot

    def _verified(self, key: StoreKey, slot: _Slot, view: memoryview) -> None:
        if slot.crc < 0:
            raise ValueError("verify=True needs a store created with checksum=True")
        got = _crc.crc32c(view)
        if got != slot.crc:
            self._release(key)
            raise CorruptBlockError(
                f"block {key.hex()} failed its crc32c check in DRAM segment {slot.segment_id} at offset "
                f"{slot.offset_bytes} ({slot.size_bytes} bytes): stored {slot.crc:#010x}, computed {got:#010x}; "
                f"the block was dropped"
            )

    def get(self, key: StoreKey, *, verify: bool = False) -> memoryview:
        """A read-only zero-copy view of the block (valid until the key is deleted)."""
        slot = self._slot(key)
        if self.config.account_only:
            if verify:
                raise ValueError("verify=True needs a store created with checksum=True (account_only has no bytes)")
            return self._zero_view(slot.size_bytes)
        off = slot.offset_bytes
        view = self._ro_views[slot.segment_id][off:off + slot.size_bytes]
        if verify:
            self._verified(key, slot, view)
        return view

    def get_many(self, keys: Iterable[StoreKey], *, verify: bool = False) -> list[memoryview]:
        """``get`` of each key, in order (BlockNotFoundError names the first missing one)."""
        return [self.get(k, verify=verify) for k in keys]

    def get_into(self, key: StoreKey, out: object, *, verify: bool = False) -> int:
        """Copy the block into the writable buffer ``out`` (at least as large); returns the size."""
        slot = self._slot(key)
        dst = as_byte_view(out, "out")
        if dst.readonly:
            raise ValueError(f"out is a read-only buffer ({type(out).__name__}); get_into needs a writable one")
        n = slot.size_bytes
        if dst.nbytes < n:
            raise ValueError(f"out holds {dst.nbytes} bytes; block {key.hex()} is {n} bytes")
        if self.config.account_only:
            if verify:
                raise ValueError("verify=True needs a store created with checksum=True (account_only has no bytes)")
            dst[:n] = self._zero_view(n)
            return n
        view = self._ro_views[slot.segment_id][slot.offset_bytes:slot.offset_bytes + n]
        if verify:
            self._verified(key, slot, view)
        dst[:n] = view
        return n

    def location_of(self, key: StoreKey) -> Location:
        slot = self._slot(key)
        return Location(slot.segment_id, slot.offset_bytes, slot.size_bytes)

    def size_of(self, key: StoreKey) -> int:
        return self._slot(key).size_bytes

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[StoreKey]:
        return self.keys()

    def keys(self) -> Iterator[StoreKey]:
        """Stored keys in insertion order (a snapshot: safe to delete while iterating)."""
        return iter(list(self._slots))

    # ------------------------------------------------------------------ lifecycle
    def clear(self) -> None:
        """Drop every block (segments stay allocated and touched)."""
        self._check_open()
        for alloc in self._allocators:
            alloc.reset()
        self._slots.clear()
        self._used_bytes = 0
        self._stored_bytes = 0

    def __enter__(self) -> "LocalKvStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the segments; every later call raises StoreClosedError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._slots.clear()
        self._views.clear()
        self._ro_views.clear()
        self._buffers.clear()
        self._allocators.clear()
        self._zeros = None
        self._used_bytes = self._stored_bytes = 0

    @property
    def closed(self) -> bool:
        return self._closed

    def segment_view(self, segment_id: int) -> memoryview:
        """A writable view of a whole segment, for registering it with a transfer engine.

        Whoever writes through it bypasses the allocator: a pool writes only into ranges its master
        allocated for a block (Mooncake's two-phase put). None exists in account_only mode.
        """
        self._check_open()
        if self.config.account_only:
            raise ValueError("an account_only store has no segment buffers to register")
        segment_id = check_int("segment_id", segment_id, 0, len(self._views) - 1)
        return self._views[segment_id]

    def _segment_array(self, segment_id: int) -> np.ndarray:
        """The raw segment (tests use it to inject corruption); none in account_only mode."""
        if self.config.account_only:
            raise ValueError("an account_only store has no segment buffers")
        return self._buffers[segment_id]

    def __repr__(self) -> str:
        return (f"LocalKvStore({len(self._slots)} blocks, {self._used_bytes}/{self.capacity_bytes} bytes used, "
                f"{self.num_segments} segments{', account_only' if self.config.account_only else ''})")


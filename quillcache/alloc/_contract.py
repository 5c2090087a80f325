"""The offset allocator's shared contract: result records, errors, handle format, argument checks.

A leaf module: both implementations (``quillcache.alloc._alloc`` and ``quillcache.alloc.reference``)
import it and it imports neither, so the package has no import cycle. The public API is
``quillcache.alloc``.


``OffsetAllocator(capacity_bytes, max_allocs, *, alignment=1)`` does the bookkeeping of byte
ranges in a segment it does not own:

- ``allocate(size_bytes) -> Allocation(offset, size, handle)``, ``free(handle)``,
  ``allocation_size(handle)``, ``storage_report() -> StorageReport``, ``reset()``;
- ``allocate_batch(sizes) -> (offsets, handles)`` (int64 arrays; all-or-nothing: a failure frees
  the batch's allocations in reverse order, which restores the same free regions, then raises),
  ``free_batch(handles)`` (validates every handle first, frees nothing if one is bad or repeated);
- ``churn(num_pairs, min_size, max_size, seed) -> elapsed_ns`` (random free+allocate pairs run
  entirely in compiled code, for steady-state benchmarks);
- diagnostics ``regions()`` and ``live_allocations()``, which walk the whole node pool.

It is Sebastian Aaltonen's OffsetAllocator (TLSF family; REFERENCE §6) compiled with Cython
(``quillcache.alloc._alloc``). The algorithm and its invariants are documented in
``quillcache.alloc.reference``, whose ``PyOffsetAllocator`` (re-exported here) is the plain-Python
specification: same API, same decisions, and the benchmark baseline. This module holds what both
share: the result records, the errors, the handle format and every argument check, so both raise
the same errors with the same messages. 

Contract:
- Allocate and free are O(1): a request searches the bins with two bit scans; a free merges with
  its free address neighbours at once. A request of ``n`` units (bytes / alignment, rounded up)
  succeeds whenever a free region of ``float_to_uint(uint_to_float_round_up(n))`` units (at most
  1.125 n) exists and a node is free (a node is only needed to file a remainder). The block is
  exactly ``n`` units; the rest of the region goes back to the bins: nothing is wasted inside.
- ``max_allocs`` is the node pool shared by live allocations and free regions; free regions are
  always merged, so at least ``(max_allocs - 1) // 2`` allocations fit whatever the fragmentation.
- Offsets are deterministic: the same operations give the same offsets on every run.
- Handles are ``tag << 48 | (generation mod 2**20) << 28 | node_index`` (< 2**63, so they fit
  int64). ``tag`` is a non-zero 15-bit id drawn per allocator (compiled or not) from one
  process-wide :class:`TagRegistry`: a cursor that starts at a random value (so handles, unlike
  offsets, differ between runs) and moves to the next tag NOT held by a live allocator. No two
  live allocators ever share a tag, so a handle of another live allocator is always refused; an
  allocator's tag is released when it is garbage-collected and is handed out again only after the
  cursor went once round the 32,767 tags (a handle kept past its allocator's life is garbage, and
  may then match that later allocator's tag). With all 32,767 tags held by live allocators a new
  allocator is refused (``AllocatorError``). A node's generation
  is bumped whenever an allocation held in it ends (free or reset), so a stale handle is accepted
  again only after exactly 2**20 reuses of its node. An ``Allocation`` is accepted wherever a
  handle is.
- Errors: ``AllocatorError`` (a ValueError) for a bad size or argument, naming it;
  ``AllocatorTypeError`` (also a TypeError) for a non-integer; ``OutOfSpaceError`` naming the
  request, the free bytes and the largest free region (``reason`` says: no region or no node);
  ``InvalidHandleError`` for a double free, a stale handle, a handle of another allocator or
  garbage. No input crashes the process.
- Not thread-safe beyond the GIL, which every method holds for its whole run.
"""

from __future__ import annotations

import operator
import os
import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from quillcache._checks import check_int


MAX_UNITS = 0xFFFFFFFF  # capacity and sizes in units must fit uint32
MAX_ALIGNMENT = 1 << 30  # keeps every byte offset below 2**62

INDEX_BITS = 28
GEN_BITS = 20
TAG_BITS = 15
INDEX_MASK = (1 << INDEX_BITS) - 1
GEN_MASK = (1 << GEN_BITS) - 1
TAG_SHIFT = INDEX_BITS + GEN_BITS
MAX_NODES = 1 << INDEX_BITS
MAX_HANDLE = (1 << 63) - 1

# out-of-space reasons
NO_SPACE = "no free region large enough"
NO_NODES = "node pool exhausted"

_MASK64 = (1 << 64) - 1


class AllocatorError(ValueError):
    """Base class of everything the allocator refuses (a ValueError)."""


class AllocatorTypeError(AllocatorError, TypeError):
    """A size, capacity or count that is not an integer (both ValueError and TypeError)."""


class OutOfSpaceError(AllocatorError):
    """No free region can hold the request, or the node pool is exhausted."""

    def __init__(self, message: str, *, requested_bytes: int = 0, free_bytes: int = 0,
                 largest_free_region_bytes: int = 0, reason: str = "") -> None:
        super().__init__(message)
        self.requested_bytes = requested_bytes
        self.free_bytes = free_bytes
        self.largest_free_region_bytes = largest_free_region_bytes
        self.reason = reason


class InvalidHandleError(AllocatorError):
    """A double free, a stale handle, a handle of another allocator, or garbage."""

    def __init__(self, message: str, *, handle: object = None) -> None:
        super().__init__(message)
        self.handle = handle


class Allocation(NamedTuple):
    """One live allocation: byte offset, byte size (rounded up to the alignment), opaque handle."""

    offset: int
    size: int
    handle: int


@dataclass(frozen=True, slots=True)
class StorageReport:
    """Free-space accounting. ``largest_free_region_bytes`` is exact (not a bin lower bound)."""

    total_free_bytes: int
    largest_free_region_bytes: int
    num_live_allocations: int
    capacity_bytes: int
    num_free_regions: int
    num_free_nodes: int


# ---------------------------------------------------------------- shared argument checks

def validate_int(value: object, what: str, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as an int in ``[lo, hi]`` (numpy integers accepted; bool, float, str... refused),
    or AllocatorError / AllocatorTypeError naming it (``quillcache._checks.check_int``)."""
    return check_int(what, value, lo, hi, error=AllocatorError, type_error=AllocatorTypeError)


def validate_config(capacity_bytes: object, max_allocs: object, alignment: object) -> tuple[int, int, int, int]:
    """Check constructor arguments; return ``(capacity_bytes, capacity_units, max_allocs, alignment_shift)``."""
    capacity_bytes = validate_int(capacity_bytes, "capacity_bytes")
    max_allocs = validate_int(max_allocs, "max_allocs")
    alignment = validate_int(alignment, "alignment")
    if alignment < 1 or alignment & (alignment - 1) or alignment > MAX_ALIGNMENT:
        raise AllocatorError(f"alignment={alignment} must be a power of two between 1 and {MAX_ALIGNMENT}")
    if capacity_bytes < 1:
        raise AllocatorError(f"capacity_bytes={capacity_bytes} must be positive")
    if capacity_bytes % alignment:
        raise AllocatorError(f"capacity_bytes={capacity_bytes} is not a multiple of alignment={alignment}")
    capacity_units = capacity_bytes // alignment
    if capacity_units > MAX_UNITS:
        raise AllocatorError(
            f"capacity_bytes={capacity_bytes} is {capacity_units} units of alignment={alignment}; "
            f"at most {MAX_UNITS} units fit uint32 (raise the alignment)"
        )
    if not 1 <= max_allocs <= MAX_NODES:
        raise AllocatorError(f"max_allocs={max_allocs} must be between 1 and {MAX_NODES}")
    return capacity_bytes, capacity_units, max_allocs, alignment.bit_length() - 1


def validate_size(size_bytes: object, capacity_bytes: int, what: str = "size_bytes") -> int:
    """Check one request size; return it as an int."""
    size = validate_int(size_bytes, what)
    if size <= 0:
        raise AllocatorError(f"{what}={size} must be positive")
    if size > capacity_bytes:
        raise AllocatorError(f"{what}={size} exceeds capacity_bytes={capacity_bytes}")
    return size


def validate_size_array(sizes: object, capacity_bytes: int) -> np.ndarray:
    """Check a batch of sizes (1-D integer array-like); return a contiguous int64 array."""
    arr = np.asarray(sizes)
    if arr.ndim != 1:
        raise AllocatorError(f"sizes must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":
            arr = arr.astype(np.int64)  # np.asarray([]) is float64
        else:
            raise AllocatorTypeError(f"sizes must have an integer dtype, got {arr.dtype}")
    bad = np.flatnonzero((arr <= 0) | (arr > capacity_bytes))
    if bad.size:
        i = int(bad[0])
        raise AllocatorError(
            f"sizes[{i}]={int(arr[i])} must be positive and at most capacity_bytes={capacity_bytes}"
        )
    return np.ascontiguousarray(arr, dtype=np.int64)


def validate_handle_array(handles: object) -> np.ndarray:
    """Check a batch of handles (1-D integer array-like, or a sequence that may hold ``Allocation``s,
    each standing for its handle); return a contiguous int64 array."""
    if isinstance(handles, (list, tuple)) and any(isinstance(h, Allocation) for h in handles):
        handles = [h.handle if isinstance(h, Allocation) else h for h in handles]  # not rows of 3 fields
    arr = np.asarray(handles)
    if arr.ndim != 1:
        raise InvalidHandleError(f"handles must be 1-D, got shape {arr.shape}", handle=handles)
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":
            arr = arr.astype(np.int64)
        else:
            raise InvalidHandleError(f"handles must have an integer dtype, got {arr.dtype}", handle=handles)
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > MAX_HANDLE:
        i = int(np.argmax(arr > MAX_HANDLE))
        raise InvalidHandleError(f"handles[{i}]={int(arr[i])} is not a valid handle", handle=int(arr[i]))
    return np.ascontiguousarray(arr, dtype=np.int64)


def validate_churn(num_pairs: object, min_size: object, max_size: object, seed: object,
                   capacity_bytes: int, alignment_shift: int) -> tuple[int, int, int, int]:
    """Check churn arguments; return ``(num_pairs, min_units, max_units, seed)``."""
    num_pairs = validate_int(num_pairs, "num_pairs")
    if num_pairs < 0:
        raise AllocatorError(f"num_pairs={num_pairs} must be >= 0")
    lo = validate_size(min_size, capacity_bytes, "min_size")
    hi = validate_size(max_size, capacity_bytes, "max_size")
    if lo > hi:
        raise AllocatorError(f"min_size={lo} exceeds max_size={hi}")
    seed = validate_int(seed, "seed")
    if not 0 <= seed <= _MASK64:
        raise AllocatorError(f"seed={seed} must fit an unsigned 64-bit integer")
    align_mask = (1 << alignment_shift) - 1
    return num_pairs, (lo + align_mask) >> alignment_shift, (hi + align_mask) >> alignment_shift, seed


def coerce_handle(handle: object) -> int:
    """``handle`` (an int, or an ``Allocation``) as an int in ``[0, 2**63)``, or InvalidHandleError."""
    if isinstance(handle, Allocation):
        handle = handle.handle
    if type(handle) is not int:
        if isinstance(handle, (bool, np.bool_)):
            raise InvalidHandleError(f"handle {handle!r} is a bool, not an allocation handle", handle=handle)
        try:
            handle = operator.index(handle)  # type: ignore[arg-type]
        except TypeError:
            raise InvalidHandleError(
                f"handle {handle!r} ({type(handle).__name__}) is not an allocation handle", handle=handle
            ) from None
    if not 0 <= handle <= MAX_HANDLE:
        raise InvalidHandleError(f"handle {handle} is outside [0, 2**63) and cannot be valid", handle=handle)
    return handle


def handle_error(handle: int, code: int, tag: int) -> InvalidHandleError:
    """The error for a handle refused with ``code``: -1 foreign, -2 node out of range, -3 not live,
    -4 repeated within one ``free_batch``."""
    if code == -1:
        why = f"was not issued by this allocator (tag {handle >> TAG_SHIFT}, this allocator's tag is {tag})"
    elif code == -2:
        why = f"names node {handle & INDEX_MASK}, outside this allocator's node pool"
    elif code == -4:
        why = "appears more than once in the batch"
    else:
        why = "is not live: already freed (double free), stale (its node was reused) or reset"
    return InvalidHandleError(f"handle {handle:#x} {why}", handle=handle)


NUM_TAGS = (1 << TAG_BITS) - 1  # tags 1..NUM_TAGS (0 is never used)


class TagRegistry:
    """The tags held by live allocators (module doc): ``acquire`` hands out the next tag after the
    cursor that no live allocator holds, ``release`` gives one back.

    ``release`` takes no lock (one ``set.discard``, atomic under the GIL) because allocators call
    it while being deallocated, which the garbage collector may do inside ``acquire``."""

    def __init__(self, num_tags: int = NUM_TAGS, start: int = 0) -> None:
        self.num_tags = check_int("num_tags", num_tags, 1, NUM_TAGS)
        self._cursor = check_int("start", start, 0, num_tags - 1)  # the tag handed out last (0: none)
        self._live: set[int] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._live)

    def acquire(self) -> int:
        """A tag in ``[1, num_tags]`` no live allocator holds, or AllocatorError when all are held."""
        with self._lock:
            live, n = self._live, self.num_tags
            if len(live) >= n:
                raise AllocatorError(
                    f"all {n} allocator tags are held by live allocators (a handle has {TAG_BITS} tag bits); "
                    f"drop an allocator before creating another"
                )
            t = self._cursor % n + 1
            while t in live:
                t = t % n + 1
            self._cursor = t
            live.add(t)
            return t

    def release(self, tag: int) -> None:
        """Give ``tag`` back (its allocator is gone); releasing a tag not held is a no-op."""
        self._live.discard(tag)


_tags = TagRegistry(start=int.from_bytes(os.urandom(2), "little") % NUM_TAGS)


def new_allocator_tag() -> int:
    """A tag no live allocator holds (compiled or not); consecutive allocators get different tags.
    The allocator gives it back with :func:`release_allocator_tag` when it is collected."""
    return _tags.acquire()


def release_allocator_tag(tag: int) -> None:
    """Give back the tag of an allocator that is being collected."""
    _tags.release(tag)

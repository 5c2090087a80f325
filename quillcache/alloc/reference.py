"""Plain-Python offset allocator: the specification of ``quillcache.alloc._alloc`` and its baseline.

Algorithm (Sebastian Aaltonen's OffsetAllocator, TLSF family; REFERENCE §6), in *units* of
``alignment`` bytes, each unit count fitting uint32:

- Sizes map to 256 bins through an 8-bit "small float" (3-bit mantissa, 5-bit exponent,
  denormals below 8): bins are 1/8 of a power of two apart. A free region of ``s`` units is filed
  under ``uint_to_float_round_down(s)``; a request of ``n`` units searches from
  ``uint_to_float_round_up(n)`` upward with a two-level bitmap (``used_bins_top``: 32 bits, one per
  top bin; ``used_bins[top]``: 8 leaf bits), so every region found is large enough without looking
  at it. One O(1) extension over the original: when that search fails, the head region of the
  request's own round-down bin is taken if it happens to be large enough (so a fresh allocator can
  always hand out its whole capacity).
- Every allocation and every free region is a node of a pool of ``max_allocs`` nodes (a stack of
  free node indices; node 0 pops first). Nodes also form a doubly linked, address-ordered
  neighbour list, so ``free`` merges with free neighbours at once. Allocating pops the head node
  of the chosen bin and files the remainder (if any) as a new free node right after it.

Invariants (checked by the tests after every step):
- The nodes reachable from offset 0 through the neighbour list tile ``[0, capacity)`` exactly;
  no two free regions are adjacent (they are always merged).
- ``free_units == capacity_units - sum(live allocation sizes)``; every free region sits in the
  bin ``uint_to_float_round_down(size)`` and bit ``b`` of the bitmaps is set iff bin ``b`` is non-empty.
- Regions + live allocations use at most ``max_allocs`` nodes. Free regions never outnumber live
  allocations by more than one, so at least ``(max_allocs - 1) // 2`` live allocations always fit.
- Decisions are deterministic: the same operations give the same offsets in this module and in
  the compiled one (``tests/test_alloc.py`` checks it).

Handles, errors, result records and argument checks are shared with the compiled allocator and
live in ``quillcache.alloc`` (the handle format is described there), so both raise the same
errors with the same messages. ``quillcache._mix.splitmix64_next`` is the churn drivers' shared
generator.
"""

from __future__ import annotations

import time
import weakref

import numpy as np

from quillcache._mix import splitmix64_next
from quillcache.alloc._contract import (
    GEN_MASK,
    INDEX_BITS,
    INDEX_MASK,
    NO_NODES,
    NO_SPACE,
    TAG_SHIFT,
    Allocation,
    AllocatorError,
    InvalidHandleError,
    OutOfSpaceError,
    StorageReport,
    coerce_handle,
    handle_error,
    new_allocator_tag,
    release_allocator_tag,
    validate_churn,
    validate_config,
    validate_handle_array,
    validate_size,
    validate_size_array,
)

__all__ = ["PyOffsetAllocator", "float_to_uint", "uint_to_float_round_down", "uint_to_float_round_up"]

MANTISSA_BITS = 3
MANTISSA_VALUE = 1 << MANTISSA_BITS
MANTISSA_MASK = MANTISSA_VALUE - 1
NUM_TOP_BINS = 32
BINS_PER_LEAF = 8
TOP_BINS_INDEX_SHIFT = 3
LEAF_BINS_INDEX_MASK = 7
NUM_LEAF_BINS = NUM_TOP_BINS * BINS_PER_LEAF
UNUSED = 0xFFFFFFFF  # "no node" in every link field

# node states
POOLED = 0  # on the free-node stack
FREE = 1  # a free region filed in a bin
USED = 2  # a live allocation

# ---------------------------------------------------------------- small float (bin mapping)

def uint_to_float_round_up(size: int) -> int:
    """Smallest bin whose lower bound is >= ``size`` (the search start of a request)."""
    if size < MANTISSA_VALUE:
        return size  # denormal: bins 0..7 hold exactly 0..7
    highest_set_bit = size.bit_length() - 1
    mantissa_start_bit = highest_set_bit - MANTISSA_BITS
    exp = mantissa_start_bit + 1
    mantissa = (size >> mantissa_start_bit) & MANTISSA_MASK
    if size & ((1 << mantissa_start_bit) - 1):
        mantissa += 1  # may carry into the exponent: "+" below, not "|"
    return (exp << MANTISSA_BITS) + mantissa


def uint_to_float_round_down(size: int) -> int:
    """Largest bin whose lower bound is <= ``size`` (where a free region of ``size`` is filed)."""
    if size < MANTISSA_VALUE:
        return size
    highest_set_bit = size.bit_length() - 1
    mantissa_start_bit = highest_set_bit - MANTISSA_BITS
    exp = mantissa_start_bit + 1
    mantissa = (size >> mantissa_start_bit) & MANTISSA_MASK
    return (exp << MANTISSA_BITS) | mantissa


def float_to_uint(float_value: int) -> int:
    """Lower bound (in units) of bin ``float_value``."""
    exponent = float_value >> MANTISSA_BITS
    mantissa = float_value & MANTISSA_MASK
    if exponent == 0:
        return mantissa
    return (mantissa | MANTISSA_VALUE) << (exponent - 1)


def _lowest_set_bit_after(mask: int, start_bit: int) -> int:
    bits_after = mask & ~((1 << start_bit) - 1)
    if bits_after == 0:
        return UNUSED
    return (bits_after & -bits_after).bit_length() - 1


# ---------------------------------------------------------------- the allocator

class PyOffsetAllocator:
    """Reference allocator over ``capacity_bytes`` bytes with a pool of ``max_allocs`` nodes.

    Same API and same decisions as ``quillcache.alloc.OffsetAllocator``; the microbenchmark's baseline
    (``results/microbench_alloc``).
    Not thread-safe.
    """

    def __init__(self, capacity_bytes: int, max_allocs: int, *, alignment: int = 1) -> None:
        cap, units, nodes, shift = validate_config(capacity_bytes, max_allocs, alignment)
        self._capacity_bytes = cap
        self._capacity_units = units
        self._max_allocs = nodes
        self._shift = shift
        self._tag = new_allocator_tag()
        weakref.finalize(self, release_allocator_tag, self._tag)  # held while this allocator lives
        self._offset = [0] * nodes
        self._size = [0] * nodes
        self._bin_prev = [UNUSED] * nodes
        self._bin_next = [UNUSED] * nodes
        self._nb_prev = [UNUSED] * nodes
        self._nb_next = [UNUSED] * nodes
        self._gen = [0] * nodes
        self._state = [POOLED] * nodes
        self._init_state()

    def _init_state(self) -> None:
        n = self._max_allocs
        self._free_units = 0
        self._num_live = 0
        self._used_bins_top = 0
        self._used_bins = [0] * NUM_TOP_BINS
        self._bin_heads = [UNUSED] * NUM_LEAF_BINS
        self._free_nodes = list(range(n - 1, -1, -1))  # a stack: node 0 pops first
        self._state = [POOLED] * n
        self._insert_node_into_bin(self._capacity_units, 0)

    # -- core (units) -------------------------------------------------------------------

    def _insert_node_into_bin(self, size: int, offset: int) -> int:
        b = uint_to_float_round_down(size)
        top, leaf = b >> TOP_BINS_INDEX_SHIFT, b & LEAF_BINS_INDEX_MASK
        head = self._bin_heads[b]
        if head == UNUSED:
            self._used_bins[top] |= 1 << leaf
            self._used_bins_top |= 1 << top
        n = self._free_nodes.pop()
        self._offset[n] = offset
        self._size[n] = size
        self._bin_prev[n] = UNUSED
        self._bin_next[n] = head
        self._nb_prev[n] = UNUSED
        self._nb_next[n] = UNUSED
        self._state[n] = FREE
        if head != UNUSED:
            self._bin_prev[head] = n
        self._bin_heads[b] = n
        self._free_units += size
        return n

    def _unlink_bin_head(self, b: int, n: int) -> None:
        nxt = self._bin_next[n]
        self._bin_heads[b] = nxt
        if nxt != UNUSED:
            self._bin_prev[nxt] = UNUSED
        else:
            top, leaf = b >> TOP_BINS_INDEX_SHIFT, b & LEAF_BINS_INDEX_MASK
            self._used_bins[top] &= ~(1 << leaf)
            if self._used_bins[top] == 0:
                self._used_bins_top &= ~(1 << top)

    def _remove_node_from_bin(self, n: int) -> None:
        prev, nxt = self._bin_prev[n], self._bin_next[n]
        if prev != UNUSED:
            self._bin_next[prev] = nxt
            if nxt != UNUSED:
                self._bin_prev[nxt] = prev
        else:
            self._unlink_bin_head(uint_to_float_round_down(self._size[n]), n)
        self._state[n] = POOLED
        self._free_nodes.append(n)
        self._free_units -= self._size[n]

    def _alloc_units(self, units: int) -> int:
        """Node index of the new allocation, or ``-1`` (no region) / ``-2`` (no node)."""
        min_bin = uint_to_float_round_up(units)
        min_top, min_leaf = min_bin >> TOP_BINS_INDEX_SHIFT, min_bin & LEAF_BINS_INDEX_MASK
        top, leaf = min_top, UNUSED
        if self._used_bins_top & (1 << top):
            leaf = _lowest_set_bit_after(self._used_bins[top], min_leaf)
        if leaf != UNUSED:
            b = (top << TOP_BINS_INDEX_SHIFT) | leaf
        else:
            top = _lowest_set_bit_after(self._used_bins_top, min_top + 1)
            if top != UNUSED:
                leaf = _lowest_set_bit_after(self._used_bins[top], 0)
                b = (top << TOP_BINS_INDEX_SHIFT) | leaf
            else:
                # O(1) fallback: the head of the request's own round-down bin may still fit.
                b = min_bin - 1
                if min_bin == 0 or b != uint_to_float_round_down(units):
                    return -1
                head = self._bin_heads[b]
                if head == UNUSED or self._size[head] < units:
                    return -1
        n = self._bin_heads[b]
        total = self._size[n]
        remainder = total - units
        if remainder and not self._free_nodes:
            return -2
        self._unlink_bin_head(b, n)
        self._free_units -= total
        self._size[n] = units
        self._state[n] = USED
        self._num_live += 1
        if remainder:
            r = self._insert_node_into_bin(remainder, self._offset[n] + units)
            nxt = self._nb_next[n]
            if nxt != UNUSED:
                self._nb_prev[nxt] = r
            self._nb_prev[r] = n
            self._nb_next[r] = nxt
            self._nb_next[n] = r
        return n

    def _free_node(self, n: int) -> None:
        offset, size = self._offset[n], self._size[n]
        prev = self._nb_prev[n]
        if prev != UNUSED and self._state[prev] == FREE:
            offset = self._offset[prev]
            size += self._size[prev]
            self._remove_node_from_bin(prev)
            self._nb_prev[n] = self._nb_prev[prev]
        nxt = self._nb_next[n]
        if nxt != UNUSED and self._state[nxt] == FREE:
            size += self._size[nxt]
            self._remove_node_from_bin(nxt)
            self._nb_next[n] = self._nb_next[nxt]
        nb_prev, nb_next = self._nb_prev[n], self._nb_next[n]
        self._gen[n] += 1
        self._state[n] = POOLED
        self._num_live -= 1
        self._free_nodes.append(n)
        c = self._insert_node_into_bin(size, offset)
        if nb_next != UNUSED:
            self._nb_next[c] = nb_next
            self._nb_prev[nb_next] = c
        if nb_prev != UNUSED:
            self._nb_prev[c] = nb_prev
            self._nb_next[nb_prev] = c

    def _handle(self, n: int) -> int:
        return (self._tag << TAG_SHIFT) | ((self._gen[n] & GEN_MASK) << INDEX_BITS) | n

    def _check_handle(self, h: int) -> int:
        """Node index of live handle ``h`` (an int in [0, 2**63)), or a negative code."""
        if h >> TAG_SHIFT != self._tag:
            return -1
        n = h & INDEX_MASK
        if n >= self._max_allocs:
            return -2
        if self._state[n] != USED or (self._gen[n] & GEN_MASK) != (h >> INDEX_BITS) & GEN_MASK:
            return -3
        return n

    def _live_node(self, handle: object) -> int:
        h = coerce_handle(handle)
        n = self._check_handle(h)
        if n < 0:
            raise handle_error(h, n, self._tag)
        return n

    def _largest_free_units(self) -> int:
        if not self._used_bins_top:
            return 0
        top = self._used_bins_top.bit_length() - 1
        b = (top << TOP_BINS_INDEX_SHIFT) | (self._used_bins[top].bit_length() - 1)
        best, n = 0, self._bin_heads[b]
        while n != UNUSED:
            best = max(best, self._size[n])
            n = self._bin_next[n]
        return best

    def _out_of_space(self, size_bytes: int, code: int, context: str = "") -> OutOfSpaceError:
        free_b = self._free_units << self._shift
        largest_b = self._largest_free_units() << self._shift
        reason = NO_NODES if code == -2 else NO_SPACE
        detail = f"all {self._max_allocs} nodes in use" if code == -2 else "fragmented or full"
        return OutOfSpaceError(
            f"cannot allocate {size_bytes} bytes{context}: {reason} ({detail}); "
            f"free {free_b} bytes, largest free region {largest_b} bytes",
            requested_bytes=size_bytes, free_bytes=free_b, largest_free_region_bytes=largest_b, reason=reason,
        )

    # -- public API (bytes) ---------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def alignment(self) -> int:
        return 1 << self._shift

    @property
    def max_allocs(self) -> int:
        return self._max_allocs

    @property
    def num_live_allocations(self) -> int:
        return self._num_live

    def allocate(self, size_bytes: int) -> Allocation:
        """Allocate ``size_bytes`` (rounded up to the alignment); OutOfSpaceError if it cannot."""
        size = validate_size(size_bytes, self._capacity_bytes)
        units = (size + (1 << self._shift) - 1) >> self._shift
        n = self._alloc_units(units)
        if n < 0:
            raise self._out_of_space(size, n)
        return Allocation(self._offset[n] << self._shift, units << self._shift, self._handle(n))

    def free(self, handle: int) -> None:
        """Free a live allocation; InvalidHandleError for a double free, stale or foreign handle."""
        self._free_node(self._live_node(handle))

    def allocation_size(self, handle: int) -> int:
        """Byte size of a live allocation."""
        return self._size[self._live_node(handle)] << self._shift

    def allocate_batch(self, sizes: object) -> tuple[np.ndarray, np.ndarray]:
        """Allocate every size in order; all-or-nothing (a failure frees the batch's allocations
        in reverse order, restoring the same free regions, then raises OutOfSpaceError)."""
        arr = validate_size_array(sizes, self._capacity_bytes)
        offsets = np.empty(arr.size, dtype=np.int64)
        handles = np.empty(arr.size, dtype=np.int64)
        nodes: list[int] = []
        mask = (1 << self._shift) - 1
        for i, size in enumerate(arr.tolist()):
            n = self._alloc_units((size + mask) >> self._shift)
            if n < 0:
                for m in reversed(nodes):
                    self._free_node(m)
                raise self._out_of_space(size, n, f" (sizes[{i}] of {arr.size}; {i} rolled back)")
            nodes.append(n)
            offsets[i] = self._offset[n] << self._shift
            handles[i] = self._handle(n)
        return offsets, handles

    def free_batch(self, handles: object) -> None:
        """Free every handle; all are validated first (live, no repeats), so a bad one frees nothing."""
        arr = validate_handle_array(handles)
        nodes: list[int] = []
        seen: set[int] = set()
        for i, h in enumerate(arr.tolist()):
            n = self._check_handle(h) if h >= 0 else -1
            if n >= 0 and n in seen:
                n = -4
            if n < 0:
                err = handle_error(h, n, self._tag)
                raise InvalidHandleError(f"handles[{i}]: {err}", handle=h)
            seen.add(n)
            nodes.append(n)
        for n in nodes:
            self._free_node(n)

    def churn(self, num_pairs: int, min_size: int, max_size: int, seed: int) -> int:
        """``num_pairs`` times: free a random live allocation, allocate a random size in
        ``[min_size, max_size]``; return the elapsed nanoseconds. Live nodes are picked from the
        live set listed in node-index order, with SplitMix64(seed). OutOfSpaceError stops it
        (the pairs done so far stay done)."""
        pairs, lo, hi, state = validate_churn(num_pairs, min_size, max_size, seed,
                                              self._capacity_bytes, self._shift)
        live = [n for n in range(self._max_allocs) if self._state[n] == USED]
        if pairs and not live:
            raise AllocatorError("churn needs at least one live allocation to free")
        span = hi - lo + 1
        count = len(live)
        alloc, free_node, mix = self._alloc_units, self._free_node, splitmix64_next
        t0 = time.perf_counter_ns()
        for i in range(pairs):
            state, r = mix(state)
            j = r % count
            free_node(live[j])
            state, r = mix(state)
            units = lo + r % span
            n = alloc(units)
            if n < 0:
                raise self._out_of_space(units << self._shift, n, f" (churn pair {i} of {pairs})")
            live[j] = n
        return time.perf_counter_ns() - t0

    def storage_report(self) -> StorageReport:
        regions = 0
        for b in range(NUM_LEAF_BINS):
            n = self._bin_heads[b]
            while n != UNUSED:
                regions += 1
                n = self._bin_next[n]
        return StorageReport(
            total_free_bytes=self._free_units << self._shift,
            largest_free_region_bytes=self._largest_free_units() << self._shift,
            num_live_allocations=self._num_live,
            capacity_bytes=self._capacity_bytes,
            num_free_regions=regions,
            num_free_nodes=len(self._free_nodes),
        )

    def regions(self) -> list[tuple[int, int, bool]]:
        """``(offset_bytes, size_bytes, is_free)`` of every node in address order (O(max_allocs))."""
        n = next(i for i in range(self._max_allocs) if self._state[i] in (FREE, USED) and self._offset[i] == 0)
        out = []
        while n != UNUSED:
            out.append((self._offset[n] << self._shift, self._size[n] << self._shift, self._state[n] == FREE))
            n = self._nb_next[n]
        return out

    def live_allocations(self) -> list[Allocation]:
        """Every live allocation, in node-index order (O(max_allocs); a diagnostic)."""
        return [Allocation(self._offset[n] << self._shift, self._size[n] << self._shift, self._handle(n))
                for n in range(self._max_allocs) if self._state[n] == USED]

    def reset(self) -> None:
        """Free everything at once; every outstanding handle becomes invalid."""
        for n in range(self._max_allocs):
            if self._state[n] == USED:
                self._gen[n] += 1
        self._init_state()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(capacity_bytes={self._capacity_bytes}, max_allocs={self._max_allocs}, "
                f"alignment={1 << self._shift}, live={self._num_live}, free_bytes={self._free_units << self._shift})")

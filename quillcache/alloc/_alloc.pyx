"""Compiled O(1) offset allocator (Sebastian Aaltonen's OffsetAllocator, TLSF family).

This is the fast path of ``quillcache.alloc``; ``quillcache.alloc.reference`` is its
specification and states the algorithm and its invariants. Both take the same decisions (same
operations -> same offsets and node indices); the tests check it on random operation sequences.

Layout (declared in ``_alloc.pxd``): the whole state is one C struct (``Core``): a pool of ``max_allocs`` 32-byte nodes
(array of structs), a stack of free node indices, 256 bin heads and the two-level bitmap. The
core functions are ``noexcept nogil`` C functions over ``Core*`` and never fail: every argument
is validated before them (sizes in ``1..capacity_units``, node indices of live allocations), so
no input reaches them that could index out of bounds. The GIL is never released, so concurrent
calls from several threads are serialised by it (the allocator is not otherwise thread-safe).
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memset

from quillcache._mix cimport splitmix64_next

# Node, Core, the bin constants, UNUSED / ERR_* and qc_ctz32 / qc_clz32 come from _alloc.pxd.

import time

import numpy as np

from quillcache.alloc._contract import (
    GEN_MASK, INDEX_BITS, INDEX_MASK, TAG_SHIFT,
    Allocation, AllocatorError, InvalidHandleError, OutOfSpaceError, StorageReport,
    NO_NODES, NO_SPACE,
    coerce_handle, handle_error, new_allocator_tag, release_allocator_tag, validate_churn, validate_config,
    validate_handle_array, validate_int, validate_size, validate_size_array,
)

cdef int64_t C_INDEX_MASK = INDEX_MASK
cdef int64_t C_GEN_MASK = GEN_MASK
cdef int C_INDEX_BITS = INDEX_BITS
cdef int C_TAG_SHIFT = TAG_SHIFT
cdef object _tuple_new = tuple.__new__  # Allocation is a NamedTuple: build it without its __new__
cdef object _Allocation = Allocation

# ---------------------------------------------------------------- small float (bin mapping)

cdef inline uint32_t _round_up(uint32_t size) noexcept nogil:
    cdef uint32_t start, exp, mantissa
    if size < MANTISSA_VALUE:
        return size
    start = 31 - qc_clz32(size) - MANTISSA_BITS
    exp = start + 1
    mantissa = (size >> start) & MANTISSA_MASK
    if size & ((1u << start) - 1u):
        mantissa += 1
    return (exp << MANTISSA_BITS) + mantissa


cdef inline uint32_t _round_down(uint32_t size) noexcept nogil:
    cdef uint32_t start
    if size < MANTISSA_VALUE:
        return size
    start = 31 - qc_clz32(size) - MANTISSA_BITS
    return ((start + 1) << MANTISSA_BITS) | ((size >> start) & MANTISSA_MASK)


cdef inline uint64_t _float_to_uint(uint32_t f) noexcept nogil:
    cdef uint32_t exponent = f >> MANTISSA_BITS
    cdef uint64_t mantissa = f & MANTISSA_MASK
    if exponent == 0:
        return mantissa
    return (mantissa | MANTISSA_VALUE) << (exponent - 1)


cdef inline uint32_t _lowest_set_bit_after(uint32_t mask, uint32_t start) noexcept nogil:
    cdef uint32_t bits = mask & ~((1u << start) - 1u)
    if bits == 0:
        return UNUSED
    return qc_ctz32(bits)


def uint_to_float_round_up(size):
    """Smallest bin whose lower bound is >= ``size`` (``size`` in ``0..2**32-1``)."""
    return _round_up(<uint32_t>validate_int(size, "size", 0, 0xFFFFFFFF))


def uint_to_float_round_down(size):
    """Largest bin whose lower bound is <= ``size`` (``size`` in ``0..2**32-1``)."""
    return _round_down(<uint32_t>validate_int(size, "size", 0, 0xFFFFFFFF))


def float_to_uint(float_value):
    """Lower bound of bin ``float_value`` (``0..255``)."""
    return _float_to_uint(<uint32_t>validate_int(float_value, "float_value", 0, NUM_LEAF_BINS - 1))


# ---------------------------------------------------------------- core (units; never fails)

cdef void _init_core(Core* c) noexcept nogil:
    cdef uint32_t i, n = c.max_allocs
    cdef int b
    c.free_units = 0
    c.num_live = 0
    c.used_bins_top = 0
    memset(c.used_bins, 0, sizeof(c.used_bins))
    for b in range(NUM_LEAF_BINS):
        c.bin_heads[b] = UNUSED
    for i in range(n):
        c.free_nodes[i] = n - 1 - i  # a stack: node 0 pops first
        c.nodes[i].state = ST_POOLED
    c.num_free_nodes = n
    _insert_node_into_bin(c, c.capacity_units, 0)


cdef inline uint32_t _insert_node_into_bin(Core* c, uint32_t size, uint32_t offset) noexcept nogil:
    cdef uint32_t b = _round_down(size)
    cdef uint32_t head = c.bin_heads[b]
    cdef uint32_t n
    cdef Node* node
    if head == UNUSED:
        c.used_bins[b >> TOP_SHIFT] |= 1u << (b & LEAF_MASK)
        c.used_bins_top |= 1u << (b >> TOP_SHIFT)
    c.num_free_nodes -= 1
    n = c.free_nodes[c.num_free_nodes]
    node = &c.nodes[n]
    node.offset = offset
    node.size = size
    node.bin_prev = UNUSED
    node.bin_next = head
    node.nb_prev = UNUSED
    node.nb_next = UNUSED
    node.state = ST_FREE
    if head != UNUSED:
        c.nodes[head].bin_prev = n
    c.bin_heads[b] = n
    c.free_units += size
    return n


cdef inline void _unlink_bin_head(Core* c, uint32_t b, uint32_t n) noexcept nogil:
    cdef uint32_t nxt = c.nodes[n].bin_next
    cdef uint32_t top
    c.bin_heads[b] = nxt
    if nxt != UNUSED:
        c.nodes[nxt].bin_prev = UNUSED
    else:
        top = b >> TOP_SHIFT
        c.used_bins[top] &= ~(1u << (b & LEAF_MASK))
        if c.used_bins[top] == 0:
            c.used_bins_top &= ~(1u << top)


cdef inline void _remove_node_from_bin(Core* c, uint32_t n) noexcept nogil:
    cdef Node* node = &c.nodes[n]
    if node.bin_prev != UNUSED:
        c.nodes[node.bin_prev].bin_next = node.bin_next
        if node.bin_next != UNUSED:
            c.nodes[node.bin_next].bin_prev = node.bin_prev
    else:
        _unlink_bin_head(c, _round_down(node.size), n)
    node.state = ST_POOLED
    c.free_nodes[c.num_free_nodes] = n
    c.num_free_nodes += 1
    c.free_units -= node.size


cdef uint32_t _alloc_units(Core* c, uint32_t units) noexcept nogil:
    """Node index of the new allocation, or ERR_NO_SPACE / ERR_NO_NODES (state unchanged)."""
    cdef uint32_t min_bin = _round_up(units)
    cdef uint32_t min_top = min_bin >> TOP_SHIFT
    cdef uint32_t top = min_top, leaf = UNUSED, b, n, r, nxt, total, remainder
    cdef Node* node
    if c.used_bins_top & (1u << top):
        leaf = _lowest_set_bit_after(c.used_bins[top], min_bin & LEAF_MASK)
    if leaf != UNUSED:
        b = (top << TOP_SHIFT) | leaf
    else:
        top = _lowest_set_bit_after(c.used_bins_top, min_top + 1)  # min_top <= 30
        if top != UNUSED:
            b = (top << TOP_SHIFT) | qc_ctz32(c.used_bins[top])
        else:
            # O(1) fallback: the head of the request's own round-down bin may still fit.
            b = min_bin - 1
            if min_bin == 0 or b != _round_down(units):
                return ERR_NO_SPACE
            n = c.bin_heads[b]
            if n == UNUSED or c.nodes[n].size < units:
                return ERR_NO_SPACE
    n = c.bin_heads[b]
    node = &c.nodes[n]
    total = node.size
    remainder = total - units
    if remainder != 0 and c.num_free_nodes == 0:
        return ERR_NO_NODES
    _unlink_bin_head(c, b, n)
    c.free_units -= total
    node.size = units
    node.state = ST_USED
    c.num_live += 1
    if remainder != 0:
        r = _insert_node_into_bin(c, remainder, node.offset + units)
        nxt = node.nb_next
        if nxt != UNUSED:
            c.nodes[nxt].nb_prev = r
        c.nodes[r].nb_prev = n
        c.nodes[r].nb_next = nxt
        node.nb_next = r
    return n


cdef void _free_node(Core* c, uint32_t n) noexcept nogil:
    cdef Node* node = &c.nodes[n]
    cdef uint32_t offset = node.offset, size = node.size
    cdef uint32_t prev = node.nb_prev, nxt, nb_prev, nb_next, m
    if prev != UNUSED and c.nodes[prev].state == ST_FREE:
        offset = c.nodes[prev].offset
        size += c.nodes[prev].size
        _remove_node_from_bin(c, prev)
        node.nb_prev = c.nodes[prev].nb_prev
    nxt = node.nb_next
    if nxt != UNUSED and c.nodes[nxt].state == ST_FREE:
        size += c.nodes[nxt].size
        _remove_node_from_bin(c, nxt)
        node.nb_next = c.nodes[nxt].nb_next
    nb_prev = node.nb_prev
    nb_next = node.nb_next
    node.gen += 1
    node.state = ST_POOLED
    c.num_live -= 1
    c.free_nodes[c.num_free_nodes] = n
    c.num_free_nodes += 1
    m = _insert_node_into_bin(c, size, offset)
    if nb_next != UNUSED:
        c.nodes[m].nb_next = nb_next
        c.nodes[nb_next].nb_prev = m
    if nb_prev != UNUSED:
        c.nodes[m].nb_prev = nb_prev
        c.nodes[nb_prev].nb_next = m


# ---------------------------------------------------------------- the Python-facing class

cdef class OffsetAllocator:
    """O(1) offset allocator over ``capacity_bytes`` bytes with a pool of ``max_allocs`` nodes.

    Every live allocation and every free region holds one node; at least
    ``(max_allocs - 1) // 2`` live allocations always fit. Sizes are rounded up to
    ``alignment`` (a power of two) and offsets are multiples of it. See ``quillcache.alloc``.
    """

    cdef Core c
    cdef uint32_t _shift
    cdef uint64_t _align_mask
    cdef int64_t _tag
    cdef int64_t _tag_bits
    cdef object _capacity_obj
    cdef uint64_t _capacity_c

    def __cinit__(self, capacity_bytes, max_allocs, *, alignment=1):
        self.c.nodes = NULL
        self.c.free_nodes = NULL
        cap, units, nodes, shift = validate_config(capacity_bytes, max_allocs, alignment)
        self._capacity_obj = cap
        self._capacity_c = cap
        self._shift = shift
        self._align_mask = (1ULL << shift) - 1
        self._tag = new_allocator_tag()
        self._tag_bits = self._tag << C_TAG_SHIFT
        self.c.capacity_units = units
        self.c.max_allocs = nodes
        self.c.nodes = <Node*>PyMem_Malloc(<size_t>nodes * sizeof(Node))
        self.c.free_nodes = <uint32_t*>PyMem_Malloc(<size_t>nodes * sizeof(uint32_t))
        if self.c.nodes == NULL or self.c.free_nodes == NULL:
            raise MemoryError(f"cannot allocate a pool of max_allocs={nodes} nodes")
        memset(self.c.nodes, 0, <size_t>nodes * sizeof(Node))
        _init_core(&self.c)

    def __dealloc__(self):
        PyMem_Free(self.c.nodes)
        PyMem_Free(self.c.free_nodes)
        if self._tag:  # 0 when __cinit__ failed before a tag was drawn
            try:
                release_allocator_tag(self._tag)  # no two live allocators share a tag (_contract)
            except Exception:  # interpreter shutdown: the module's globals are gone, and so is the registry
                pass

    # -- helpers --------------------------------------------------------------------------

    cdef inline int64_t _handle(self, uint32_t n) noexcept:
        return self._tag_bits | ((<int64_t>self.c.nodes[n].gen & C_GEN_MASK) << C_INDEX_BITS) | n

    cdef inline int64_t _check_handle(self, int64_t h) noexcept:
        """Node index of live handle ``h``, or -1 foreign / -2 out of range / -3 not live / -4 pending."""
        cdef int64_t n
        cdef uint8_t st
        if h < 0 or (h >> C_TAG_SHIFT) != self._tag:
            return -1
        n = h & C_INDEX_MASK
        if n >= self.c.max_allocs:
            return -2
        st = self.c.nodes[n].state
        if (st != ST_USED and st != ST_PENDING) or (
                (self.c.nodes[n].gen & C_GEN_MASK) != ((h >> C_INDEX_BITS) & C_GEN_MASK)):
            return -3
        return -4 if st == ST_PENDING else n

    cdef uint32_t _live_node(self, object handle) except? 0xFFFFFFFF:
        cdef int64_t h = -1, n = -1
        if type(handle) is int:
            try:
                h = handle
            except OverflowError:
                h = -1
            n = self._check_handle(h)
        if n < 0:  # slow path: refuse garbage by type/range first, then explain the refusal
            h = coerce_handle(handle)
            n = self._check_handle(h)
            if n < 0:
                raise handle_error(h, n, self._tag)
        return <uint32_t>n

    cdef uint32_t _largest_free_units(self) noexcept:
        cdef uint32_t top, b, n, best = 0
        if self.c.used_bins_top == 0:
            return 0
        top = 31 - qc_clz32(self.c.used_bins_top)
        b = (top << TOP_SHIFT) | (31 - qc_clz32(self.c.used_bins[top]))
        n = self.c.bin_heads[b]
        while n != UNUSED:
            if self.c.nodes[n].size > best:
                best = self.c.nodes[n].size
            n = self.c.nodes[n].bin_next
        return best

    cdef object _out_of_space(self, object size_bytes, uint32_t code, str context=""):
        free_b = (<uint64_t>self.c.free_units) << self._shift
        largest_b = (<uint64_t>self._largest_free_units()) << self._shift
        reason = NO_NODES if code == ERR_NO_NODES else NO_SPACE
        detail = f"all {self.c.max_allocs} nodes in use" if code == ERR_NO_NODES else "fragmented or full"
        return OutOfSpaceError(
            f"cannot allocate {size_bytes} bytes{context}: {reason} ({detail}); "
            f"free {free_b} bytes, largest free region {largest_b} bytes",
            requested_bytes=size_bytes, free_bytes=free_b, largest_free_region_bytes=largest_b, reason=reason,
        )

    # -- public API (bytes) ---------------------------------------------------------------

    @property
    def capacity_bytes(self):
        return self._capacity_obj

    @property
    def alignment(self):
        return 1 << self._shift

    @property
    def max_allocs(self):
        return self.c.max_allocs

    @property
    def num_live_allocations(self):
        return self.c.num_live

    def allocate(self, size_bytes):
        """Allocate ``size_bytes`` (rounded up to the alignment) -> ``Allocation(offset, size, handle)``.

        OutOfSpaceError (naming the request, free bytes and largest free region) if no free
        region fits or the node pool is exhausted; AllocatorError for a size outside
        ``1..capacity_bytes``; AllocatorTypeError for a non-integer size.
        """
        cdef int64_t size = -1
        cdef uint32_t n
        if type(size_bytes) is int:
            try:
                size = size_bytes
            except OverflowError:
                size = -1
        if size <= 0 or <uint64_t>size > self._capacity_c:
            size = validate_size(size_bytes, self._capacity_obj)  # raises, or converts a numpy int
        n = _alloc_units(&self.c, <uint32_t>((<uint64_t>size + self._align_mask) >> self._shift))
        if n >= ERR_NO_NODES:
            raise self._out_of_space(size, n)
        return _tuple_new(_Allocation, (
            (<int64_t>self.c.nodes[n].offset) << self._shift,
            (<int64_t>self.c.nodes[n].size) << self._shift,
            self._handle(n),
        ))

    def free(self, handle):
        """Free a live allocation; InvalidHandleError for a double free, stale, foreign or garbage handle."""
        _free_node(&self.c, self._live_node(handle))

    def allocation_size(self, handle):
        """Byte size of a live allocation (InvalidHandleError if it is not live)."""
        return (<int64_t>self.c.nodes[self._live_node(handle)].size) << self._shift

    def allocate_batch(self, sizes):
        """Allocate every size in order -> ``(offsets, handles)``, int64 arrays (bytes, handles).

        All-or-nothing: if one fails, the batch's allocations are freed in reverse order (the
        free regions are exactly as before) and OutOfSpaceError names the failing index.
        """
        cdef const int64_t[::1] s = validate_size_array(sizes, self._capacity_obj)
        cdef Py_ssize_t i, j, count = s.shape[0]
        cdef uint32_t n
        offsets = np.empty(count, dtype=np.int64)
        handles = np.empty(count, dtype=np.int64)
        cdef int64_t[::1] o = offsets
        cdef int64_t[::1] h = handles
        for i in range(count):
            n = _alloc_units(&self.c, <uint32_t>(((<uint64_t>s[i]) + self._align_mask) >> self._shift))
            if n >= ERR_NO_NODES:
                for j in range(i - 1, -1, -1):
                    _free_node(&self.c, <uint32_t>(h[j] & C_INDEX_MASK))
                raise self._out_of_space(s[i], n, f" (sizes[{i}] of {count}; {i} rolled back)")
            o[i] = (<int64_t>self.c.nodes[n].offset) << self._shift
            h[i] = self._handle(n)
        return offsets, handles

    def free_batch(self, handles):
        """Free every handle. All are validated first (live, none repeated): an invalid one
        raises InvalidHandleError naming its position and frees nothing."""
        cdef const int64_t[::1] h = validate_handle_array(handles)
        cdef Py_ssize_t i, j, count = h.shape[0]
        cdef int64_t n
        for i in range(count):
            n = self._check_handle(h[i])
            if n < 0:
                for j in range(i):
                    self.c.nodes[h[j] & C_INDEX_MASK].state = ST_USED
                err = handle_error(h[i], n, self._tag)
                raise InvalidHandleError(f"handles[{i}]: {err}", handle=h[i])
            self.c.nodes[n].state = ST_PENDING
        for i in range(count):
            n = h[i] & C_INDEX_MASK
            self.c.nodes[n].state = ST_USED
            _free_node(&self.c, <uint32_t>n)

    def churn(self, num_pairs, min_size, max_size, seed):
        """``num_pairs`` times: free a random live allocation, allocate a random size in
        ``[min_size, max_size]`` bytes; return the elapsed nanoseconds of the loop (which runs
        entirely in C). Same generator and choices as ``PyOffsetAllocator.churn``; an
        OutOfSpaceError stops it (the pairs done so far stay done)."""
        pairs, lo, hi, seed = validate_churn(num_pairs, min_size, max_size, seed,
                                             self._capacity_obj, self._shift)
        cdef Py_ssize_t i = 0, j, npairs = pairs, count = 0
        cdef uint32_t n, units = 0, min_units = lo, span = <uint32_t>(hi - lo) + 1
        cdef uint64_t state = seed
        clock = time.perf_counter_ns  # resolved before the live set is gathered: nothing runs Python code
        cdef uint32_t* live = <uint32_t*>PyMem_Malloc(max(1, self.c.num_live) * sizeof(uint32_t))
        if live == NULL:
            raise MemoryError("churn: cannot allocate the live-set buffer")
        try:
            for i in range(self.c.max_allocs):
                if self.c.nodes[i].state == ST_USED:
                    live[count] = <uint32_t>i
                    count += 1
            if npairs and count == 0:
                raise AllocatorError("churn needs at least one live allocation to free")
            n = 0
            t0 = clock()
            for i in range(npairs):
                j = <Py_ssize_t>(splitmix64_next(&state) % <uint64_t>count)
                _free_node(&self.c, live[j])
                units = min_units + <uint32_t>(splitmix64_next(&state) % span)
                n = _alloc_units(&self.c, units)
                if n >= ERR_NO_NODES:
                    break
                live[j] = n
            t1 = clock()
            if n >= ERR_NO_NODES:
                raise self._out_of_space((<int64_t>units) << self._shift, n, f" (churn pair {i} of {pairs})")
            return t1 - t0
        finally:
            PyMem_Free(live)

    def storage_report(self):
        """Free-space accounting (exact largest free region; O(free regions))."""
        cdef int b
        cdef uint32_t n, regions = 0
        for b in range(NUM_LEAF_BINS):
            n = self.c.bin_heads[b]
            while n != UNUSED:
                regions += 1
                n = self.c.nodes[n].bin_next
        return StorageReport(
            total_free_bytes=(<int64_t>self.c.free_units) << self._shift,
            largest_free_region_bytes=(<int64_t>self._largest_free_units()) << self._shift,
            num_live_allocations=self.c.num_live,
            capacity_bytes=self._capacity_obj,
            num_free_regions=regions,
            num_free_nodes=self.c.num_free_nodes,
        )

    def regions(self):
        """``(offset_bytes, size_bytes, is_free)`` of every node in address order (O(max_allocs))."""
        cdef uint32_t i, n = UNUSED
        for i in range(self.c.max_allocs):
            if self.c.nodes[i].state != ST_POOLED and self.c.nodes[i].offset == 0:
                n = i
                break
        out = []
        while n != UNUSED:
            out.append(((<int64_t>self.c.nodes[n].offset) << self._shift,
                        (<int64_t>self.c.nodes[n].size) << self._shift,
                        self.c.nodes[n].state == ST_FREE))
            n = self.c.nodes[n].nb_next
        return out

    def live_allocations(self):
        """Every live allocation, in node-index order (O(max_allocs); a diagnostic)."""
        cdef uint32_t n
        return [_tuple_new(_Allocation, ((<int64_t>self.c.nodes[n].offset) << self._shift,
                                        (<int64_t>self.c.nodes[n].size) << self._shift, self._handle(n)))
                for n in range(self.c.max_allocs) if self.c.nodes[n].state == ST_USED]

    def reset(self):
        """Free everything at once; every outstanding handle becomes invalid."""
        cdef uint32_t i
        for i in range(self.c.max_allocs):
            if self.c.nodes[i].state == ST_USED:
                self.c.nodes[i].gen += 1
        _init_core(&self.c)

    def __reduce__(self):
        raise TypeError("OffsetAllocator cannot be pickled")

    def __repr__(self):
        return (f"OffsetAllocator(capacity_bytes={self._capacity_obj}, max_allocs={self.c.max_allocs}, "
                f"alignment={1 << self._shift}, live={self.c.num_live}, "
                f"free_bytes={(<int64_t>self.c.free_units) << self._shift})")

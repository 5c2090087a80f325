"""Adaptive radix tree (Leis et al., ICDE 2013) living in one offset-addressed byte arena.

Private module: use ``quillcache.art.tree.ArtTree``.  ONE compilation unit (the hot point lookup
inlines through every layer, so no concept pays a cross-module call); by concept:
  include/qart_layout.h   on-arena node structs (sizes from sizeof, pinned by static asserts)
  include/qart_crc32c.h   CRC-32C;   include/qart_buffers.h   scan buffers, arena memory
  _art.pxd                C declarations: Arena, Iter, PrefixHit, error and gate codes
  arena.pxi               checked dereference, lazy chunk verification, allocator
  nodes.pxi               per-node child operations (grow, shrink, merge, iterate)
  search.pxi              lookup, insert, remove, prefix find, iteration and seek
  walks.pxi               cache-warming hints, prefix collection, subtree touch / free
  verify.pxi              the O(n) invariant walk behind ``verify()``
  persist.pxi             arena header, chunk sizes, CRC entry point, ArenaMeta export / load
  results.pxi             numpy result ownership, limit checks, (key, value) lists
  ops.pxi                 batch calls, remove_prefix, ordered scans (bodies of ArtCore methods)
  _art.pyx                (this file) ``ArtCore``, the Python-facing core

Invariants
- All nodes and leaves live in ONE contiguous arena and refer to each other by 8-byte-aligned
  uint64 offsets from its base; bit 0 set tags a leaf, 0 is null.  Bytes [0, 64) are a header
  (magic, format version, byte-order mark, value size) so no node sits at offset 0.  The arena
  therefore means the same thing at any base address: it can be written out and attached as is.
- Keys are 1..255 bytes and prefix-free; every value has exactly ``value_size`` bytes.
- Inner nodes are Node4/16/48/256 with path compression: ``prefix_len`` is the FULL compressed
  path length, only its first 16 bytes are stored.  Lookups skip the rest optimistically and
  verify the whole key at the leaf; inserts, seeks and deletes read the missing bytes from the
  subtree's minimum leaf.  Lazy expansion: a leaf hangs wherever its path becomes unique.
- Child counts per type: Node4 2..4, Node16 4..16, Node48 13..48, Node256 38..256 (grow when full;
  shrink 256->48 at 37, 48->16 at 12, 16->4 at 3; a Node4 with one child merges into it).
- Allocation: bump pointer plus one LIFO free list per 8-byte size class; before a mutation the
  wrapper reserves capacity for its worst case, so the base never moves inside an operation.
- Safety (checked per dereference, not by walking at attach time): every offset dereference is
  bounds-checked against ``used`` and the node type's size and child capacity; mutating helpers
  re-validate a node right before changing it and read its type/count once (in a damaged arena
  an allocation from a corrupt free list may overlap it); node-to-node copies use memmove; every
  walk is bounded by depth (< 260 levels) and by a visit budget of ``used / 8`` objects.  A
  damaged arena therefore gives ``ValueError("corrupt arena ...")`` (or wrong answers), never an
  access outside the arena allocation and never an endless loop.  ``verify()`` is the O(n) check.
- Lazy checksums (attach with a chunk CRC-32C table): no arena byte is read at attach; every
  dereference (node_at / leaf_at / a popped free block / the header before the first operation)
  first verifies the chunks its object overlaps (``need_chunks`` in arena.pxi: one compare and a
  bit test once verified).  A mismatch sets ``Arena.gate``: that operation and all later ones
  raise ValueError("corrupt arena: chunk N (bytes A..B) checksum mismatch").  A failing
  operation changes nothing: mutations verify whatever they read after their first write (the
  free blocks they will pop, a merge child, a subtree ``remove_prefix`` frees) beforehand.
  Cache-warming hints never verify; they stop at an unverified chunk.  CRC-32C is computed in C:
  SSE4.2 ``crc32`` (3 interleaved streams) in a function compiled for that target only and
  picked at run time, else a portable slicing-by-8 loop.
- Python-facing methods hold the GIL throughout (no ``nogil`` sections), so calls from several
  threads are serialised.  While results are being turned into Python objects (which can run gc
  callbacks and finalizers) the tree is marked busy and mutations raise RuntimeError.
"""


from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE
from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdlib cimport malloc, realloc, free
from libc.stdint cimport uintptr_t

import operator

import numpy as np

from quillcache._checks import check_int
from quillcache.art.meta import ArenaMeta

MAX_LIMIT = 2**62  # largest scan limit (keeps counts inside int64)

include "arena.pxi"
include "nodes.pxi"
include "search.pxi"
include "walks.pxi"
include "verify.pxi"
include "persist.pxi"
include "results.pxi"
include "ops.pxi"

MAGIC = b"QUILLART"
FORMAT_VERSION = FORMAT_VERSION_C
BYTE_ORDER_MARK = BYTE_ORDER_MARK_C
MAX_PREFIX_BYTES = MAX_PREFIX
HEADER_BYTES = ARENA_HEADER_BYTES
NODE_BYTES = {"node4": sizeof(Node4), "node16": sizeof(Node16), "node48": sizeof(Node48),
              "node256": sizeof(Node256)}
# Worst-case bump allocation of one insert (new leaf + largest grown node + a split Node4).
cdef uint64_t INSERT_SLACK_BYTES = sizeof(Node256) + sizeof(Node4)

qart_crc_init()
CRC32C_HW = bool(qart_crc_hw_ok)   # True when the SSE4.2 path is in use


cdef class ArtCore:
    """Arena ART over fixed-size values. See the module docstring for invariants."""

    cdef Arena a
    cdef bint owned       # base was malloc'ed by us
    cdef bint writable    # base may be written (else: copy into owned memory on first mutation)
    cdef bint has_view    # self.view holds an attached exporter's buffer
    cdef Py_buffer view
    cdef int exports      # live arena_view() exports; the arena must not move while > 0
    cdef int busy         # > 0 while results are being built from raw offsets
    # No Python-object fields: they would make the type GC-tracked, and Cython's generated tp_clear
    # would then drop view.obj without releasing the buffer (the exporter dies with exports > 0).
    cdef bint header_bad  # a lazily checked header passed its checksum but was refused

    def __cinit__(self, *args, **kwargs):
        # Always a valid (empty, key-only) tree, even if __init__ is never run (cls.__new__).
        memset(&self.a, 0, sizeof(Arena))
        self.a.base = <uint8_t*>malloc(ARENA_HEADER_BYTES)
        if self.a.base == NULL:
            raise MemoryError("cannot allocate an arena header")
        write_header(self.a.base, 0)
        self.a.used = ARENA_HEADER_BYTES
        self.a.capacity = ARENA_HEADER_BYTES
        self.owned = True
        self.writable = True

    def __init__(self, int value_size=0, Py_ssize_t initial_arena_bytes=4096):
        """Empty tree with values of ``value_size`` bytes in a fresh arena of the given size."""
        cdef uint64_t cap
        cdef uint8_t* base
        if value_size < 0 or value_size > 255:
            raise ValueError(f"value_size must be in 0..255, got {value_size}")
        if initial_arena_bytes < ARENA_HEADER_BYTES:
            raise ValueError(f"initial_arena_bytes must be >= {ARENA_HEADER_BYTES}, got {initial_arena_bytes}")
        if self.exports or self.busy:
            raise BufferError("cannot re-initialise a tree whose arena is exported or busy")
        cap = (<uint64_t>initial_arena_bytes + 7) & ~(<uint64_t>7)
        base = <uint8_t*>qart_arena_alloc(cap)
        if base == NULL:
            raise MemoryError(f"cannot allocate an arena of {cap} bytes")
        self._drop_storage()
        memset(&self.a, 0, sizeof(Arena))
        self.a.base = base
        write_header(self.a.base, value_size)
        self.a.used = ARENA_HEADER_BYTES
        self.a.capacity = cap
        self.a.value_size = value_size
        self.owned = True
        self.writable = True

    def __dealloc__(self):
        self._drop_storage()

    cdef void _drop_storage(self) noexcept:
        if self.owned and self.a.base != NULL:
            free(self.a.base)
        if self.has_view:
            PyBuffer_Release(&self.view)
            self.has_view = False
        self.a.base = NULL
        self.owned = False
        self._drop_chunks()

    cdef void _drop_chunks(self) noexcept:
        """Forget the chunk checksum table (the arena it described is gone or was reset)."""
        free(self.a.chunk_bits)
        free(self.a.chunk_crc)
        self.a.chunk_bits = NULL
        self.a.chunk_crc = NULL
        self.a.lazy_end = 0
        self.a.table_end = 0
        self.a.num_chunks = 0
        self.a.chunks_verified = 0
        self.a.bad_chunk = 0
        self.a.chunk_shift = 0
        self.a.gate = 0
        self.header_bad = False

    # -- lazy chunk verification ---------------------------------------------------------

    cdef int _gate_slow(self) except -1:
        """Run when ``a.gate`` is set: refuse a corrupt arena; verify and check a lazily attached
        header before the first operation uses the arena."""
        if self.a.gate & GATE_CORRUPT:
            self.a.err = E_OK
            raise ValueError(checksum_msg(self))
        if self.a.gate & GATE_HEADER:
            if need_chunks(&self.a, 0, ARENA_HEADER_BYTES, False) < 0:
                self.a.err = E_OK
                raise ValueError(checksum_msg(self))
            if _header_problem(self.a.base, self.a.used, self.a.value_size) is not None:
                self.a.gate |= GATE_CORRUPT
                self.header_bad = True
                raise ValueError(checksum_msg(self))
            self.a.gate &= ~GATE_HEADER
        return 0

    cdef int _verify_pending(self) except -1:
        """Verify every chunk not verified yet; returns how many were checksummed."""
        cdef uint64_t c, before
        if self.a.gate:
            self._gate_slow()
        before = self.a.chunks_verified
        if self.a.lazy_end:
            for c in range(self.a.num_chunks):
                if not chunk_bit(&self.a, c) and check_chunk(&self.a, c) < 0:
                    self.a.err = E_OK
                    raise ValueError(checksum_msg(self))
        return <int>(self.a.chunks_verified - before)

    def verify_all_chunks(self):
        """Checksum every chunk not verified yet (ValueError on a mismatch); returns how many."""
        return self._verify_pending()

    def chunk_crcs(self, chunk_bytes=65536):
        """CRC-32C of each ``chunk_bytes`` chunk of the used arena (the last may be short), as
        uint32[ceil(used / chunk_bytes)]: the table ``attach(..., chunk_crcs=)`` checks against.

        A lazily attached arena is fully verified first, so a table is never computed over
        bytes that failed (or never passed) their checksum.
        """
        cdef uint32_t shift = _chunk_shift(chunk_bytes)
        self._verify_pending()
        return chunk_crc_table(&self.a, shift)

    def _chunk_bitmap(self):
        """Verified flag per chunk (bool[chunks_total]); for tests."""
        out = np.zeros(self.a.num_chunks, dtype=np.bool_)
        cdef uint8_t[::1] o = out.view(np.uint8)
        cdef uint64_t c
        for c in range(self.a.num_chunks):
            o[c] = chunk_bit(&self.a, c)
        return out

    # -- arena management ----------------------------------------------------------------

    cdef int _reserve(self, uint64_t extra) except -1:
        """Make the arena writable with ``extra`` bytes of bump space (may move it)."""
        if self.busy:
            raise RuntimeError("ArtTree was mutated while one of its scans was building results")
        if not self.writable or self.a.capacity - self.a.used < extra:
            self._relocate(extra)
        return 0

    cdef int _relocate(self, uint64_t extra) except -1:
        cdef uint64_t need = self.a.used + extra
        cdef uint64_t cap = self.a.capacity * 2 if self.writable else self.a.capacity
        cdef uint8_t* p
        if self.exports:
            raise BufferError(
                f"the arena must move (grow or copy-on-write) but {self.exports} arena_view() "
                "export(s) are still alive; release them first")
        if cap < need:
            cap = need
        cap = (cap + 7) & ~(<uint64_t>7)
        if self.owned:
            p = <uint8_t*>qart_arena_move(self.a.base, self.a.used, cap)
            if p == NULL:
                raise MemoryError(f"cannot grow the arena to {cap} bytes")
        else:
            p = <uint8_t*>qart_arena_alloc(cap)
            if p == NULL:
                raise MemoryError(f"cannot copy the arena into {cap} owned bytes")
            memcpy(p, self.a.base, self.a.used)
            if self.has_view:
                PyBuffer_Release(&self.view)
                self.has_view = False
        self.a.base = p
        self.a.capacity = cap
        self.owned = True
        self.writable = True
        return 0

    cdef int _fail(self, Py_ssize_t key_len) except -1:
        cdef int e = self.a.err
        self.a.err = E_OK
        if e == E_CHECKSUM or self.a.gate & GATE_CORRUPT:
            raise ValueError(checksum_msg(self))
        if e == E_PREFIX:
            raise ValueError(
                f"key of length {key_len} conflicts with an existing key of length "
                f"{self.a.conflict_len}: one is a proper prefix of the other (keys must be prefix-free)")
        if e == E_OOM:
            raise MemoryError("out of memory while collecting scan results")
        if e == E_NOMEM:  # the worst case of one operation was reserved: only a damaged arena gets here
            raise ValueError(_corrupt_msg() + "; an operation needed more arena than its worst case")
        raise ValueError(_corrupt_msg())

    cdef inline int _check_key(self, Py_ssize_t kl, str what) except -1:
        if kl < 1 or kl > 255:
            raise ValueError(f"{what} length must be in 1..255 bytes, got {kl}")
        return 0

    cdef inline Py_ssize_t _key_len(self, object key, str what, Py_ssize_t lo) except -1:
        """Length of ``key`` after checking it is bytes of lo..255 bytes (same messages as the
        pure-Python reference, so both implementations fail identically)."""
        cdef Py_ssize_t kl
        if type(key) is not bytes:
            raise TypeError(f"{what} must be bytes, got {type(key).__name__}")
        kl = PyBytes_GET_SIZE(key)
        if kl < lo or kl > 255:
            raise ValueError(f"{what} length must be in {lo}..255 bytes, got {kl}")
        return kl

    cdef inline int _check_value(self, object value) except -1:
        if type(value) is not bytes:
            raise TypeError(f"value must be bytes, got {type(value).__name__}")
        if PyBytes_GET_SIZE(value) != self.a.value_size:
            raise ValueError(f"value must be exactly {self.a.value_size} bytes, got {PyBytes_GET_SIZE(value)}")
        return 0

    # -- single-key operations -----------------------------------------------------------

    def insert(self, key, value):
        """Store value under key; True if the key is new, False if its value was replaced."""
        cdef Py_ssize_t kl = self._key_len(key, "key", 1)
        cdef int r
        self._check_value(value)
        if self.a.gate:
            self._gate_slow()
        self._reserve(leaf_bytes(&self.a, <uint32_t>kl) + INSERT_SLACK_BYTES)
        r = art_insert(&self.a, <const uint8_t*>PyBytes_AS_STRING(key), <uint32_t>kl,
                       <const uint8_t*>PyBytes_AS_STRING(value))
        if r < 0:
            self._fail(kl)
        return r == 1

    def get(self, key):
        """The value stored under key, or None."""
        cdef Py_ssize_t kl = self._key_len(key, "key", 1)
        cdef uint64_t leaf
        if self.a.gate:
            self._gate_slow()
        leaf = art_lookup(&self.a, <const uint8_t*>PyBytes_AS_STRING(key), <uint32_t>kl)
        if leaf == 0:
            if self.a.err:
                self._fail(kl)
            return None
        return PyBytes_FromStringAndSize(<char*>self.a.base + (leaf ^ 1) + 1 + kl, self.a.value_size)

    def __contains__(self, key):
        cdef Py_ssize_t kl = self._key_len(key, "key", 1)
        cdef uint64_t leaf
        if self.a.gate:
            self._gate_slow()
        leaf = art_lookup(&self.a, <const uint8_t*>PyBytes_AS_STRING(key), <uint32_t>kl)
        if leaf == 0 and self.a.err:
            self._fail(kl)
        return leaf != 0

    def remove(self, key):
        """Remove key; True if it was present."""
        cdef Py_ssize_t kl = self._key_len(key, "key", 1)
        cdef int r
        if self.a.gate:
            self._gate_slow()
        self._reserve(INSERT_SLACK_BYTES)
        r = art_remove(&self.a, <const uint8_t*>PyBytes_AS_STRING(key), <uint32_t>kl)
        if r < 0:
            self._fail(kl)
        return r == 1

    def __len__(self):
        return self.a.num_leaves

    # -- prefix operations ---------------------------------------------------------------

    def scan_prefix(self, prefix, limit=None):
        """(key, value) pairs whose key starts with prefix, ascending; at most limit of them."""
        cdef Py_ssize_t plen = self._key_len(prefix, "prefix", 0)
        cdef int64_t lim = -1 if limit is None else _check_limit(limit)
        cdef qart_offbuf buf
        cdef int64_t k
        if self.a.gate:
            self._gate_slow()
        qart_buf_init(&buf)
        try:
            k = collect_prefix(&self.a, <const uint8_t*>PyBytes_AS_STRING(prefix), <uint32_t>plen,
                               lim, &buf, False)
            if k < 0:
                self._fail(plen)
            return build_items(self, &buf, 0)
        finally:
            qart_buf_free(&buf)

    def count_prefix(self, prefix):
        """Number of keys that start with prefix."""
        cdef Py_ssize_t plen = self._key_len(prefix, "prefix", 0)
        cdef int64_t k
        if self.a.gate:
            self._gate_slow()
        if plen == 0:
            return self.a.num_leaves
        k = collect_prefix(&self.a, <const uint8_t*>PyBytes_AS_STRING(prefix), <uint32_t>plen,
                           -1, NULL, True)
        if k < 0:
            self._fail(plen)
        return k

    def remove_prefix(self, prefix):
        """Remove every key that starts with prefix (b"" = all); returns how many."""
        return remove_prefix(self, prefix)

    cdef void _reset(self) noexcept:
        cdef int i
        self._drop_chunks()  # every old byte is discarded; new objects need no verification
        self.a.used = ARENA_HEADER_BYTES
        self.a.root = 0
        self.a.num_leaves = 0
        for i in range(5):
            self.a.num_nodes[i] = 0
        for i in range(NUM_CLASSES):
            self.a.free_heads[i] = 0
        self.a.free_bytes = 0
        self.a.free_blocks = 0

    def _scan_from(self, bytes start, bint exclusive=False, Py_ssize_t limit=-1):
        """Ascending (key, value) pairs from the first key >= start (> start if exclusive)."""
        return scan_from(self, start, exclusive, limit)

    # -- batch operations ----------------------------------------------------------------

    def insert_batch(self, const uint8_t[:, ::1] keys, const uint8_t[:, ::1] values):
        """Insert rows keys[i] -> values[i] in order; returns how many keys were new.

        Not atomic: rows before a failing row stay inserted (the error names the row).
        """
        return insert_batch(self, keys, values)

    def get_batch(self, const uint8_t[:, ::1] keys):
        """(found bool[n], values uint8[n, value_size]); rows of missing keys are zero."""
        return get_batch(self, keys)

    def scan_prefix_batch(self, const uint8_t[:, ::1] prefixes, Py_ssize_t key_len=-1):
        """CSR scan: matches of prefixes[i] are rows offsets[i]:offsets[i+1] of keys/values.

        All matched keys must have one length (``key_len``, or the first match's length).
        """
        return scan_prefix_batch(self, prefixes, key_len)

    def scan_u64_prefix_packed(self, uint8_t head, uint64_t number):
        """``b"".join(k + v for k, v in scan_prefix(bytes([head]) + number.to_bytes(8, "big")))``
        as one bytes object built in C: every matched record, key then value, in key order, with no
        per-record Python objects (the residency index's point lookup). Out-of-range arguments
        raise OverflowError (callers validate and name the value)."""
        cdef uint8_t p[9]
        cdef qart_offbuf buf
        cdef size_t j, total = 0, pos = 0
        cdef uint32_t vs = self.a.value_size
        cdef uint8_t* lf
        cdef char* dst
        if self.a.gate:
            self._gate_slow()
        block_prefix(p, head, number)
        qart_buf_init(&buf)
        try:
            if collect_prefix(&self.a, p, 9, -1, &buf, False) < 0:
                self._fail(9)
            for j in range(buf.n):
                lf = leaf_at(&self.a, buf.data[j])
                if lf == NULL:
                    self._fail(9)
                total += lf[0] + vs
            out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>total)
            dst = PyBytes_AS_STRING(out)
            for j in range(buf.n):
                lf = leaf_at(&self.a, buf.data[j])
                if lf == NULL:
                    self._fail(9)
                memcpy(dst + pos, lf + 1, lf[0] + vs)
                pos += lf[0] + vs
            return out
        finally:
            qart_buf_free(&buf)

    def scan_u64_prefix_batch(self, uint8_t head, const uint64_t[::1] numbers, Py_ssize_t key_len):
        """``scan_prefix_batch`` over the 9-byte prefixes ``head || numbers[i]`` (big-endian),
        built in C: the residency index's batched lookup (no numpy byte-order round trip)."""
        return scan_u64_prefix_batch(self, head, numbers, key_len)

    # -- arena introspection and persistence ---------------------------------------------

    @property
    def value_size(self):
        return self.a.value_size

    @property
    def arena_used_bytes(self):
        return self.a.used

    @property
    def arena_capacity_bytes(self):
        return self.a.capacity

    @property
    def root_offset(self):
        return self.a.root

    @property
    def owns_arena(self):
        return bool(self.owned)

    def __getbuffer__(self, Py_buffer* buffer, int flags):
        cdef Py_ssize_t* shape_strides
        if flags & PyBUF_WRITABLE:
            raise BufferError("the arena view is read-only")
        if self.a.gate or self.a.lazy_end:
            self._verify_pending()  # an export hands out every byte: all must be verified
        shape_strides = <Py_ssize_t*>malloc(2 * sizeof(Py_ssize_t))
        if shape_strides == NULL:
            raise MemoryError()
        shape_strides[0] = <Py_ssize_t>self.a.used
        shape_strides[1] = 1
        buffer.buf = <void*>self.a.base
        buffer.obj = self
        buffer.len = <Py_ssize_t>self.a.used
        buffer.readonly = 1
        buffer.itemsize = 1
        buffer.format = NULL
        if flags & PyBUF_FORMAT:
            buffer.format = FORMAT_B
        buffer.ndim = 1
        buffer.shape = shape_strides if flags & PyBUF_ND else NULL
        buffer.strides = shape_strides + 1 if (flags & PyBUF_STRIDES) == PyBUF_STRIDES else NULL
        buffer.suboffsets = NULL
        buffer.internal = <void*>shape_strides
        self.exports += 1

    def __releasebuffer__(self, Py_buffer* buffer):
        free(buffer.internal)
        self.exports -= 1

    def export_meta(self):
        """The ArenaMeta that, with the arena bytes and root_offset, re-creates this tree."""
        return export_meta(&self.a)

    def stats(self):
        """Node, leaf, arena, free-list and chunk counters (``dict[str, int]``)."""
        return arena_stats(&self.a)

    def _attach(self, buffer, uint64_t root, meta, chunk_crcs=None, chunk_bytes=65536):
        """Replace this (fresh) tree's arena by ``buffer``, described by the ArenaMeta ``meta``;
        O(1) checks (``load_meta``), no tree walk.

        With ``chunk_crcs`` (uint32, one CRC-32C per ``chunk_bytes`` chunk of the used bytes) the
        arena bytes are not read at all here: the header and the root are checked, and every
        chunk checksummed, when an operation first uses them.
        """
        cdef Py_buffer view
        cdef bint writable = True
        cdef uint32_t shift = 0
        cdef uint8_t* base
        cdef Arena probe
        if self.a.num_leaves or self.a.used != ARENA_HEADER_BYTES or self.exports:
            raise RuntimeError("_attach must be called on a fresh, empty ArtCore")
        if chunk_crcs is not None:
            shift = _chunk_shift(chunk_bytes)
        try:
            PyObject_GetBuffer(buffer, &view, PyBUF_WRITABLE)
        except (BufferError, TypeError):
            writable = False
            PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE)
        memset(&probe, 0, sizeof(Arena))
        base = <uint8_t*>view.buf
        try:
            load_meta(&probe, meta, base, <uint64_t>view.len, root, chunk_crcs, shift)
        except BaseException:
            free(probe.chunk_bits)
            free(probe.chunk_crc)
            PyBuffer_Release(&view)
            raise
        self._drop_storage()
        probe.capacity = <uint64_t>view.len
        probe.root = root
        self.a = probe
        self.view = view
        self.has_view = True
        self.owned = False
        self.writable = writable
        if (<uintptr_t>base) % 8:
            # Misaligned buffer: copy now so every node access stays aligned (offsets, and so
            # the chunk table, are unchanged).
            self.writable = False
            self._relocate(0)
        return self

    # -- full invariant check ------------------------------------------------------------

    def verify(self):
        """Walk the whole tree and free lists, checking every invariant; O(n). Returns stats()."""
        self.a.err = E_OK
        if self.a.gate:
            self._gate_slow()
        problem = verify_walk(&self.a)
        if problem is not None:
            self.a.err = E_OK
            if self.a.gate & GATE_CORRUPT:  # a chunk failed its checksum on the way
                raise ValueError(checksum_msg(self))
            raise ValueError(f"ART invariant violated: {problem}")
        return self.stats()

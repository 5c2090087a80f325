"""Adaptive radix tree (Leis et al., ICDE 2013) living in one offset-addressed byte arena.

Private module: use ``quillcache.art.tree.ArtTree``.  The node layer (layouts, allocation, per-node
child operations) is in ``_art.pxd``; this module holds the tree algorithms and ``ArtCore``.

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
  first verifies the chunks its object overlaps (``need_chunks`` in _art.pxd: one compare and a
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

MAGIC = b"QUILLART"
FORMAT_VERSION = 1
BYTE_ORDER_MARK = 0x01020304
MAX_PREFIX_BYTES = MAX_PREFIX
HEADER_BYTES = ARENA_HEADER_BYTES
NODE_BYTES = {"node4": 64, "node16": 168, "node48": 664, "node256": 2072}
# Worst-case bump allocation of one insert (new leaf + largest grown node + a split Node4).
cdef uint64_t INSERT_SLACK_BYTES = 2072 + 64

cdef extern from *:
    """
    #include <stdlib.h>
    #include <string.h>
    /* Growable list of leaf offsets; starts in its own inline storage (no malloc for small scans). */
    typedef struct { uint64_t *data; size_t n; size_t cap; int heap; uint64_t local[64]; } qart_offbuf;
    static void qart_buf_init(qart_offbuf *b) { b->data = b->local; b->n = 0; b->cap = 64; b->heap = 0; }
    static void qart_buf_free(qart_offbuf *b) { if (b->heap) free(b->data); qart_buf_init(b); }
    static int qart_push(qart_offbuf *b, uint64_t v) {
        if (b->n == b->cap) {
            size_t cap = 2 * b->cap;
            uint64_t *d = b->heap ? (uint64_t *)realloc(b->data, cap * sizeof(uint64_t))
                                  : (uint64_t *)malloc(cap * sizeof(uint64_t));
            if (!d) return -1;
            if (!b->heap) memcpy(d, b->local, b->n * sizeof(uint64_t));
            b->data = d; b->cap = cap; b->heap = 1;
        }
        b->data[b->n++] = v;
        return 0;
    }

    /* Arena memory: 2 MiB-aligned and marked for transparent huge pages when large (random
       descents through a big arena are TLB-bound otherwise). Released with free(). */
    #if defined(__linux__)
    #include <sys/mman.h>
    #endif
    static void *qart_arena_alloc(size_t cap) {
    #if defined(__linux__) && defined(MADV_HUGEPAGE)
        if (cap >= ((size_t)2 << 20)) {
            void *p = NULL;
            if (posix_memalign(&p, (size_t)2 << 20, cap) != 0) return NULL;
            madvise(p, cap, MADV_HUGEPAGE);
            return p;
        }
    #endif
        return malloc(cap);
    }
    static void *qart_arena_move(void *old, size_t used, size_t cap) {
        void *p = qart_arena_alloc(cap);
        if (p) { memcpy(p, old, used); free(old); }
        return p;
    }
    /* Growable matrix of fixed-width byte rows (CSR scan output). */
    typedef struct { uint8_t *data; size_t n; size_t cap; size_t width; } qart_rows;
    static void qart_rows_init(qart_rows *r, size_t width) { r->data = NULL; r->n = 0; r->cap = 0; r->width = width; }
    static void qart_rows_free(qart_rows *r) { free(r->data); r->data = NULL; r->n = 0; r->cap = 0; }
    static int qart_rows_push(qart_rows *r, const uint8_t *row) {
        if (r->n == r->cap) {
            size_t cap = r->cap ? 2 * r->cap : 1024, w = r->width ? r->width : 1;
            uint8_t *d = (uint8_t *)qart_arena_alloc(cap * w);   /* huge pages when large */
            if (!d) return -1;
            if (r->n) memcpy(d, r->data, r->n * w);
            free(r->data);
            r->data = d; r->cap = cap;
        }
        if (r->width) memcpy(r->data + r->n * r->width, row, r->width);
        r->n++;
        return 0;
    }
    """
    ctypedef struct qart_rows:
        uint8_t* data
        size_t n
        size_t width
    void qart_rows_init(qart_rows* r, size_t width) noexcept nogil
    void qart_rows_free(qart_rows* r) noexcept nogil
    int qart_rows_push(qart_rows* r, const uint8_t* row) noexcept nogil
    void* qart_arena_alloc(size_t cap) noexcept nogil
    void* qart_arena_move(void* old, size_t used, size_t cap) noexcept nogil
    ctypedef struct qart_offbuf:
        uint64_t* data
        size_t n
    void qart_buf_init(qart_offbuf* b) noexcept nogil
    void qart_buf_free(qart_offbuf* b) noexcept nogil
    int qart_push(qart_offbuf* b, uint64_t v) noexcept nogil


cdef extern from *:
    """
    /* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial value and final xor ~0: the
       function of the crc32c package). qart_crc32c(crc, p, n) continues a CRC: start from 0, and
       qart_crc32c(qart_crc32c(0, a), b) is the CRC of a || b.
       Two implementations, chosen at run time: SSE4.2's crc32 instruction (only the function that
       uses it is compiled for SSE4.2, so the module runs on any x86-64), three independent streams
       combined with "append N zero bytes" operator tables; and a portable slicing-by-8 loop. */
    #include <stdint.h>
    #include <stddef.h>
    #include <string.h>
    #define QART_CRC_POLY 0x82F63B78u
    static uint32_t qart_crc_tab[8][256];   /* slicing-by-8: tab[k][b] = byte b then k zero bytes */
    static int qart_crc_hw_ok = 0;

    static uint32_t qart_crc32c_sw(uint32_t crc, const uint8_t *p, size_t n) {
        uint32_t c = ~crc, lo, hi;
        while (n && ((uintptr_t)p & 7)) { c = qart_crc_tab[0][(c ^ *p++) & 0xff] ^ (c >> 8); n--; }
        while (n >= 8) {
            lo = ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24) ^ c;
            hi = (uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 | (uint32_t)p[7] << 24;
            c = qart_crc_tab[7][lo & 0xff] ^ qart_crc_tab[6][(lo >> 8) & 0xff]
              ^ qart_crc_tab[5][(lo >> 16) & 0xff] ^ qart_crc_tab[4][lo >> 24]
              ^ qart_crc_tab[3][hi & 0xff] ^ qart_crc_tab[2][(hi >> 8) & 0xff]
              ^ qart_crc_tab[1][(hi >> 16) & 0xff] ^ qart_crc_tab[0][hi >> 24];
            p += 8;
            n -= 8;
        }
        while (n) { c = qart_crc_tab[0][(c ^ *p++) & 0xff] ^ (c >> 8); n--; }
        return ~c;
    }

    #if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    #include <nmmintrin.h>
    #define QART_CRC_HW 1
    #define QART_CRC_LONG 8192   /* bytes per stream in a long 3-stream block (power of two) */
    #define QART_CRC_SHORT 256   /* ... in a short one */
    static uint32_t qart_crc_long[4][256];   /* operator: append QART_CRC_LONG zero bytes */
    static uint32_t qart_crc_short[4][256];

    static inline uint32_t qart_crc_shift(uint32_t z[4][256], uint32_t c) {
        return z[0][c & 0xff] ^ z[1][(c >> 8) & 0xff] ^ z[2][(c >> 16) & 0xff] ^ z[3][c >> 24];
    }

    __attribute__((target("sse4.2")))
    static uint32_t qart_crc32c_hw(uint32_t crc, const uint8_t *p, size_t n) {
        uint64_t c0 = (uint32_t)~crc, c1, c2, w0, w1, w2;
        const uint8_t *end;
        while (n && ((uintptr_t)p & 7)) { c0 = _mm_crc32_u8((uint32_t)c0, *p++); n--; }
        /* The instruction has a latency of ~3 cycles and a throughput of 1: three independent
           streams over consecutive blocks keep it busy; the register state of a stream that
           started at 0 is combined as crc(A || B) = shift_|B|(crc(A)) ^ crc0(B) (linearity). */
        while (n >= 3 * QART_CRC_LONG) {
            c1 = 0; c2 = 0; end = p + QART_CRC_LONG;
            do {
                memcpy(&w0, p, 8); memcpy(&w1, p + QART_CRC_LONG, 8); memcpy(&w2, p + 2 * QART_CRC_LONG, 8);
                c0 = _mm_crc32_u64(c0, w0); c1 = _mm_crc32_u64(c1, w1); c2 = _mm_crc32_u64(c2, w2);
                p += 8;
            } while (p < end);
            c0 = qart_crc_shift(qart_crc_long, (uint32_t)c0) ^ (uint32_t)c1;
            c0 = qart_crc_shift(qart_crc_long, (uint32_t)c0) ^ (uint32_t)c2;
            p += 2 * QART_CRC_LONG;
            n -= 3 * QART_CRC_LONG;
        }
        while (n >= 3 * QART_CRC_SHORT) {
            c1 = 0; c2 = 0; end = p + QART_CRC_SHORT;
            do {
                memcpy(&w0, p, 8); memcpy(&w1, p + QART_CRC_SHORT, 8); memcpy(&w2, p + 2 * QART_CRC_SHORT, 8);
                c0 = _mm_crc32_u64(c0, w0); c1 = _mm_crc32_u64(c1, w1); c2 = _mm_crc32_u64(c2, w2);
                p += 8;
            } while (p < end);
            c0 = qart_crc_shift(qart_crc_short, (uint32_t)c0) ^ (uint32_t)c1;
            c0 = qart_crc_shift(qart_crc_short, (uint32_t)c0) ^ (uint32_t)c2;
            p += 2 * QART_CRC_SHORT;
            n -= 3 * QART_CRC_SHORT;
        }
        while (n >= 8) { memcpy(&w0, p, 8); c0 = _mm_crc32_u64(c0, w0); p += 8; n -= 8; }
        while (n) { c0 = _mm_crc32_u8((uint32_t)c0, *p++); n--; }
        return ~(uint32_t)c0;
    }
    #else
    #define QART_CRC_HW 0
    #endif

    /* GF(2) 32x32 matrices as 32 column words (column k = image of bit k). */
    static uint32_t qart_gf2_times(const uint32_t *mat, uint32_t vec) {
        uint32_t sum = 0;
        while (vec) { if (vec & 1) sum ^= *mat; vec >>= 1; mat++; }
        return sum;
    }
    static void qart_crc_zeros(uint32_t z[4][256], size_t len_bytes) {
        /* Operator "feed len_bytes (a power of two) zero bytes" on the raw CRC register, as four
           byte-indexed tables: start from one zero bit and square 3 + log2(len_bytes) times. */
        uint32_t op[32], sq[32];
        size_t bits = len_bytes * 8;
        int k, b;
        op[0] = QART_CRC_POLY;
        for (k = 1; k < 32; k++) op[k] = 1u << (k - 1);
        while (bits > 1) {
            for (k = 0; k < 32; k++) sq[k] = qart_gf2_times(op, op[k]);
            memcpy(op, sq, sizeof(op));
            bits >>= 1;
        }
        for (b = 0; b < 256; b++)
            for (k = 0; k < 4; k++) z[k][b] = qart_gf2_times(op, (uint32_t)b << (8 * k));
    }

    static void qart_crc_init(void) {
        uint32_t c;
        int b, k;
        for (b = 0; b < 256; b++) {
            c = (uint32_t)b;
            for (k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ QART_CRC_POLY : c >> 1;
            qart_crc_tab[0][b] = c;
        }
        for (b = 0; b < 256; b++)
            for (k = 1; k < 8; k++)
                qart_crc_tab[k][b] = (qart_crc_tab[k - 1][b] >> 8) ^ qart_crc_tab[0][qart_crc_tab[k - 1][b] & 0xff];
    #if QART_CRC_HW
        qart_crc_zeros(qart_crc_long, QART_CRC_LONG);
        qart_crc_zeros(qart_crc_short, QART_CRC_SHORT);
        __builtin_cpu_init();
        qart_crc_hw_ok = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    #endif
    }

    /* impl: 0 = best available, 1 = SSE4.2 (caller checked qart_crc_hw_ok), 2 = portable. */
    static uint32_t qart_crc32c_impl(uint32_t crc, const uint8_t *p, size_t n, int impl) {
    #if QART_CRC_HW
        if (impl != 2 && qart_crc_hw_ok) return qart_crc32c_hw(crc, p, n);
    #endif
        return qart_crc32c_sw(crc, p, n);
    }
    static uint32_t qart_crc32c(uint32_t crc, const uint8_t *p, size_t n) {
        return qart_crc32c_impl(crc, p, n, 0);
    }
    """
    int qart_crc_hw_ok
    void qart_crc_init() noexcept nogil
    uint32_t qart_crc32c(uint32_t crc, const uint8_t* p, size_t n) noexcept nogil
    uint32_t qart_crc32c_impl(uint32_t crc, const uint8_t* p, size_t n, int impl) noexcept nogil


qart_crc_init()
CRC32C_HW = bool(qart_crc_hw_ok)   # True when the SSE4.2 path is in use


ctypedef struct Iter:
    int sp
    uint64_t pending          # subtree (tagged) to emit before resuming the stack
    uint64_t budget           # objects still allowed to be visited
    Hdr* node[MAX_DEPTH]
    uint8_t ntype[MAX_DEPTH]  # type each node was validated as (trusted over its header)
    int pos[MAX_DEPTH]


ctypedef struct PrefixHit:
    uint64_t target           # tagged subtree whose keys all start with the prefix (0 = none)
    uint64_t* ref             # slot holding target
    uint64_t* parent_ref      # slot holding the parent node (NULL if target is the root)
    Hdr* parent
    uint8_t byte              # parent's child byte leading to target


# ---------------------------------------------------------------------------------------------
# tree algorithms (no Python objects; report failures through a.err)
# ---------------------------------------------------------------------------------------------

cdef int check_chunk(Arena* a, uint64_t c) noexcept nogil:
    """Checksum chunk ``c`` (< num_chunks, bit clear): set its bit, or mark the arena corrupt."""
    cdef uint64_t lo = c << a.chunk_shift
    cdef uint64_t hi = lo + (<uint64_t>1 << a.chunk_shift)
    if hi > a.table_end:
        hi = a.table_end
    if qart_crc32c(0, a.base + lo, hi - lo) != a.chunk_crc[c]:
        a.gate |= GATE_CORRUPT
        a.bad_chunk = c
        a.err = E_CHECKSUM
        return -1
    a.chunk_bits[c >> 6] |= <uint64_t>1 << (c & 63)
    a.chunks_verified += 1
    if a.chunks_verified == a.num_chunks:
        a.lazy_end = 0  # everything verified: from now on the per-dereference check is one compare
    return 0


cdef int verify_chunks(Arena* a, uint64_t off, uint64_t end) noexcept nogil:
    """Slow path of ``need_chunks``: checksum each unverified chunk that [off, end) overlaps
    (clipped to the table).  0, or -1 with err = E_CHECKSUM (the arena is then corrupt for good)."""
    cdef uint64_t c, c1
    if a.gate & GATE_CORRUPT:
        a.err = E_CHECKSUM
        return -1
    if a.num_chunks == 0 or off >= a.table_end or end <= off:
        return 0
    c = off >> a.chunk_shift
    c1 = (end - 1) >> a.chunk_shift
    if c1 >= a.num_chunks:
        c1 = a.num_chunks - 1
    while c <= c1:
        if not chunk_bit(a, c) and check_chunk(a, c) < 0:
            return -1
        c += 1
    return 0


cdef inline int key_cmp(const uint8_t* x, uint32_t xl, const uint8_t* y, uint32_t yl) noexcept nogil:
    cdef int r = memcmp(x, y, xl if xl < yl else yl)
    if r:
        return r
    return (xl > yl) - (xl < yl)


cdef uint64_t art_lookup(Arena* a, const uint8_t* key, uint32_t kl) noexcept nogil:
    """Tagged leaf offset holding ``key``, else 0 (a.err tells corruption apart)."""
    cdef uint64_t n = a.root
    cdef uint32_t d = 0, p
    cdef Hdr* h
    cdef uint8_t* lf
    cdef uint64_t* slot
    while n:
        if n & 1:
            lf = leaf_at(a, n)
            if lf != NULL and lf[0] == kl and memcmp(lf + 1, key, kl) == 0:
                return n
            return 0
        h = node_at(a, n)
        if h == NULL:
            return 0
        p = h.prefix_len
        if p:
            if d + p >= kl or memcmp(h.prefix, key + d, p if p < MAX_PREFIX else MAX_PREFIX) != 0:
                return 0
            d += p
        elif d >= kl:
            return 0
        slot = find_child(a, h, key[d])
        if slot == NULL:
            return 0
        n = slot[0]
        d += 1
    return 0


cdef int split_leaf_or_prefix(Arena* a, uint64_t* ref, const uint8_t* prefix, uint32_t plen,
                              uint8_t old_byte, uint64_t old_child, uint8_t new_byte,
                              const uint8_t* key, uint32_t kl, const uint8_t* val) noexcept nogil:
    """``*ref`` becomes a Node4 with ``prefix`` and children old_child / a new leaf for key."""
    cdef uint64_t leaf, nn
    cdef Node4* n4
    if prepare_pops(a, leaf_bytes(a, kl), QART_NODE_SIZE[NODE4]) < 0:
        return -1
    leaf = new_leaf(a, key, kl, val)
    if leaf == 0:
        return -1
    nn = new_node(a, NODE4)
    if nn == 0:
        return -1
    n4 = <Node4*>(a.base + nn)
    n4.h.prefix_len = <uint8_t>plen
    memcpy(n4.h.prefix, prefix, plen if plen < MAX_PREFIX else MAX_PREFIX)
    n4.h.num_children = 2
    if old_byte < new_byte:
        n4.keys[0] = old_byte
        n4.children[0] = old_child
        n4.keys[1] = new_byte
        n4.children[1] = leaf
    else:
        n4.keys[0] = new_byte
        n4.children[0] = leaf
        n4.keys[1] = old_byte
        n4.children[1] = old_child
    ref[0] = nn
    return 1


cdef inline uint32_t grown_bytes(Hdr* h) noexcept nogil:
    """Size of the node that adding one child to validated node ``h`` allocates (0: none)."""
    cdef uint8_t t = h.type
    if t < NODE256 and h.num_children >= QART_NODE_CAP[t]:
        return QART_NODE_SIZE[t + 1]
    return 0


cdef int conflict(Arena* a, uint64_t n) noexcept nogil:
    """Record a prefix conflict with the smallest key under ``n``; returns -1."""
    cdef uint64_t ml = min_leaf(a, n)
    cdef uint8_t* lf = leaf_at(a, ml) if ml else NULL
    if lf == NULL:
        a.err = E_CORRUPT
        return -1
    a.err = E_PREFIX
    a.conflict_len = lf[0]
    return -1


cdef int art_insert(Arena* a, const uint8_t* key, uint32_t kl, const uint8_t* val) noexcept nogil:
    """Insert or replace; 1 = new key, 0 = replaced, -1 = failure (a.err, a.conflict_len)."""
    cdef uint64_t* ref = &a.root
    cdef uint64_t* slot
    cdef uint64_t n, leaf, ml
    cdef uint32_t d = 0, p, i, j, m, lim, newp, lkl
    cdef uint8_t* lf
    cdef const uint8_t* full
    cdef uint8_t old_byte
    cdef uint8_t saved[MAX_PREFIX]
    cdef Hdr* h
    while True:
        n = ref[0]
        if n == 0:
            leaf = new_leaf(a, key, kl, val)
            if leaf == 0:
                return -1
            ref[0] = leaf
            return 1
        if n & 1:
            lf = leaf_at(a, n)
            if lf == NULL:
                return -1
            lkl = lf[0]
            lim = kl if kl < lkl else lkl
            i = d
            while i < lim and lf[1 + i] == key[i]:
                i += 1
            if i == lim:
                if kl == lkl and memcmp(lf + 1, key, kl) == 0:
                    memmove(lf + 1 + kl, val, a.value_size)
                    return 0
                if kl == lkl:  # differs before depth d: only in a damaged tree
                    a.err = E_CORRUPT
                    return -1
                a.err = E_PREFIX
                a.conflict_len = lkl
                return -1
            return split_leaf_or_prefix(a, ref, key + d, i - d, lf[1 + i], n, key[i], key, kl, val)
        h = node_at(a, n)
        if h == NULL:
            return -1
        p = h.prefix_len
        if p:
            full = h.prefix
            if p > MAX_PREFIX:
                ml = min_leaf(a, n)
                lf = leaf_at(a, ml) if ml else NULL
                if lf == NULL or lf[0] <= d + p:
                    a.err = E_CORRUPT
                    return -1
                full = lf + 1 + d
            lim = kl - d if kl > d else 0
            j = 0
            while j < p and j < lim and full[j] == key[d + j]:
                j += 1
            if j < p:
                if j == lim:
                    return conflict(a, n)
                # Split the compressed path at j: new Node4 (prefix[:j]) -> old node (prefix[j+1:]).
                old_byte = full[j]
                newp = p - j - 1
                m = newp if newp < MAX_PREFIX else MAX_PREFIX
                memcpy(saved, full + j + 1, m)
                i = split_leaf_or_prefix(a, ref, key + d, j, old_byte, n, key[d + j], key, kl, val)
                if i == 1:
                    memcpy(h.prefix, saved, m)
                    h.prefix_len = <uint8_t>newp
                return i
            d += p
        if d >= kl:
            return conflict(a, n)
        slot = find_child(a, h, key[d])
        if slot == NULL or slot[0] == 0:
            if a.err:
                return -1
            if prepare_pops(a, leaf_bytes(a, kl), grown_bytes(h)) < 0:
                return -1
            leaf = new_leaf(a, key, kl, val)
            if leaf == 0 or add_child(a, ref, key[d], leaf) < 0:
                return -1
            return 1
        ref = slot
        d += 1


cdef int art_remove(Arena* a, const uint8_t* key, uint32_t kl) noexcept nogil:
    """1 = removed, 0 = absent, -1 = corrupt."""
    cdef uint64_t* ref = &a.root
    cdef uint64_t* slot
    cdef uint64_t n = a.root, c
    cdef uint32_t d = 0, p
    cdef uint8_t* lf
    cdef Hdr* h
    if n == 0:
        return 0
    if n & 1:
        lf = leaf_at(a, n)
        if lf == NULL:
            return -1
        if lf[0] != kl or memcmp(lf + 1, key, kl) != 0:
            return 0
        a.root = 0
        free_leaf(a, n, lf[0])
        return 1
    while True:
        h = node_at(a, n)
        if h == NULL:
            return -1
        p = h.prefix_len
        if p:
            if d + p >= kl or memcmp(h.prefix, key + d, p if p < MAX_PREFIX else MAX_PREFIX) != 0:
                return 0
            d += p
        elif d >= kl:
            return 0
        slot = find_child(a, h, key[d])
        if slot == NULL or slot[0] == 0:
            return -1 if a.err else 0
        c = slot[0]
        if c & 1:
            lf = leaf_at(a, c)
            if lf == NULL:
                return -1
            if lf[0] != kl or memcmp(lf + 1, key, kl) != 0:
                return 0
            if remove_child(a, ref, key[d], slot) < 0:
                return -1
            free_leaf(a, c, <uint8_t>kl)
            return 1
        ref = slot
        n = c
        d += 1


cdef int find_prefix(Arena* a, const uint8_t* pre, uint32_t plen, PrefixHit* hit) noexcept nogil:
    """Locate the subtree holding exactly the keys that start with ``pre``.

    An inner target is only known to match up to optimistic (unstored) prefix bytes: callers
    check one of its leaves.  Returns 0, or -1 on corruption.
    """
    cdef uint64_t n = a.root
    cdef uint32_t d = 0, p, m
    cdef uint8_t* lf
    cdef uint64_t* slot
    cdef Hdr* h
    hit.target = 0
    hit.ref = &a.root
    hit.parent_ref = NULL
    hit.parent = NULL
    while n:
        if n & 1:
            lf = leaf_at(a, n)
            if lf == NULL:
                return -1
            if lf[0] >= plen and memcmp(lf + 1, pre, plen) == 0:
                hit.target = n
            return 0
        h = node_at(a, n)
        if h == NULL:
            return -1
        p = h.prefix_len
        m = p if p < MAX_PREFIX else MAX_PREFIX
        if m > plen - d:
            m = plen - d
        if memcmp(h.prefix, pre + d, m) != 0:
            return 0
        if d + p >= plen:
            hit.target = n
            return 0
        d += p
        slot = find_child(a, h, pre[d])
        if slot == NULL or slot[0] == 0:
            return -1 if a.err else 0
        hit.parent_ref = hit.ref
        hit.parent = h
        hit.byte = pre[d]
        hit.ref = slot
        n = slot[0]
        if n < a.used:
            # Start the child's later cache lines now (a Node16/48 spans several; a leaf may
            # straddle two): they load in parallel with its first line instead of after it.
            qart_prefetch(a.base + (n & ~(<uint64_t>7)) + 64)
        d += 1
    return 0


cdef inline void iter_init(Arena* a, Iter* it, uint64_t pending) noexcept nogil:
    it.sp = 0
    it.pending = pending
    it.budget = (a.used >> 3) + 1


cdef uint64_t iter_next(Arena* a, Iter* it) noexcept nogil:
    """Next leaf (tagged) in ascending key order, or 0 at the end or on corruption (a.err)."""
    cdef uint64_t c = it.pending
    cdef Hdr* h
    it.pending = 0
    while True:
        if c:
            if it.budget == 0:
                a.err = E_CORRUPT
                return 0
            it.budget -= 1
            if c & 1:
                return c
            if it.sp >= MAX_DEPTH:
                a.err = E_CORRUPT
                return 0
            h = node_at(a, c)
            if h == NULL:
                return 0
            prefetch_children(a, h)
            it.node[it.sp] = h
            it.ntype[it.sp] = h.type
            it.pos[it.sp] = 0
            it.sp += 1
        if it.sp == 0:
            return 0
        c = next_child(a, it.node[it.sp - 1], it.ntype[it.sp - 1], &it.pos[it.sp - 1])
        if c == 0:
            if a.err:
                return 0
            it.sp -= 1


cdef int iter_seek(Arena* a, Iter* it, const uint8_t* s, uint32_t slen, bint exclusive) noexcept nogil:
    """Position ``it`` at the first key >= s (> s if exclusive). 0, or -1 on corruption."""
    cdef uint64_t n = a.root, ml
    cdef uint32_t d = 0, p, j
    cdef uint8_t* lf
    cdef const uint8_t* full
    cdef uint64_t* slot
    cdef Hdr* h
    cdef int r
    iter_init(a, it, 0)
    while n:
        if n & 1:
            lf = leaf_at(a, n)
            if lf == NULL:
                return -1
            r = key_cmp(lf + 1, lf[0], s, slen)
            if r > 0 or (r == 0 and not exclusive):
                it.pending = n
            return 0
        h = node_at(a, n)
        if h == NULL:
            return -1
        p = h.prefix_len
        if p:
            full = h.prefix
            if p > MAX_PREFIX:
                ml = min_leaf(a, n)
                lf = leaf_at(a, ml) if ml else NULL
                if lf == NULL or lf[0] <= d + p:
                    a.err = E_CORRUPT
                    return -1
                full = lf + 1 + d
            for j in range(p):
                if d + j >= slen or full[j] > s[d + j]:
                    it.pending = n      # whole subtree sorts after s
                    return 0
                if full[j] < s[d + j]:
                    return 0            # whole subtree sorts before s
            d += p
        if d >= slen:
            it.pending = n
            return 0
        if it.sp >= MAX_DEPTH:
            a.err = E_CORRUPT
            return -1
        it.node[it.sp] = h
        it.ntype[it.sp] = h.type
        it.pos[it.sp] = pos_after(h, h.type, s[d])
        it.sp += 1
        slot = find_child(a, h, s[d])
        if slot == NULL or slot[0] == 0:
            return -1 if a.err else 0
        n = slot[0]
        d += 1
    return 0


cdef enum:
    WARM_GROUP = 16   # keys whose descents are interleaved by warm_paths


cdef void warm_paths(Arena* a, const uint8_t* rows, Py_ssize_t stride, uint32_t length,
                     Py_ssize_t count, bint prefix_mode) noexcept nogil:
    """Cache-warming hint: walk up to WARM_GROUP descents in lock-step, prefetching each lane's
    next node, so their memory misses overlap instead of queueing one descent after another.

    Purely a hint: it changes nothing, clears any error it meets and stops at a chunk not yet
    verified (the real operation that follows re-walks the now-cached path with full checks). In
    prefix mode it also prefetches the children of each prefix's subtree root, where the scan
    will start.
    """
    cdef uint64_t cur[WARM_GROUP]
    cdef uint32_t dep[WARM_GROUP]
    cdef int saved = a.err, i, rnd, active
    cdef uint64_t n, c
    cdef uint32_t d
    cdef Hdr* h
    cdef uint64_t* slot
    cdef const uint8_t* key
    if count > WARM_GROUP:
        count = WARM_GROUP
    for i in range(count):
        cur[i] = a.root
        dep[i] = 0
    for rnd in range(MAX_DEPTH):
        active = 0
        for i in range(count):
            n = cur[i]
            if n == 0 or (n & 1):
                cur[i] = 0
                continue
            h = node_peek(a, n)
            if h == NULL:
                cur[i] = 0
                continue
            d = dep[i] + h.prefix_len
            if d >= length:
                if prefix_mode:
                    prefetch_children(a, h)
                cur[i] = 0
                continue
            key = rows + i * stride
            slot = find_child(a, h, key[d])
            if slot == NULL or slot[0] == 0 or slot[0] >= a.used:
                cur[i] = 0
                continue
            c = slot[0] & ~(<uint64_t>7)
            qart_prefetch(a.base + c)
            qart_prefetch(a.base + c + 64)
            qart_prefetch(a.base + c + 128)
            cur[i] = slot[0]
            dep[i] = d + 1
            active += 1
        if active == 0:
            break
    a.err = saved


cdef enum:
    PREFETCH_NODES = 32   # inner nodes a subtree prefetch walks breadth-first


cdef void prefetch_subtree(Arena* a, uint64_t root) noexcept nogil:
    """Cache-warming hint: breadth-first over the first PREFETCH_NODES inner nodes of a subtree,
    prefetching every child, so a scan's leaf misses overlap level by level instead of one
    node at a time. Changes nothing; clears any error it meets; stops at an unverified chunk."""
    cdef uint64_t q[PREFETCH_NODES]
    cdef int head = 0, tail = 1, pos
    cdef int saved = a.err
    cdef uint64_t c
    cdef Hdr* h
    q[0] = root
    while head < tail:
        h = node_peek(a, q[head])
        head += 1
        if h == NULL:
            break
        pos = 0
        while True:
            c = next_child(a, h, h.type, &pos)
            if c == 0 or c >= a.used:
                break
            qart_prefetch(a.base + (c & ~(<uint64_t>7)))
            if (c & 1) == 0 and tail < PREFETCH_NODES:
                q[tail] = c
                tail += 1
    a.err = saved


cdef inline void block_prefix(uint8_t* p, uint8_t head, uint64_t number) noexcept nogil:
    """The 9-byte prefix ``head || number`` (big-endian) of the residency index's block keys."""
    cdef int i
    p[0] = head
    for i in range(8):
        p[8 - i] = <uint8_t>(number >> (8 * i))


cdef int64_t collect_prefix(Arena* a, const uint8_t* pre, uint32_t plen, int64_t limit,
                            qart_offbuf* out, bint count_only) noexcept nogil:
    """Append (or count) up to ``limit`` (< 0: all) leaves whose key starts with ``pre``."""
    cdef PrefixHit hit
    cdef Iter it
    cdef uint64_t c
    cdef uint8_t* lf
    cdef int64_t k = 0
    if find_prefix(a, pre, plen, &hit) < 0:
        return -1
    if hit.target == 0:
        return 0
    if (hit.target & 1) == 0 and limit != 0:
        prefetch_subtree(a, hit.target)
    iter_init(a, &it, hit.target)
    while limit < 0 or k < limit:
        c = iter_next(a, &it)
        if c == 0:
            return -1 if a.err else k
        lf = leaf_at(a, c)
        if lf == NULL:
            return -1
        if k == 0 and (lf[0] < plen or memcmp(lf + 1, pre, plen) != 0):
            return 0  # the optimistic path bytes did not match after all
        if not count_only and qart_push(out, c) < 0:
            a.err = E_OOM
            return -1
        k += 1
    return k


cdef int touch_subtree(Arena* a, uint64_t root) noexcept nogil:
    """Dereference every node and leaf under inner node ``root`` (verifying their chunks) without
    changing anything; 0, or -1 (a.err) on corruption or a checksum mismatch."""
    cdef Iter it
    cdef uint64_t c
    iter_init(a, &it, root)
    while True:
        c = iter_next(a, &it)
        if c == 0:
            return -1 if a.err else 0
        if leaf_at(a, c) == NULL:
            return -1


cdef int64_t free_subtree(Arena* a, uint64_t root) noexcept nogil:
    """Free every node and leaf under ``root`` (tagged); returns the number of leaves freed."""
    cdef Iter it
    cdef uint64_t c
    cdef int64_t k = 0
    cdef uint8_t* lf
    cdef Hdr* h
    iter_init(a, &it, 0)
    if root & 1:
        lf = leaf_at(a, root)
        if lf == NULL:
            return -1
        free_leaf(a, root, lf[0])
        return 1
    h = node_at(a, root)
    if h == NULL:
        return -1
    it.node[0] = h
    it.ntype[0] = h.type
    it.pos[0] = 0
    it.sp = 1
    while it.sp:
        c = next_child(a, it.node[it.sp - 1], it.ntype[it.sp - 1], &it.pos[it.sp - 1])
        if a.err:
            return -1
        if c == 0:
            # the node's children are all gone: free the node itself
            it.sp -= 1
            free_node(a, <uint64_t>(<uint8_t*>it.node[it.sp] - a.base), it.ntype[it.sp])
            if a.err:
                return -1
            continue
        if it.budget == 0:
            a.err = E_CORRUPT
            return -1
        it.budget -= 1
        if c & 1:
            lf = leaf_at(a, c)
            if lf == NULL:
                return -1
            free_leaf(a, c, lf[0])
            k += 1
            continue
        if it.sp >= MAX_DEPTH:
            a.err = E_CORRUPT
            return -1
        h = node_at(a, c)
        if h == NULL:
            return -1
        it.node[it.sp] = h
        it.ntype[it.sp] = h.type
        it.pos[it.sp] = 0
        it.sp += 1
    return k


# ---------------------------------------------------------------------------------------------
# Python-facing core (validation of anything that matters for memory safety lives here too)
# ---------------------------------------------------------------------------------------------

cdef void write_header(uint8_t* base, uint32_t value_size) noexcept nogil:
    memset(base, 0, ARENA_HEADER_BYTES)
    memcpy(base, b"QUILLART", 8)
    (<uint32_t*>(base + 8))[0] = 1               # FORMAT_VERSION
    (<uint32_t*>(base + 12))[0] = 0x01020304     # byte-order mark
    (<uint32_t*>(base + 16))[0] = value_size
    (<uint32_t*>(base + 20))[0] = MAX_PREFIX


cdef char* FORMAT_B = "B"


cdef object _header_problem(const uint8_t* base, uint64_t nbytes, uint32_t value_size):
    """Why the 64-byte arena header at ``base`` is not this module's for ``value_size``, or None."""
    cdef uint32_t vs
    if nbytes < ARENA_HEADER_BYTES:
        return f"buffer of {nbytes} bytes is smaller than the {ARENA_HEADER_BYTES}-byte arena header"
    if memcmp(base, b"QUILLART", 8) != 0:
        return "buffer does not start with the arena magic b'QUILLART'"
    if (<uint32_t*>(base + 12))[0] != 0x01020304:
        return "arena byte order does not match this machine"
    if (<uint32_t*>(base + 8))[0] != FORMAT_VERSION or (<uint32_t*>(base + 20))[0] != MAX_PREFIX:
        return f"unsupported arena format version {(<uint32_t*>(base + 8))[0]}"
    vs = (<uint32_t*>(base + 16))[0]
    if vs != value_size:
        return f"meta value_size {value_size} does not match the arena header's {vs}"
    return None


cdef uint32_t _chunk_shift(object chunk_bytes) except 0:
    """log2 of ``chunk_bytes``: an int that is a power of two in 4 KiB..16 MiB."""
    cdef object v
    if isinstance(chunk_bytes, bool):
        raise TypeError("chunk_bytes must be an int, got bool")
    try:
        v = operator.index(chunk_bytes)
    except TypeError:
        raise TypeError(f"chunk_bytes must be an int, got {type(chunk_bytes).__name__}") from None
    if not (1 << MIN_CHUNK_SHIFT) <= v <= (1 << MAX_CHUNK_SHIFT) or v & (v - 1):
        raise ValueError(f"chunk_bytes must be a power of two in {1 << MIN_CHUNK_SHIFT}.."
                         f"{1 << MAX_CHUNK_SHIFT}, got {v}")
    return <uint32_t>(v.bit_length() - 1)


def _crc32c(buffer, impl="auto"):
    """CRC-32C of a buffer's bytes (as ``crc32c.crc32c``). ``impl``: "auto" (what the arena uses),
    "sse42" (ValueError where the CPU lacks it) or "portable" (slicing-by-8). For tests."""
    cdef Py_buffer view
    cdef int which
    cdef uint32_t r
    if impl == "auto":
        which = 0
    elif impl == "sse42":
        if not qart_crc_hw_ok:
            raise ValueError("impl 'sse42': this CPU (or build) has no SSE4.2 CRC-32C instruction")
        which = 1
    elif impl == "portable":
        which = 2
    else:
        raise ValueError(f"impl must be 'auto', 'sse42' or 'portable', got {impl!r}")
    PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE)
    try:
        r = qart_crc32c_impl(0, <const uint8_t*>view.buf, <size_t>view.len, which)
    finally:
        PyBuffer_Release(&view)
    return r


cdef str _corrupt_msg():
    return ("corrupt arena: an offset or node field is out of range "
            "(was this tree attached to damaged bytes?)")


cdef class _RowsOwner:
    """Owns a malloc'ed result matrix handed to numpy without a copy (np.frombuffer)."""

    cdef uint8_t* data
    cdef Py_ssize_t nbytes

    def __getbuffer__(self, Py_buffer* buffer, int flags):
        buffer.buf = <void*>self.data
        buffer.obj = self
        buffer.len = self.nbytes
        buffer.readonly = 0
        buffer.itemsize = 1
        buffer.format = NULL
        if flags & PyBUF_FORMAT:
            buffer.format = FORMAT_B
        buffer.ndim = 1
        buffer.shape = &self.nbytes if flags & PyBUF_ND else NULL
        buffer.strides = NULL
        buffer.suboffsets = NULL
        buffer.internal = NULL

    def __releasebuffer__(self, Py_buffer* buffer):
        pass

    def __dealloc__(self):
        free(self.data)


cdef object rows_to_array(qart_rows* r, Py_ssize_t width):
    """numpy uint8[r.n, width] taking over r's memory (r is left empty)."""
    cdef _RowsOwner owner
    if r.n == 0 or width == 0:
        return np.zeros((r.n, width), dtype=np.uint8)
    owner = _RowsOwner.__new__(_RowsOwner)
    owner.data = r.data
    owner.nbytes = <Py_ssize_t>(r.n * width)
    r.data = NULL
    return np.frombuffer(owner, dtype=np.uint8).reshape(<Py_ssize_t>r.n, width)


cdef int64_t _check_limit(object limit) except -2:
    """A scan limit: an int in 0..2**62 (bool rejected), as the reference checks it."""
    cdef object v
    if isinstance(limit, bool):
        raise TypeError("limit must be an int, got bool")
    try:
        v = operator.index(limit)
    except TypeError:
        raise TypeError(f"limit must be an int, got {type(limit).__name__}") from None
    if not 0 <= v <= 2**62:
        raise ValueError(f"limit must be in 0..{2**62}, got {v}")
    return v


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

    cdef str _checksum_msg(self):
        cdef uint64_t c = self.a.bad_chunk
        cdef uint64_t lo = c << self.a.chunk_shift
        cdef uint64_t hi = lo + (<uint64_t>1 << self.a.chunk_shift)
        if self.header_bad:
            return ("corrupt arena: the header passes its checksum but is refused ("
                    f"{_header_problem(self.a.base, self.a.used, self.a.value_size)})")
        if hi > self.a.table_end:
            hi = self.a.table_end
        return f"corrupt arena: chunk {c} (bytes {lo}..{hi - 1}) checksum mismatch"

    cdef int _gate_slow(self) except -1:
        """Run when ``a.gate`` is set: refuse a corrupt arena; verify and check a lazily attached
        header before the first operation uses the arena."""
        if self.a.gate & GATE_CORRUPT:
            self.a.err = E_OK
            raise ValueError(self._checksum_msg())
        if self.a.gate & GATE_HEADER:
            if need_chunks(&self.a, 0, ARENA_HEADER_BYTES, False) < 0:
                self.a.err = E_OK
                raise ValueError(self._checksum_msg())
            if _header_problem(self.a.base, self.a.used, self.a.value_size) is not None:
                self.a.gate |= GATE_CORRUPT
                self.header_bad = True
                raise ValueError(self._checksum_msg())
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
                    raise ValueError(self._checksum_msg())
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
        cdef uint64_t n, i, lo, hi, cb = <uint64_t>1 << shift
        self._verify_pending()
        n = (self.a.used + cb - 1) >> shift
        out = np.empty(n, dtype=np.uint32)
        cdef uint32_t[::1] o = out
        for i in range(n):
            lo = i << shift
            hi = lo + cb if lo + cb < self.a.used else self.a.used
            o[i] = qart_crc32c(0, self.a.base + lo, hi - lo)
        return out

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
            raise ValueError(self._checksum_msg())
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

    cdef list _build_items(self, qart_offbuf* buf, size_t start):
        """(key, value) tuples for leaf offsets buf[start:], read with bounds checks."""
        cdef list out = PyList_New(buf.n - start)
        cdef size_t i
        cdef uint8_t* lf
        cdef object k, v, pair
        self.busy += 1
        try:
            for i in range(start, buf.n):
                lf = leaf_at(&self.a, buf.data[i])
                if lf == NULL:
                    self._fail(0)
                k = PyBytes_FromStringAndSize(<char*>lf + 1, lf[0])
                v = PyBytes_FromStringAndSize(<char*>lf + 1 + lf[0], self.a.value_size)
                pair = PyTuple_New(2)
                Py_INCREF(k)
                PyTuple_SET_ITEM(pair, 0, k)
                Py_INCREF(v)
                PyTuple_SET_ITEM(pair, 1, v)
                Py_INCREF(pair)
                PyList_SET_ITEM(out, i - start, pair)
        finally:
            self.busy -= 1
        return out

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
            return self._build_items(&buf, 0)
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
        cdef Py_ssize_t plen = self._key_len(prefix, "prefix", 0)
        cdef const uint8_t* p = <const uint8_t*>PyBytes_AS_STRING(prefix)
        cdef PrefixHit hit
        cdef uint64_t ml, n
        cdef uint8_t* lf
        cdef int64_t k
        if self.a.gate:
            self._gate_slow()
        self._reserve(INSERT_SLACK_BYTES)
        if plen == 0:
            n = self.a.num_leaves
            self._reset()
            return n
        if find_prefix(&self.a, p, <uint32_t>plen, &hit) < 0:
            self._fail(plen)
        if hit.target == 0:
            return 0
        ml = min_leaf(&self.a, hit.target) if (hit.target & 1) == 0 else hit.target
        lf = leaf_at(&self.a, ml) if ml else NULL
        if lf == NULL:
            self._fail(plen)
        if lf[0] < plen or memcmp(lf + 1, p, plen) != 0:
            return 0
        # Lazy checksums: verify the whole doomed subtree before unlinking or freeing any of it,
        # so a mismatch leaves the tree untouched.
        if self.a.lazy_end and (hit.target & 1) == 0 and touch_subtree(&self.a, hit.target) < 0:
            self._fail(plen)
        if hit.parent == NULL:
            self.a.root = 0
        elif remove_child(&self.a, hit.parent_ref, hit.byte, hit.ref) < 0:
            self._fail(plen)
        k = free_subtree(&self.a, hit.target)
        if k < 0:
            self._fail(plen)
        return k

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
        cdef Iter it
        cdef qart_offbuf buf
        cdef uint64_t c
        cdef Py_ssize_t slen = 0 if start is None else PyBytes_GET_SIZE(start)
        if slen > 255:
            raise ValueError(f"start key length must be in 0..255 bytes, got {slen}")
        if self.a.gate:
            self._gate_slow()
        if start is None or slen == 0:
            iter_init(&self.a, &it, self.a.root)
        elif iter_seek(&self.a, &it, <const uint8_t*>PyBytes_AS_STRING(start), <uint32_t>slen,
                       exclusive) < 0:
            self._fail(slen)
        qart_buf_init(&buf)
        try:
            while limit < 0 or <Py_ssize_t>buf.n < limit:
                c = iter_next(&self.a, &it)
                if c == 0:
                    if self.a.err:
                        self._fail(slen)
                    break
                if qart_push(&buf, c) < 0:
                    raise MemoryError("scan_from: out of memory")
            return self._build_items(&buf, 0)
        finally:
            qart_buf_free(&buf)

    # -- batch operations ----------------------------------------------------------------

    def insert_batch(self, const uint8_t[:, ::1] keys, const uint8_t[:, ::1] values):
        """Insert rows keys[i] -> values[i] in order; returns how many keys were new.

        Not atomic: rows before a failing row stay inserted (the error names the row).
        """
        cdef Py_ssize_t n = keys.shape[0], kl = keys.shape[1], i, g
        cdef uint32_t vs = self.a.value_size
        cdef uint64_t need
        cdef int r
        cdef Py_ssize_t new = 0
        self._check_key(kl, "key")
        if values.shape[0] != n or values.shape[1] != vs:
            raise ValueError(f"values must have shape ({n}, {vs}), got ({values.shape[0]}, {values.shape[1]})")
        if n == 0:
            return 0
        if self.a.gate:
            self._gate_slow()
        need = leaf_bytes(&self.a, <uint32_t>kl) + INSERT_SLACK_BYTES
        for g in range(0, n, WARM_GROUP):
            warm_paths(&self.a, &keys[g, 0], kl, <uint32_t>kl, min(WARM_GROUP, n - g), False)
            for i in range(g, min(g + WARM_GROUP, n)):
                if not self.writable or self.a.capacity - self.a.used < need:
                    self._reserve(need)  # may move the arena: warm_paths kept no pointers
                r = art_insert(&self.a, &keys[i, 0], <uint32_t>kl, (&values[i, 0]) if vs else NULL)
                if r < 0:
                    try:
                        self._fail(kl)
                    except ValueError as exc:
                        raise ValueError(f"row {i}: {exc}") from None
                new += r
        return new

    def get_batch(self, const uint8_t[:, ::1] keys):
        """(found bool[n], values uint8[n, value_size]); rows of missing keys are zero."""
        cdef Py_ssize_t n = keys.shape[0], kl = keys.shape[1], i, g
        cdef uint32_t vs = self.a.value_size
        cdef uint64_t leaf
        self._check_key(kl, "key")
        found = np.zeros(n, dtype=np.bool_)
        values = np.zeros((n, vs), dtype=np.uint8)
        if n == 0:
            return found, values
        if self.a.gate:
            self._gate_slow()
        cdef uint8_t[::1] f = found.view(np.uint8)
        cdef uint8_t[:, ::1] v = values
        for g in range(0, n, WARM_GROUP):
            warm_paths(&self.a, &keys[g, 0], kl, <uint32_t>kl, min(WARM_GROUP, n - g), False)
            for i in range(g, min(g + WARM_GROUP, n)):
                leaf = art_lookup(&self.a, &keys[i, 0], <uint32_t>kl)
                if leaf:
                    f[i] = 1
                    if vs:
                        memcpy(&v[i, 0], self.a.base + (leaf ^ 1) + 1 + kl, vs)
                elif self.a.err:
                    self._fail(kl)
        return found, values

    def scan_prefix_batch(self, const uint8_t[:, ::1] prefixes, Py_ssize_t key_len=-1):
        """CSR scan: matches of prefixes[i] are rows offsets[i]:offsets[i+1] of keys/values.

        All matched keys must have one length (``key_len``, or the first match's length).
        """
        cdef Py_ssize_t n = prefixes.shape[0], plen = prefixes.shape[1], i, g
        cdef int64_t width = key_len
        cdef uint32_t vs = self.a.value_size
        cdef qart_offbuf buf
        cdef qart_rows kr, vr
        cdef size_t j
        cdef uint8_t* lf
        cdef int64_t k
        cdef const uint8_t* p
        if plen > 255:
            raise ValueError(f"prefix length must be in 0..255 bytes, got {plen}")
        if key_len > 255:
            raise ValueError(f"key_len must be in 1..255, got {key_len}")
        if self.a.gate:
            self._gate_slow()
        offsets = np.zeros(n + 1, dtype=np.int64)
        cdef int64_t[::1] o = offsets
        qart_buf_init(&buf)
        qart_rows_init(&kr, width if width >= 0 else 0)
        qart_rows_init(&vr, vs)
        try:
            for g in range(0, n, WARM_GROUP):
                if plen:
                    warm_paths(&self.a, &prefixes[g, 0], plen, <uint32_t>plen, min(WARM_GROUP, n - g), True)
                for i in range(g, min(g + WARM_GROUP, n)):
                    p = &prefixes[i, 0] if plen else <const uint8_t*>b""
                    buf.n = 0
                    k = collect_prefix(&self.a, p, <uint32_t>plen, -1, &buf, False)
                    if k < 0:
                        self._fail(plen)
                    for j in range(buf.n):
                        lf = leaf_at(&self.a, buf.data[j])
                        if lf == NULL:
                            self._fail(plen)
                        if width < 0:
                            width = lf[0]
                            kr.width = <size_t>width
                        if lf[0] != width:
                            raise ValueError(
                                f"scan_prefix_batch needs matched keys of one length: found {lf[0]} and "
                                f"{width}; pass key_len or use scan_prefix")
                        if qart_rows_push(&kr, lf + 1) < 0 or qart_rows_push(&vr, lf + 1 + width) < 0:
                            raise MemoryError("scan_prefix_batch: out of memory")
                    o[i + 1] = <int64_t>kr.n
            if width < 0:
                width = plen
            return rows_to_array(&kr, width), rows_to_array(&vr, vs), offsets
        finally:
            qart_buf_free(&buf)
            qart_rows_free(&kr)
            qart_rows_free(&vr)

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
        cdef Py_ssize_t n = numbers.shape[0], i
        if not 9 <= key_len <= 255:
            raise ValueError(f"key_len must be in 9..255, got {key_len}")
        prefixes = np.empty((n, 9), dtype=np.uint8)
        cdef uint8_t[:, ::1] p = prefixes
        for i in range(n):
            block_prefix(&p[i, 0], head, numbers[i])
        return ArtCore.scan_prefix_batch(self, prefixes, key_len)

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
        """The small state that, with the arena bytes and root_offset, re-creates this tree."""
        cdef int c
        meta = {
            "format_version": FORMAT_VERSION,
            "value_size": self.a.value_size,
            "arena_used_bytes": self.a.used,
            "num_leaves": self.a.num_leaves,
            "num_node4": self.a.num_nodes[NODE4],
            "num_node16": self.a.num_nodes[NODE16],
            "num_node48": self.a.num_nodes[NODE48],
            "num_node256": self.a.num_nodes[NODE256],
            "free_list_bytes": self.a.free_bytes,
            "free_list_blocks": self.a.free_blocks,
        }
        for c in range(NUM_CLASSES):
            if self.a.free_heads[c]:
                meta[f"free_head_{c * 8}"] = self.a.free_heads[c]
        return meta

    def stats(self):
        return {
            "node4": self.a.num_nodes[NODE4],
            "node16": self.a.num_nodes[NODE16],
            "node48": self.a.num_nodes[NODE48],
            "node256": self.a.num_nodes[NODE256],
            "leaves": self.a.num_leaves,
            "arena_used_bytes": self.a.used,
            "arena_capacity_bytes": self.a.capacity,
            "free_list_bytes": self.a.free_bytes,
            "free_list_blocks": self.a.free_blocks,
            "chunks_total": self.a.num_chunks,
            "chunks_verified": self.a.chunks_verified,
        }

    def _attach(self, buffer, uint64_t root, dict meta, chunk_crcs=None, chunk_bytes=65536):
        """Replace this (fresh) tree's arena by ``buffer``; O(1) checks, no tree walk.

        With ``chunk_crcs`` (uint32, one CRC-32C per ``chunk_bytes`` chunk of the used bytes) the
        arena bytes are not read at all here: the header and the root are checked, and every
        chunk checksummed, when an operation first uses them.
        """
        cdef Py_buffer view
        cdef bint writable = True
        cdef bint lazy = chunk_crcs is not None
        cdef uint8_t* base
        cdef uint64_t used, size, head, c, nwords, nchunks = 0, r
        cdef uint32_t vs, shift = 0
        cdef const uint32_t[::1] crcs
        cdef uint64_t* bits = NULL
        cdef uint32_t* table = NULL
        cdef Arena probe
        if self.a.num_leaves or self.a.used != ARENA_HEADER_BYTES or self.exports:
            raise RuntimeError("_attach must be called on a fresh, empty ArtCore")
        if lazy:
            shift = _chunk_shift(chunk_bytes)
            crcs = chunk_crcs
        try:
            PyObject_GetBuffer(buffer, &view, PyBUF_WRITABLE)
        except (BufferError, TypeError):
            writable = False
            PyObject_GetBuffer(buffer, &view, PyBUF_SIMPLE)
        try:
            base = <uint8_t*>view.buf
            if not 0 <= meta["value_size"] <= 255:
                raise ValueError(f"meta value_size must be in 0..255, got {meta['value_size']}")
            vs = meta["value_size"]
            if view.len < ARENA_HEADER_BYTES:
                raise ValueError(f"buffer of {view.len} bytes is smaller than the {ARENA_HEADER_BYTES}-byte arena header")
            if not lazy:  # (lazily: before the first operation, once its chunk is verified)
                problem = _header_problem(base, <uint64_t>view.len, vs)
                if problem is not None:
                    raise ValueError(problem)
            used = meta["arena_used_bytes"]
            if used < ARENA_HEADER_BYTES or used % 8 or used > <uint64_t>view.len:
                raise ValueError(f"arena_used_bytes {used} must be a multiple of 8 in "
                                 f"{ARENA_HEADER_BYTES}..{view.len} (the buffer size)")
            if lazy:
                nchunks = (used + (<uint64_t>1 << shift) - 1) >> shift
                if <uint64_t>crcs.shape[0] != nchunks:
                    raise ValueError(f"chunk_crcs has {crcs.shape[0]} entries but arena_used_bytes {used} "
                                     f"in chunks of {1 << shift} bytes needs {nchunks}")
            memset(&probe, 0, sizeof(Arena))
            probe.base = base
            probe.used = used
            probe.capacity = used
            probe.value_size = vs
            probe.num_leaves = meta["num_leaves"]
            probe.num_nodes[NODE4] = meta["num_node4"]
            probe.num_nodes[NODE16] = meta["num_node16"]
            probe.num_nodes[NODE48] = meta["num_node48"]
            probe.num_nodes[NODE256] = meta["num_node256"]
            probe.free_bytes = meta["free_list_bytes"]
            probe.free_blocks = meta["free_list_blocks"]
            if (root == 0) != (probe.num_leaves == 0):
                raise ValueError(f"root_offset {root} is inconsistent with num_leaves {probe.num_leaves}")
            if root != 0:
                r = root & ~(<uint64_t>1)
                if lazy:  # offsets only: the root's bytes are checked when first used
                    bad_root = r % 8 or r < ARENA_HEADER_BYTES or r >= used
                else:
                    bad_root = ((root & 1 and leaf_at(&probe, root) == NULL)
                                or ((root & 1) == 0 and node_at(&probe, root) == NULL))
                if bad_root:
                    raise ValueError(f"root_offset {root} does not name a node or leaf inside the "
                                     f"{used} used arena bytes")
            min_bytes = (meta["num_leaves"] * 8 + meta["num_node4"] * 64 + meta["num_node16"] * 168
                         + meta["num_node48"] * 664 + meta["num_node256"] * 2072)  # Python ints
            if (min_bytes + ARENA_HEADER_BYTES + meta["free_list_bytes"] > used
                    or meta["free_list_blocks"] * 8 > meta["free_list_bytes"]):
                raise ValueError(f"meta counts (nodes, leaves, free_list_bytes {probe.free_bytes}, "
                                 f"free_list_blocks {probe.free_blocks}) cannot fit in {used} arena bytes")
            for name, value in meta.items():
                if not name.startswith("free_head_"):
                    continue
                size_class = int(name[len("free_head_"):])
                if size_class % 8 or size_class < 8 or size_class >= NUM_CLASSES * 8:
                    raise ValueError(f"meta {name}: size class {size_class} is not a multiple of 8 in "
                                     f"8..{NUM_CLASSES * 8 - 8}")
                size = size_class
                head = value
                if head % 8 or head < ARENA_HEADER_BYTES or head >= used or used - head < size:
                    raise ValueError(f"meta {name}: free-list head {head} lies outside the {used} used arena bytes")
                probe.free_heads[size >> 3] = head
            if lazy:
                # Bitmap with one spare word: bits num_chunks.. are set, so an object straddling
                # the end of the table (at most one chunk further) tests a valid, set bit.
                nwords = (nchunks >> 6) + 2
                bits = <uint64_t*>malloc(nwords * sizeof(uint64_t))
                table = <uint32_t*>malloc(nchunks * sizeof(uint32_t))
                if bits == NULL or table == NULL:
                    raise MemoryError(f"cannot allocate the table of {nchunks} chunk checksums")
                memset(bits, 0, nwords * sizeof(uint64_t))
                for c in range(nchunks, nwords * 64):
                    bits[c >> 6] |= <uint64_t>1 << (c & 63)
                for c in range(nchunks):
                    table[c] = crcs[c]
                probe.chunk_bits = bits
                probe.chunk_crc = table
                probe.num_chunks = nchunks
                probe.chunk_shift = shift
                probe.table_end = used
                probe.lazy_end = used
                probe.gate = GATE_HEADER
        except BaseException:
            free(bits)
            free(table)
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
        cdef Arena* a = &self.a
        cdef Hdr* h
        cdef Hdr* stack[MAX_DEPTH]
        cdef int pos[MAX_DEPTH]
        cdef uint32_t cdepth[MAX_DEPTH]
        cdef uint8_t path[256]
        cdef uint8_t prev[256]
        cdef int prev_len = -1, sp = 0, t, i, nc, cnt, r
        cdef uint64_t c, ml, budget = (a.used >> 3) + 1, live = 0, fb, fblocks, head
        cdef uint64_t counts[5]
        cdef uint64_t leaves = 0
        cdef uint32_t d, p, dl
        cdef uint8_t* lf
        cdef uint8_t seen[49]
        cdef Node48* n48
        cdef uint8_t* keys
        cdef uint64_t* children
        memset(counts, 0, sizeof(counts))
        a.err = E_OK
        if a.gate:
            self._gate_slow()

        def bad(msg):
            a.err = E_OK
            if a.gate & GATE_CORRUPT:  # a chunk failed its checksum on the way
                raise ValueError(self._checksum_msg())
            raise ValueError(f"ART invariant violated: {msg}")

        c = a.root
        d = 0
        while True:
            # visit c (tagged, at depth d), then fetch the next (c, d) from the stack
            if c != 0:
                if budget == 0:
                    bad("more objects reachable than fit in the arena (cycle or shared subtree)")
                budget -= 1
                if c & 1:
                    lf = leaf_at(a, c)
                    if lf == NULL:
                        bad(f"leaf offset {c ^ 1} out of range")
                    dl = d
                    if lf[0] < dl or memcmp(lf + 1, path, dl) != 0:
                        bad(f"leaf at {c ^ 1} does not match its path (depth {dl})")
                    if prev_len >= 0:
                        r = key_cmp(prev, prev_len, lf + 1, lf[0])
                        if r >= 0 or (prev_len < lf[0] and memcmp(prev, lf + 1, prev_len) == 0):
                            bad(f"leaves out of order or not prefix-free at {c ^ 1}")
                    prev_len = lf[0]
                    memcpy(prev, lf + 1, prev_len)
                    leaves += 1
                    live += leaf_bytes(a, lf[0])
                else:
                    h = node_at(a, c)
                    if h == NULL:
                        bad(f"node offset {c} out of range or malformed")
                    t = h.type
                    counts[t] += 1
                    live += QART_NODE_SIZE[t]
                    p = h.prefix_len
                    if d + p + 1 > 255:
                        bad(f"node at {c}: depth {d} + prefix {p} exceeds the key length limit")
                    ml = min_leaf(a, c)
                    lf = leaf_at(a, ml) if ml else NULL
                    if lf == NULL or lf[0] <= d + p:
                        bad(f"node at {c}: minimum leaf missing or too short")
                    memcpy(path + d, lf + 1 + d, p)
                    if memcmp(h.prefix, path + d, p if p < MAX_PREFIX else MAX_PREFIX) != 0:
                        bad(f"node at {c}: stored prefix differs from its keys")
                    nc = h.num_children
                    if nc < (2, 4, 13, 38)[t - 1]:
                        bad(f"node at {c} (type {t}) has only {nc} children")
                    if t == NODE4 or t == NODE16:
                        if t == NODE4:
                            keys = (<Node4*>h).keys
                            children = (<Node4*>h).children
                        else:
                            keys = (<Node16*>h).keys
                            children = (<Node16*>h).children
                        for i in range(<int>QART_NODE_CAP[t]):
                            if (i < nc) != (children[i] != 0) or (i > 0 and i < nc and keys[i - 1] >= keys[i]):
                                bad(f"node at {c}: keys unsorted or child slots inconsistent")
                    elif t == NODE48:
                        n48 = <Node48*>h
                        memset(seen, 0, sizeof(seen))
                        cnt = 0
                        for i in range(256):
                            if n48.index[i]:
                                if n48.index[i] > 48 or seen[n48.index[i]] or n48.children[n48.index[i] - 1] == 0:
                                    bad(f"node48 at {c}: bad index entry for byte {i}")
                                seen[n48.index[i]] = 1
                                cnt += 1
                        for i in range(48):
                            if (n48.children[i] != 0) != (seen[i + 1] != 0):
                                bad(f"node48 at {c}: orphan child slot {i}")
                        if cnt != nc:
                            bad(f"node48 at {c}: {cnt} indexed children but num_children {nc}")
                    else:
                        cnt = 0
                        for i in range(256):
                            cnt += (<Node256*>h).children[i] != 0
                        if cnt != nc:
                            bad(f"node256 at {c}: {cnt} children but num_children {nc}")
                    if sp >= MAX_DEPTH:
                        bad("tree deeper than any key allows")
                    stack[sp] = h
                    pos[sp] = 0
                    cdepth[sp] = d + p
                    sp += 1
            if sp == 0:
                break
            h = stack[sp - 1]
            c = next_child(a, h, h.type, &pos[sp - 1])
            if a.err:
                bad("malformed child slot")
            if c == 0:
                sp -= 1
                continue
            if h.type == NODE4:
                path[cdepth[sp - 1]] = (<Node4*>h).keys[pos[sp - 1] - 1]
            elif h.type == NODE16:
                path[cdepth[sp - 1]] = (<Node16*>h).keys[pos[sp - 1] - 1]
            else:
                path[cdepth[sp - 1]] = <uint8_t>(pos[sp - 1] - 1)
            d = cdepth[sp - 1] + 1
        for t in range(1, 5):
            if counts[t] != a.num_nodes[t]:
                bad(f"{counts[t]} reachable nodes of type {t} but the counter says {a.num_nodes[t]}")
        if leaves != a.num_leaves:
            bad(f"{leaves} reachable leaves but the counter says {a.num_leaves}")
        fb = 0
        fblocks = 0
        for i in range(1, NUM_CLASSES):
            head = a.free_heads[i]
            while head:
                if budget == 0 or head % 8 or head < ARENA_HEADER_BYTES or head >= a.used or a.used - head < <uint64_t>i * 8:
                    bad(f"free list of {i * 8}-byte blocks is malformed at {head}")
                if need_chunks(a, head, head + <uint64_t>i * 8, False) < 0:
                    bad(f"free block at {head}")
                budget -= 1
                fb += <uint64_t>i * 8
                fblocks += 1
                head = (<uint64_t*>(a.base + head))[0]
        if fb != a.free_bytes or fblocks != a.free_blocks:
            bad(f"free lists hold {fb} bytes in {fblocks} blocks, counters say {a.free_bytes} / {a.free_blocks}")
        if ARENA_HEADER_BYTES + live + fb != a.used:
            bad(f"header + live {live} + free {fb} bytes != used {a.used}")
        return self.stats()

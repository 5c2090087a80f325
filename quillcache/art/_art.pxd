# Node layer of the arena-resident adaptive radix tree (see _art.pyx for the invariants).
#
# Everything here works on an ``Arena``: one contiguous byte region whose nodes and leaves refer to
# each other by 64-bit byte OFFSETS from the arena base (never raw pointers), so the bytes can be
# written out and re-attached as they are.  Offsets are 8-byte aligned; a child offset with bit 0
# set names a LEAF (tag), 0 is null.  Every dereference goes through ``node_at``/``leaf_at``, which
# bounds-check the offset against ``used`` and the node's type and child count, and set
# ``Arena.err = E_CORRUPT`` (returning NULL) instead of touching memory outside the arena.
#
# Layouts (little-endian, natural alignment, sizes in bytes):
#   header   24: u8 type | u8 prefix_len | u16 num_children | u32 reserved | u8 prefix[16]
#   Node4    64: header | u8 keys[4]  | pad[4] | u64 children[4]      (keys sorted)
#   Node16  168: header | u8 keys[16] | u64 children[16]              (keys sorted)
#   Node48  664: header | u8 index[256] (slot+1, 0 = none) | u64 children[48]
#   Node256 2072: header | u64 children[256]
#   leaf    1 + key_len + value_size rounded up to 8: u8 key_len | key | value
#   free block: u64 next free offset of the same size class (0 ends the list)
#
# Lazy chunk verification (``ArtTree.attach(..., chunk_crcs=...)``): the attached used bytes
# [0, table_end) are cut into chunks of 2**chunk_shift bytes (>= 4096, so an object, at most 2080
# bytes, overlaps at most two chunks), each with an expected CRC-32C.  Before ANY byte of an object
# starting below ``lazy_end`` is read or written (node header and body, leaf, free block popped by
# the allocator), ``need_chunks`` checks the chunks it overlaps in the ``chunk_bits`` bitmap; a
# clear bit sends it to ``verify_chunks`` (in _art.pyx), which checksums the chunk and sets the bit,
# or marks the arena corrupt for good (GATE_CORRUPT, err = E_CHECKSUM).  ``lazy_end`` is 0 when
# there is no table or every chunk is verified, so the check is then one compare.  Hints
# (prefetching) never verify: they stop at an unverified chunk (``node_peek``).

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int64_t
from libc.string cimport memcpy, memmove, memset, memcmp

cdef extern from *:
    """
    #include <stdint.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    #endif
    #if defined(__GNUC__) || defined(__clang__)
    #define qart_prefetch(p) __builtin_prefetch((const void *)(p))
    #else
    #define qart_prefetch(p) ((void)0)
    #endif
    static const uint32_t QART_NODE_SIZE[5] = {0, 64, 168, 664, 2072};
    static const uint32_t QART_NODE_CAP[5] = {0, 4, 16, 48, 256};

    /* Index of byte b among the first n (<= 16) keys, or -1. */
    static inline int qart_find16(const uint8_t *keys, int n, uint8_t b) {
    #if defined(__SSE2__) && (defined(__GNUC__) || defined(__clang__)) && !defined(QART_SCALAR_FIND16)
        __m128i k = _mm_loadu_si128((const __m128i *)keys);
        __m128i c = _mm_cmpeq_epi8(k, _mm_set1_epi8((char)b));
        unsigned m = (unsigned)_mm_movemask_epi8(c) & ((1u << n) - 1u);
        return m ? __builtin_ctz(m) : -1;
    #else
        for (int i = 0; i < n; i++) if (keys[i] == b) return i;
        return -1;
    #endif
    }
    """
    const uint32_t QART_NODE_SIZE[5]
    const uint32_t QART_NODE_CAP[5]
    int qart_find16(const uint8_t *keys, int n, uint8_t b) noexcept nogil
    void qart_prefetch(const void* p) noexcept nogil

cdef enum:
    MAX_PREFIX = 16           # prefix bytes stored in a node; longer prefixes are optimistic
    ARENA_HEADER_BYTES = 64   # offset 0..63: magic + format header, so 0 can mean null
    NODE4 = 1
    NODE16 = 2
    NODE48 = 3
    NODE256 = 4
    NUM_CLASSES = 260         # free-list size classes, one per multiple of 8 up to 2072 bytes
    MAX_DEPTH = 260           # > longest possible root-to-leaf path (keys are <= 255 bytes)
    E_OK = 0
    E_CORRUPT = 1
    E_NOMEM = 2
    E_PREFIX = 3
    E_OOM = 4                 # malloc failed (E_NOMEM is the arena outrunning its reservation)
    E_CHECKSUM = 5            # a chunk failed its CRC-32C (Arena.bad_chunk); the arena is corrupt for good
    GATE_HEADER = 1           # Arena.gate: the header is still to be verified and checked
    GATE_CORRUPT = 2          # Arena.gate: a checksum (or the lazily checked header) failed
    MIN_CHUNK_SHIFT = 12      # chunk_bytes 4 KiB ..
    MAX_CHUNK_SHIFT = 24      # .. 16 MiB

ctypedef struct Hdr:
    uint8_t type
    uint8_t prefix_len
    uint16_t num_children
    uint32_t reserved
    uint8_t prefix[16]

ctypedef struct Node4:
    Hdr h
    uint8_t keys[4]
    uint8_t pad[4]
    uint64_t children[4]

ctypedef struct Node16:
    Hdr h
    uint8_t keys[16]
    uint64_t children[16]

ctypedef struct Node48:
    Hdr h
    uint8_t index[256]
    uint64_t children[48]

ctypedef struct Node256:
    Hdr h
    uint64_t children[256]

ctypedef struct Arena:
    uint8_t* base
    uint64_t used             # bump pointer: bytes [0, used) are header, live or free blocks
    uint64_t capacity         # bytes addressable at base (>= used)
    uint64_t root             # tagged offset of the root (0 = empty tree)
    uint64_t num_leaves
    uint64_t num_nodes[5]     # by node type (index 1..4)
    uint64_t free_heads[260]  # by size class (bytes >> 3)
    uint64_t free_bytes
    uint64_t free_blocks
    uint32_t value_size
    int err                   # E_* of the last failed operation
    uint32_t conflict_len     # for E_PREFIX: length of the existing, conflicting key
    # lazy chunk verification; all zero/NULL when the tree was not attached with a table
    uint64_t lazy_end         # objects starting below this offset need verified chunks (0: none do)
    uint64_t table_end        # the attached used size: chunks tile [0, table_end)
    uint64_t* chunk_bits      # verified bitmap; the padding bits from num_chunks on are set
    uint32_t* chunk_crc       # expected CRC-32C per chunk
    uint64_t num_chunks
    uint64_t chunks_verified
    uint64_t bad_chunk        # the chunk that failed (when gate & GATE_CORRUPT and err was E_CHECKSUM)
    uint32_t chunk_shift
    int gate                  # GATE_* bits; every Python-facing operation checks it first


cdef int verify_chunks(Arena* a, uint64_t off, uint64_t end) noexcept nogil  # slow path, _art.pyx


cdef inline bint chunk_bit(const Arena* a, uint64_t c) noexcept nogil:
    return (a.chunk_bits[c >> 6] >> (c & 63)) & 1


cdef inline int need_chunks(Arena* a, uint64_t off, uint64_t end, bint hint) noexcept nogil:
    """0 if bytes [off, end) (0 < end - off <= 2080, end <= used) may be used now; else checksum
    their unverified chunks (-1 and err = E_CHECKSUM on a mismatch), or, for a ``hint``, -1 at once.
    """
    cdef uint64_t c0, c1
    if off >= a.lazy_end:      # no table, all verified, or allocated after attach
        return 0
    c0 = off >> a.chunk_shift
    c1 = (end - 1) >> a.chunk_shift  # <= c0 + 1 <= num_chunks: a padding bit at worst
    if chunk_bit(a, c0) and (c1 == c0 or chunk_bit(a, c1)):
        return 0
    if hint:
        return -1
    return verify_chunks(a, off, end)


cdef inline uint32_t leaf_bytes(const Arena* a, uint32_t key_len) noexcept nogil:
    return (1 + key_len + a.value_size + 7) & ~(<uint32_t>7)


cdef inline Hdr* node_check(Arena* a, uint64_t off, bint hint) noexcept nogil:
    """The inner node at untagged offset ``off``, or NULL (err set) if it is not one or (lazy
    verification) its chunks fail their checksum -- or, for a ``hint``, are not verified yet."""
    cdef Hdr* h
    cdef uint8_t t
    if (off & 7) != 0 or off < ARENA_HEADER_BYTES or off >= a.used or a.used - off < sizeof(Hdr):
        a.err = E_CORRUPT
        return NULL
    if need_chunks(a, off, off + sizeof(Hdr), hint) < 0:
        if hint:
            a.err = E_CORRUPT
        return NULL
    h = <Hdr*>(a.base + off)
    t = h.type
    if t < NODE4 or t > NODE256 or a.used - off < QART_NODE_SIZE[t] or h.num_children > QART_NODE_CAP[t]:
        a.err = E_CORRUPT
        return NULL
    if need_chunks(a, off, off + QART_NODE_SIZE[t], hint) < 0:
        if hint:
            a.err = E_CORRUPT
        return NULL
    return h


cdef inline Hdr* node_at(Arena* a, uint64_t off) noexcept nogil:
    """The inner node at untagged offset ``off``, or NULL (err = E_CORRUPT / E_CHECKSUM)."""
    return node_check(a, off, False)


cdef inline Hdr* node_peek(Arena* a, uint64_t off) noexcept nogil:
    """``node_at`` for cache-warming hints: NULL (never a checksum) at an unverified chunk."""
    return node_check(a, off, True)


cdef inline uint8_t* leaf_at(Arena* a, uint64_t tagged) noexcept nogil:
    """The leaf named by tagged offset ``tagged`` (bit 0 set), or NULL (err = E_CORRUPT /
    E_CHECKSUM); its key and value bytes [off, off + 1 + key_len + value_size) are verified."""
    cdef uint64_t off = tagged ^ 1
    cdef uint8_t* p
    if (off & 7) != 0 or off < ARENA_HEADER_BYTES or off >= a.used:
        a.err = E_CORRUPT
        return NULL
    if need_chunks(a, off, off + 1, False) < 0:
        return NULL
    p = a.base + off
    if p[0] == 0 or a.used - off < <uint64_t>(1 + p[0] + a.value_size):
        a.err = E_CORRUPT
        return NULL
    if need_chunks(a, off, off + 1 + p[0] + a.value_size, False) < 0:
        return NULL
    return p


cdef inline uint64_t arena_alloc(Arena* a, uint32_t size) noexcept nogil:
    """Offset of a block of ``size`` bytes (multiple of 8): a free-list block, else bump.

    The caller reserved capacity for the bump case beforehand, so the base never moves here.
    """
    cdef uint64_t head = a.free_heads[size >> 3]
    cdef uint64_t off
    if head:
        if (head & 7) != 0 or head < ARENA_HEADER_BYTES or head >= a.used or a.used - head < size:
            a.err = E_CORRUPT
            return 0
        if need_chunks(a, head, head + size, False) < 0:  # the whole block is about to be written
            return 0
        a.free_heads[size >> 3] = (<uint64_t*>(a.base + head))[0]
        a.free_bytes -= size
        a.free_blocks -= 1
        return head
    if a.capacity - a.used < size:
        a.err = E_NOMEM
        return 0
    off = a.used
    a.used += size
    return off


cdef inline int verify_free_block(Arena* a, uint64_t head, uint32_t size) noexcept nogil:
    """Verify the chunks of free block ``head`` (if it is in range; a bad one fails later)."""
    if head == 0 or (head & 7) != 0 or head < ARENA_HEADER_BYTES or head >= a.used or a.used - head < size:
        return 0
    return need_chunks(a, head, head + size, False)


cdef inline int prepare_pops(Arena* a, uint32_t size1, uint32_t size2) noexcept nogil:
    """Before a mutation writes anything: verify the free blocks its allocations of ``size1`` and
    then ``size2`` bytes (0 = none) will pop, so a checksum failure cannot strike half-way."""
    cdef uint64_t head
    if a.lazy_end == 0:
        return 0
    head = a.free_heads[size1 >> 3] if size1 else 0
    if verify_free_block(a, head, size1) < 0:
        return -1
    if size2 == 0:
        return 0
    if size2 == size1:  # the second pop takes the next block of the same list
        if head == 0 or (head & 7) != 0 or head < ARENA_HEADER_BYTES or head >= a.used or a.used - head < size1:
            return 0
        head = (<uint64_t*>(a.base + head))[0]
    else:
        head = a.free_heads[size2 >> 3]
    return verify_free_block(a, head, size2)


cdef inline void arena_free(Arena* a, uint64_t off, uint32_t size) noexcept nogil:
    (<uint64_t*>(a.base + off))[0] = a.free_heads[size >> 3]
    a.free_heads[size >> 3] = off
    a.free_bytes += size
    a.free_blocks += 1


cdef inline uint64_t new_node(Arena* a, uint8_t t) noexcept nogil:
    cdef uint64_t off = arena_alloc(a, QART_NODE_SIZE[t])
    if off == 0:
        return 0
    memset(a.base + off, 0, QART_NODE_SIZE[t])
    (<Hdr*>(a.base + off)).type = t
    a.num_nodes[t] += 1
    return off


cdef inline void free_node(Arena* a, uint64_t off, uint8_t t) noexcept nogil:
    if t < NODE4 or t > NODE256:
        a.err = E_CORRUPT
        return
    if a.num_nodes[t]:
        a.num_nodes[t] -= 1
    arena_free(a, off, QART_NODE_SIZE[t])


cdef inline uint64_t new_leaf(Arena* a, const uint8_t* key, uint32_t kl, const uint8_t* val) noexcept nogil:
    """Tagged offset of a fresh leaf holding key/value, or 0 on failure."""
    cdef uint32_t size = leaf_bytes(a, kl)
    cdef uint64_t off = arena_alloc(a, size)
    cdef uint8_t* p
    if off == 0:
        return 0
    p = a.base + off
    memset(p, 0, size)
    p[0] = <uint8_t>kl
    memmove(p + 1, key, kl)  # memmove: batch keys may be a view of this very arena
    if a.value_size:
        memmove(p + 1 + kl, val, a.value_size)
    a.num_leaves += 1
    return off | 1


cdef inline void free_leaf(Arena* a, uint64_t tagged, uint8_t key_len) noexcept nogil:
    if a.num_leaves:
        a.num_leaves -= 1
    arena_free(a, tagged ^ 1, leaf_bytes(a, key_len))


cdef inline uint64_t* find_child(Arena* a, Hdr* h, uint8_t b) noexcept nogil:
    """Address of the child slot for byte ``b`` in a validated node, or NULL if absent."""
    cdef int i, n = h.num_children
    cdef uint8_t idx
    cdef Node4* n4
    cdef Node256* n256
    if h.type == NODE4:
        n4 = <Node4*>h
        for i in range(n):
            if n4.keys[i] == b:
                return &n4.children[i]
        return NULL
    if h.type == NODE16:
        i = qart_find16((<Node16*>h).keys, n, b)
        return &(<Node16*>h).children[i] if i >= 0 else NULL
    if h.type == NODE48:
        idx = (<Node48*>h).index[b]
        if idx == 0:
            return NULL
        if idx > 48:
            a.err = E_CORRUPT
            return NULL
        return &(<Node48*>h).children[idx - 1]
    n256 = <Node256*>h
    return &n256.children[b] if n256.children[b] else NULL


# Node-to-node copies use memmove: in a damaged arena a freshly allocated node may overlap the
# node it is copied from (a corrupt free list), and overlapping memcpy is undefined behaviour.
cdef inline void copy_header(Hdr* dst, const Hdr* src) noexcept nogil:
    cdef uint8_t prefix_len = src.prefix_len
    cdef uint16_t num_children = src.num_children
    memmove(dst.prefix, src.prefix, MAX_PREFIX)
    dst.prefix_len = prefix_len
    dst.num_children = num_children


cdef inline int sorted_insert(uint8_t* keys, uint64_t* children, int n, uint8_t b, uint64_t child) noexcept nogil:
    cdef int i = 0
    while i < n and keys[i] < b:
        i += 1
    memmove(keys + i + 1, keys + i, n - i)
    memmove(children + i + 1, children + i, (n - i) * sizeof(uint64_t))
    keys[i] = b
    children[i] = child
    return n + 1


cdef inline int add_child(Arena* a, uint64_t* ref, uint8_t b, uint64_t child) noexcept nogil:
    """Add ``child`` under byte ``b`` (absent) to the node stored in ``*ref``; grows the node.

    Returns 0, or -1 with ``a.err`` set.  Growth replaces ``*ref`` and frees the old node.  The
    node is (re)validated here and its type and child count are read once: in a damaged arena an
    allocation may alias it, so nothing validated earlier is trusted for bounds.
    """
    cdef uint64_t old = ref[0], nn
    cdef Hdr* h = node_at(a, old) if (old & 1) == 0 else NULL
    cdef int i, n
    cdef uint8_t t
    cdef Hdr* g
    if h == NULL:
        if a.err == E_OK:
            a.err = E_CORRUPT
        return -1
    n = h.num_children
    t = h.type
    cdef Node48* n48
    cdef Node256* n256
    if t == NODE4 or t == NODE16:
        if n < <int>QART_NODE_CAP[t]:
            if t == NODE4:
                h.num_children = sorted_insert((<Node4*>h).keys, (<Node4*>h).children, n, b, child)
            else:
                h.num_children = sorted_insert((<Node16*>h).keys, (<Node16*>h).children, n, b, child)
            return 0
        nn = new_node(a, t + 1)
        if nn == 0:
            return -1
        g = <Hdr*>(a.base + nn)
        copy_header(g, h)
        if t == NODE4:
            memmove((<Node16*>g).keys, (<Node4*>h).keys, 4)
            memmove((<Node16*>g).children, (<Node4*>h).children, 4 * sizeof(uint64_t))
        else:
            n48 = <Node48*>g
            for i in range(16):
                n48.index[(<Node16*>h).keys[i]] = <uint8_t>(i + 1)
                n48.children[i] = (<Node16*>h).children[i]
        free_node(a, old, t)
        ref[0] = nn
        return add_child(a, ref, b, child)
    if t == NODE48:
        n48 = <Node48*>h
        if n < 48:
            i = 0
            while i < 48 and n48.children[i] != 0:
                i += 1
            if i == 48 or n48.index[b] != 0:
                a.err = E_CORRUPT
                return -1
            n48.index[b] = <uint8_t>(i + 1)
            n48.children[i] = child
            h.num_children = n + 1
            return 0
        nn = new_node(a, NODE256)
        if nn == 0:
            return -1
        g = <Hdr*>(a.base + nn)
        copy_header(g, h)
        n256 = <Node256*>g
        for i in range(256):
            if n48.index[i]:
                if n48.index[i] > 48:
                    a.err = E_CORRUPT
                    return -1
                n256.children[i] = n48.children[n48.index[i] - 1]
        free_node(a, old, NODE48)
        ref[0] = nn
        return add_child(a, ref, b, child)
    n256 = <Node256*>h
    if n256.children[b] != 0 or n >= 256:
        a.err = E_CORRUPT
        return -1
    n256.children[b] = child
    h.num_children = n + 1
    return 0


cdef inline int merge_into_child(Arena* a, Hdr* h, uint8_t b, Hdr* c) noexcept nogil:
    """Prefix of ``c`` becomes h.prefix + b + c.prefix (only the first MAX_PREFIX bytes stored)."""
    cdef uint8_t buf[MAX_PREFIX]
    cdef uint32_t k, total = <uint32_t>h.prefix_len + 1 + c.prefix_len
    cdef uint32_t take
    if total > 254:
        a.err = E_CORRUPT
        return -1
    k = h.prefix_len if h.prefix_len < MAX_PREFIX else MAX_PREFIX
    memcpy(buf, h.prefix, k)
    if k < MAX_PREFIX:
        buf[k] = b
        k += 1
    if k < MAX_PREFIX:
        take = MAX_PREFIX - k
        if take > c.prefix_len:
            take = c.prefix_len
        memcpy(buf + k, c.prefix, take)
    memcpy(c.prefix, buf, MAX_PREFIX)
    c.prefix_len = <uint8_t>total
    return 0


cdef inline int shrink_node(Arena* a, uint64_t* ref, Hdr* h, uint8_t t, int n) noexcept nogil:
    """Replace node ``h`` (type t, n children, in ``*ref``) by the next smaller type."""
    cdef uint64_t old = ref[0]
    cdef uint64_t nn = new_node(a, t - 1)
    cdef Hdr* g
    cdef int i, j = 0
    cdef Node48* n48
    cdef Node16* n16
    if nn == 0:
        return -1
    g = <Hdr*>(a.base + nn)
    copy_header(g, h)
    g.num_children = <uint16_t>n
    if t == NODE16:
        if n > 4:
            a.err = E_CORRUPT
            return -1
        memmove((<Node4*>g).keys, (<Node16*>h).keys, n)
        memmove((<Node4*>g).children, (<Node16*>h).children, n * sizeof(uint64_t))
    elif t == NODE48:
        n48 = <Node48*>h
        n16 = <Node16*>g
        for i in range(256):
            if n48.index[i]:
                if j == 16 or n48.index[i] > 48:
                    a.err = E_CORRUPT
                    return -1
                n16.keys[j] = <uint8_t>i
                n16.children[j] = n48.children[n48.index[i] - 1]
                j += 1
        g.num_children = <uint16_t>j
    else:
        n48 = <Node48*>g
        for i in range(256):
            if (<Node256*>h).children[i]:
                if j == 48:
                    a.err = E_CORRUPT
                    return -1
                n48.index[i] = <uint8_t>(j + 1)
                n48.children[j] = (<Node256*>h).children[i]
                j += 1
        g.num_children = <uint16_t>j
    free_node(a, old, t)
    ref[0] = nn
    return 0


cdef inline int remove_child(Arena* a, uint64_t* ref, uint8_t b, uint64_t* slot) noexcept nogil:
    """Drop the child in ``slot`` (byte ``b``) from the node stored in ``*ref``; shrink/merge.

    Shrink points (hysteresis): Node256 -> 48 at 37 children, 48 -> 16 at 12, 16 -> 4 at 3; a Node4
    left with one child is replaced by that child (an inner child takes the concatenated prefix).
    The node is (re)validated here, as in ``add_child``.
    """
    cdef uint64_t child, old = ref[0]
    cdef Hdr* h = node_at(a, old) if (old & 1) == 0 else NULL
    cdef uint8_t t
    cdef int i, n
    cdef uint8_t* keys
    cdef uint64_t* children
    cdef Hdr* c
    cdef Node48* n48
    if h == NULL:
        if a.err == E_OK:
            a.err = E_CORRUPT
        return -1
    t = h.type
    n = h.num_children
    if t == NODE4 or t == NODE16:
        if t == NODE4:
            keys = (<Node4*>h).keys
            children = (<Node4*>h).children
        else:
            keys = (<Node16*>h).keys
            children = (<Node16*>h).children
        i = <int>(slot - children)
        if i < 0 or i >= n:
            a.err = E_CORRUPT
            return -1
        # Everything read after the first write is verified first (lazy checksums): the block a
        # shrink pops, or the inner child a Node4 left with one child merges into.
        if t == NODE16 and n - 1 == 3 and prepare_pops(a, QART_NODE_SIZE[NODE4], 0) < 0:
            return -1
        if t == NODE4 and n == 2:
            child = children[1 - i]
            if child != 0 and (child & 1) == 0 and node_at(a, child) == NULL:
                return -1
        memmove(keys + i, keys + i + 1, n - 1 - i)
        memmove(children + i, children + i + 1, (n - 1 - i) * sizeof(uint64_t))
        n -= 1
        keys[n] = 0
        children[n] = 0
        h.num_children = <uint16_t>n
        if t == NODE16:
            return shrink_node(a, ref, h, t, n) if n == 3 else 0
        if n > 1:
            return 0
        child = children[0] if n == 1 else 0
        if child != 0 and (child & 1) == 0:
            c = node_at(a, child)
            if c == NULL or merge_into_child(a, h, keys[0], c) < 0:
                return -1
        ref[0] = child
        free_node(a, old, NODE4)
        return 0
    if t == NODE48:
        n48 = <Node48*>h
        if n48.index[b] == 0 or n48.index[b] > 48 or n == 0:
            a.err = E_CORRUPT
            return -1
        if n - 1 == 12 and prepare_pops(a, QART_NODE_SIZE[NODE16], 0) < 0:
            return -1
        n48.children[n48.index[b] - 1] = 0
        n48.index[b] = 0
        h.num_children = <uint16_t>(n - 1)
        return shrink_node(a, ref, h, t, n - 1) if n - 1 == 12 else 0
    if (<Node256*>h).children[b] == 0 or n == 0:
        a.err = E_CORRUPT
        return -1
    if n - 1 == 37 and prepare_pops(a, QART_NODE_SIZE[NODE48], 0) < 0:
        return -1
    (<Node256*>h).children[b] = 0
    h.num_children = <uint16_t>(n - 1)
    return shrink_node(a, ref, h, t, n - 1) if n - 1 == 37 else 0


cdef inline uint64_t next_child(Arena* a, Hdr* h, uint8_t t, int* pos) noexcept nogil:
    """Next child (tagged offset) of ``h`` (validated as type ``t``) in byte order from position
    ``*pos``; 0 when done.  Positions are key indexes for Node4/16 and byte values for Node48/256.
    """
    cdef int p = pos[0]
    cdef uint64_t c = 0
    cdef uint8_t idx
    cdef int n = h.num_children
    if t == NODE4 or t == NODE16:
        if n > <int>QART_NODE_CAP[t]:
            a.err = E_CORRUPT
            return 0
        if p < n:
            c = (<Node4*>h).children[p] if t == NODE4 else (<Node16*>h).children[p]
            pos[0] = p + 1
            if c == 0:
                a.err = E_CORRUPT
        return c
    if t == NODE48:
        while p < 256:
            idx = (<Node48*>h).index[p]
            p += 1
            if idx:
                pos[0] = p
                if idx > 48 or (<Node48*>h).children[idx - 1] == 0:
                    a.err = E_CORRUPT
                    return 0
                return (<Node48*>h).children[idx - 1]
        pos[0] = p
        return 0
    while p < 256:
        c = (<Node256*>h).children[p]
        p += 1
        if c:
            pos[0] = p
            return c
    pos[0] = p
    return 0


cdef inline int pos_after(Hdr* h, uint8_t t, uint8_t b) noexcept nogil:
    """Iteration position of the first child whose byte is greater than ``b``."""
    cdef int i = 0, n = h.num_children
    cdef uint8_t* keys
    if t == NODE4 or t == NODE16:
        if n > <int>QART_NODE_CAP[t]:
            n = QART_NODE_CAP[t]
        if t == NODE4:
            keys = (<Node4*>h).keys
        else:
            keys = (<Node16*>h).keys
        while i < n and keys[i] <= b:
            i += 1
        return i
    return <int>b + 1


cdef inline uint64_t min_leaf(Arena* a, uint64_t n) noexcept nogil:
    """Tagged offset of the smallest leaf under ``n`` (tagged), or 0 (err set) if malformed."""
    cdef int depth = 0, pos
    cdef Hdr* h
    while n != 0 and (n & 1) == 0:
        depth += 1
        h = node_at(a, n) if depth < MAX_DEPTH else NULL
        if h == NULL:
            a.err = E_CORRUPT
            return 0
        pos = 0
        n = next_child(a, h, h.type, &pos)
    if n == 0:
        a.err = E_CORRUPT
    return n


cdef inline void prefetch_children(Arena* a, Hdr* h) noexcept nogil:
    """Start loading every child of a Node4/16 (scans visit them all; overlaps the misses)."""
    cdef int i, n = h.num_children
    cdef uint64_t* children
    if h.type == NODE4 and n <= 4:
        children = (<Node4*>h).children
    elif h.type == NODE16 and n <= 16:
        children = (<Node16*>h).children
    else:
        return
    for i in range(n):
        if children[i] < a.used:
            qart_prefetch(a.base + (children[i] & ~(<uint64_t>7)))

# Arena layer (included by _art.pyx): checked dereference, lazy chunk verification, allocator.
#
# Contracts
# - Every dereference goes through ``node_at``/``leaf_at``, which bounds-check the offset against
#   ``used`` and the node's type and child count, and set ``Arena.err = E_CORRUPT`` (returning NULL)
#   instead of touching memory outside the arena.  Offsets are 8-byte aligned; bit 0 tags a leaf.
# - Lazy chunk verification (``ArtTree.attach(..., chunk_crcs=...)``): the attached used bytes
#   [0, table_end) are cut into chunks of 2**chunk_shift bytes (>= 4096 >= MAX_OBJECT_BYTES, so an
#   object overlaps at most two chunks), each with an expected CRC-32C.  Before ANY byte of an
#   object starting below ``lazy_end`` is read or written (node header and body, leaf, free block
#   popped by the allocator), ``need_chunks`` checks the chunks it overlaps in the ``chunk_bits``
#   bitmap; a clear bit sends it to ``verify_chunks``, which checksums the chunk and sets the bit,
#   or marks the arena corrupt for good (GATE_CORRUPT, err = E_CHECKSUM).  ``lazy_end`` is 0 when
#   there is no table or every chunk is verified, so the check is then one compare.  Hints
#   (prefetching) never verify: they stop at an unverified chunk (``node_peek``).
# - Allocation: bump pointer plus one LIFO free list per 8-byte size class; the caller reserved
#   capacity for the bump case beforehand, so the base never moves inside an operation.


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


cdef inline bint chunk_bit(const Arena* a, uint64_t c) noexcept nogil:
    return (a.chunk_bits[c >> 6] >> (c & 63)) & 1


cdef inline int need_chunks(Arena* a, uint64_t off, uint64_t end, bint hint) noexcept nogil:
    """0 if bytes [off, end) (0 < end - off <= MAX_OBJECT_BYTES, end <= used) may be used now;
    else checksum their unverified chunks (-1 and err = E_CHECKSUM on a mismatch), or, for a
    ``hint``, -1 at once.
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

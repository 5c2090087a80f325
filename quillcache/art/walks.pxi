# Subtree walks (included by _art.pyx): cache-warming hints, prefix collection, subtree free.
#
# Contracts: hints (``warm_paths``, ``prefetch_subtree``) change nothing, clear any error they
# meet and stop at a chunk not yet verified.  ``touch_subtree`` verifies a subtree's chunks
# without changing it, so a mutation can fail before its first write.


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

# Tree algorithms (included by _art.pyx): lookup, insert, remove, prefix find, iteration/seek.
#
# Contracts: no Python objects; failures are reported through ``a.err`` (E_CORRUPT, E_CHECKSUM,
# E_PREFIX with ``a.conflict_len``, E_NOMEM).  Prefixes longer than MAX_PREFIX are optimistic:
# lookups verify the whole key at the leaf; inserts and seeks read the missing bytes from the
# subtree's minimum leaf.  Every walk is bounded by depth (< MAX_DEPTH) and, for iteration, by a
# visit budget of ``used / 8`` objects, so a damaged arena cannot loop.


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

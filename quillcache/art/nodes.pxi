# Node layer (included by _art.pyx): per-node child operations on validated nodes.
#
# Contracts
# - Child counts per type: Node4 2..4, Node16 4..16, Node48 13..48, Node256 38..256 (grow when
#   full; shrink 256->48 at 37, 48->16 at 12, 16->4 at 3; a Node4 with one child merges into it).
# - Mutating helpers re-validate a node right before changing it and read its type/count once (in
#   a damaged arena an allocation from a corrupt free list may overlap it); failures set a.err.


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

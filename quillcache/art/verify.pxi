# Verification (included by _art.pyx): the O(n) walk behind ``ArtCore.verify()``.
#
# Contracts: it checks every invariant the fast paths rely on -- key order and prefix-freedom,
# stored prefixes against the keys below, child counts per node type (QART_NODE_MIN..CAP), slot
# consistency, node and leaf counters, free lists and their byte totals, and that header + live +
# free bytes == used -- bounded by depth and by a visit budget of ``used / 8`` objects (a cycle or
# shared subtree is reported, never looped on).  It changes nothing.


cdef object verify_walk(Arena* a):
    """Walk the whole tree and free lists from ``a.root``, checking every invariant; O(n).

    Returns None, or the first violated invariant as a message (``a.err`` may be set: a chunk
    that failed its checksum on the way marks the arena corrupt, and the caller reports that).
    """
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
    c = a.root
    d = 0
    while True:
        # visit c (tagged, at depth d), then fetch the next (c, d) from the stack
        if c != 0:
            if budget == 0:
                return "more objects reachable than fit in the arena (cycle or shared subtree)"
            budget -= 1
            if c & 1:
                lf = leaf_at(a, c)
                if lf == NULL:
                    return f"leaf offset {c ^ 1} out of range"
                dl = d
                if lf[0] < dl or memcmp(lf + 1, path, dl) != 0:
                    return f"leaf at {c ^ 1} does not match its path (depth {dl})"
                if prev_len >= 0:
                    r = key_cmp(prev, prev_len, lf + 1, lf[0])
                    if r >= 0 or (prev_len < lf[0] and memcmp(prev, lf + 1, prev_len) == 0):
                        return f"leaves out of order or not prefix-free at {c ^ 1}"
                prev_len = lf[0]
                memcpy(prev, lf + 1, prev_len)
                leaves += 1
                live += leaf_bytes(a, lf[0])
            else:
                h = node_at(a, c)
                if h == NULL:
                    return f"node offset {c} out of range or malformed"
                t = h.type
                counts[t] += 1
                live += QART_NODE_SIZE[t]
                p = h.prefix_len
                if d + p + 1 > 255:
                    return f"node at {c}: depth {d} + prefix {p} exceeds the key length limit"
                ml = min_leaf(a, c)
                lf = leaf_at(a, ml) if ml else NULL
                if lf == NULL or lf[0] <= d + p:
                    return f"node at {c}: minimum leaf missing or too short"
                memcpy(path + d, lf + 1 + d, p)
                if memcmp(h.prefix, path + d, p if p < MAX_PREFIX else MAX_PREFIX) != 0:
                    return f"node at {c}: stored prefix differs from its keys"
                nc = h.num_children
                if <uint32_t>nc < QART_NODE_MIN[t]:
                    return f"node at {c} (type {t}) has only {nc} children"
                if t == NODE4 or t == NODE16:
                    if t == NODE4:
                        keys = (<Node4*>h).keys
                        children = (<Node4*>h).children
                    else:
                        keys = (<Node16*>h).keys
                        children = (<Node16*>h).children
                    for i in range(<int>QART_NODE_CAP[t]):
                        if (i < nc) != (children[i] != 0) or (i > 0 and i < nc and keys[i - 1] >= keys[i]):
                            return f"node at {c}: keys unsorted or child slots inconsistent"
                elif t == NODE48:
                    n48 = <Node48*>h
                    memset(seen, 0, sizeof(seen))
                    cnt = 0
                    for i in range(256):
                        if n48.index[i]:
                            if n48.index[i] > 48 or seen[n48.index[i]] or n48.children[n48.index[i] - 1] == 0:
                                return f"node48 at {c}: bad index entry for byte {i}"
                            seen[n48.index[i]] = 1
                            cnt += 1
                    for i in range(48):
                        if (n48.children[i] != 0) != (seen[i + 1] != 0):
                            return f"node48 at {c}: orphan child slot {i}"
                    if cnt != nc:
                        return f"node48 at {c}: {cnt} indexed children but num_children {nc}"
                else:
                    cnt = 0
                    for i in range(256):
                        cnt += (<Node256*>h).children[i] != 0
                    if cnt != nc:
                        return f"node256 at {c}: {cnt} children but num_children {nc}"
                if sp >= MAX_DEPTH:
                    return "tree deeper than any key allows"
                stack[sp] = h
                pos[sp] = 0
                cdepth[sp] = d + p
                sp += 1
        if sp == 0:
            break
        h = stack[sp - 1]
        c = next_child(a, h, h.type, &pos[sp - 1])
        if a.err:
            return "malformed child slot"
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
            return f"{counts[t]} reachable nodes of type {t} but the counter says {a.num_nodes[t]}"
    if leaves != a.num_leaves:
        return f"{leaves} reachable leaves but the counter says {a.num_leaves}"
    fb = 0
    fblocks = 0
    for i in range(1, NUM_CLASSES):
        head = a.free_heads[i]
        while head:
            if budget == 0 or head % 8 or head < ARENA_HEADER_BYTES or head >= a.used or a.used - head < <uint64_t>i * 8:
                return f"free list of {i * 8}-byte blocks is malformed at {head}"
            if need_chunks(a, head, head + <uint64_t>i * 8, False) < 0:
                return f"free block at {head}"
            budget -= 1
            fb += <uint64_t>i * 8
            fblocks += 1
            head = (<uint64_t*>(a.base + head))[0]
    if fb != a.free_bytes or fblocks != a.free_blocks:
        return f"free lists hold {fb} bytes in {fblocks} blocks, counters say {a.free_bytes} / {a.free_blocks}"
    if ARENA_HEADER_BYTES + live + fb != a.used:
        return f"header + live {live} + free {fb} bytes != used {a.used}"
    return None

# Multi-key operations (included by _art.pyx): the bodies of ArtCore's batch calls and of
# ``remove_prefix``, as functions of the core.
#
# Contracts: arguments are validated before any work; batches are not atomic (rows before a
# failing row stay applied, the error names the row); ``remove_prefix`` verifies (lazy
# checksums) the whole doomed subtree before unlinking or freeing any of it, so a failure leaves
# the tree untouched.  ``warm_paths`` keeps no pointers, so the arena may move between rows.


cdef object remove_prefix(ArtCore core, prefix):
    """Remove every key that starts with prefix (b"" = all); returns how many."""
    cdef Py_ssize_t plen = core._key_len(prefix, "prefix", 0)
    cdef const uint8_t* p = <const uint8_t*>PyBytes_AS_STRING(prefix)
    cdef PrefixHit hit
    cdef uint64_t ml, n
    cdef uint8_t* lf
    cdef int64_t k
    if core.a.gate:
        core._gate_slow()
    core._reserve(INSERT_SLACK_BYTES)
    if plen == 0:
        n = core.a.num_leaves
        core._reset()
        return n
    if find_prefix(&core.a, p, <uint32_t>plen, &hit) < 0:
        core._fail(plen)
    if hit.target == 0:
        return 0
    ml = min_leaf(&core.a, hit.target) if (hit.target & 1) == 0 else hit.target
    lf = leaf_at(&core.a, ml) if ml else NULL
    if lf == NULL:
        core._fail(plen)
    if lf[0] < plen or memcmp(lf + 1, p, plen) != 0:
        return 0
    # Lazy checksums: verify the whole doomed subtree before unlinking or freeing any of it,
    # so a mismatch leaves the tree untouched.
    if core.a.lazy_end and (hit.target & 1) == 0 and touch_subtree(&core.a, hit.target) < 0:
        core._fail(plen)
    if hit.parent == NULL:
        core.a.root = 0
    elif remove_child(&core.a, hit.parent_ref, hit.byte, hit.ref) < 0:
        core._fail(plen)
    k = free_subtree(&core.a, hit.target)
    if k < 0:
        core._fail(plen)
    return k


DEF BATCH_NODE_BYTES_PER_ROW = 48  # inner-node bytes per inserted key, for the batch's one arena reservation


cdef object insert_batch(ArtCore core, const uint8_t[:, ::1] keys, const uint8_t[:, ::1] values):
    """Insert rows keys[i] -> values[i] in order; returns how many keys were new.

    Not atomic: rows before a failing row stay inserted (the error names the row).
    """
    cdef Py_ssize_t n = keys.shape[0], kl = keys.shape[1], i, g
    cdef uint32_t vs = core.a.value_size
    cdef uint64_t need
    cdef int r
    cdef Py_ssize_t new = 0
    core._check_key(kl, "key")
    if values.shape[0] != n or values.shape[1] != vs:
        raise ValueError(f"values must have shape ({n}, {vs}), got ({values.shape[0]}, {values.shape[1]})")
    if n == 0:
        return 0
    if core.a.gate:
        core._gate_slow()
    need = leaf_bytes(&core.a, <uint32_t>kl) + INSERT_SLACK_BYTES
    # one move of the arena for the whole batch instead of a doubling every time it fills (each move copies
    # the arena): room for a leaf plus a share of inner nodes per row; the loop below still checks every row
    core._reserve(need + <uint64_t>n * (leaf_bytes(&core.a, <uint32_t>kl) + BATCH_NODE_BYTES_PER_ROW))
    for g in range(0, n, WARM_GROUP):
        warm_paths(&core.a, &keys[g, 0], kl, <uint32_t>kl, min(WARM_GROUP, n - g), False)
        for i in range(g, min(g + WARM_GROUP, n)):
            if not core.writable or core.a.capacity - core.a.used < need:
                core._reserve(need)  # may move the arena: warm_paths kept no pointers
            r = art_insert(&core.a, &keys[i, 0], <uint32_t>kl, (&values[i, 0]) if vs else NULL)
            if r < 0:
                try:
                    core._fail(kl)
                except ValueError as exc:
                    raise ValueError(f"row {i}: {exc}") from None
            new += r
    return new


cdef object get_batch(ArtCore core, const uint8_t[:, ::1] keys):
    """(found bool[n], values uint8[n, value_size]); rows of missing keys are zero."""
    cdef Py_ssize_t n = keys.shape[0], kl = keys.shape[1], i, g
    cdef uint32_t vs = core.a.value_size
    cdef uint64_t leaf
    core._check_key(kl, "key")
    found = np.zeros(n, dtype=np.bool_)
    values = np.zeros((n, vs), dtype=np.uint8)
    if n == 0:
        return found, values
    if core.a.gate:
        core._gate_slow()
    cdef uint8_t[::1] f = found.view(np.uint8)
    cdef uint8_t[:, ::1] v = values
    for g in range(0, n, WARM_GROUP):
        warm_paths(&core.a, &keys[g, 0], kl, <uint32_t>kl, min(WARM_GROUP, n - g), False)
        for i in range(g, min(g + WARM_GROUP, n)):
            leaf = art_lookup(&core.a, &keys[i, 0], <uint32_t>kl)
            if leaf:
                f[i] = 1
                if vs:
                    memcpy(&v[i, 0], core.a.base + (leaf ^ 1) + 1 + kl, vs)
            elif core.a.err:
                core._fail(kl)
    return found, values


cdef object scan_prefix_batch(ArtCore core, const uint8_t[:, ::1] prefixes, Py_ssize_t key_len):
    """CSR scan: matches of prefixes[i] are rows offsets[i]:offsets[i+1] of keys/values.

    All matched keys must have one length (``key_len``, or the first match's length).
    """
    cdef Py_ssize_t n = prefixes.shape[0], plen = prefixes.shape[1], i, g
    cdef int64_t width = key_len
    cdef uint32_t vs = core.a.value_size
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
    if core.a.gate:
        core._gate_slow()
    offsets = np.zeros(n + 1, dtype=np.int64)
    cdef int64_t[::1] o = offsets
    qart_buf_init(&buf)
    qart_rows_init(&kr, width if width >= 0 else 0)
    qart_rows_init(&vr, vs)
    try:
        for g in range(0, n, WARM_GROUP):
            if plen:
                warm_paths(&core.a, &prefixes[g, 0], plen, <uint32_t>plen, min(WARM_GROUP, n - g), True)
            for i in range(g, min(g + WARM_GROUP, n)):
                p = &prefixes[i, 0] if plen else <const uint8_t*>b""
                buf.n = 0
                k = collect_prefix(&core.a, p, <uint32_t>plen, -1, &buf, False)
                if k < 0:
                    core._fail(plen)
                for j in range(buf.n):
                    lf = leaf_at(&core.a, buf.data[j])
                    if lf == NULL:
                        core._fail(plen)
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


cdef object scan_u64_prefix_batch(ArtCore core, uint8_t head, const uint64_t[::1] numbers, Py_ssize_t key_len):
    """``scan_prefix_batch`` over the 9-byte prefixes ``head || numbers[i]`` (big-endian),
    built in C: the residency index's batched lookup (no numpy byte-order round trip)."""
    cdef Py_ssize_t n = numbers.shape[0], i
    if not 9 <= key_len <= 255:
        raise ValueError(f"key_len must be in 9..255, got {key_len}")
    prefixes = np.empty((n, 9), dtype=np.uint8)
    cdef uint8_t[:, ::1] p = prefixes
    for i in range(n):
        block_prefix(&p[i, 0], head, numbers[i])
    return scan_prefix_batch(core, prefixes, key_len)


cdef list scan_from(ArtCore core, bytes start, bint exclusive, Py_ssize_t limit):
    """Ascending (key, value) pairs from the first key >= start (> start if exclusive)."""
    cdef Iter it
    cdef qart_offbuf buf
    cdef uint64_t c
    cdef Py_ssize_t slen = 0 if start is None else PyBytes_GET_SIZE(start)
    if slen > 255:
        raise ValueError(f"start key length must be in 0..255 bytes, got {slen}")
    if core.a.gate:
        core._gate_slow()
    if start is None or slen == 0:
        iter_init(&core.a, &it, core.a.root)
    elif iter_seek(&core.a, &it, <const uint8_t*>PyBytes_AS_STRING(start), <uint32_t>slen,
                   exclusive) < 0:
        core._fail(slen)
    qart_buf_init(&buf)
    try:
        while limit < 0 or <Py_ssize_t>buf.n < limit:
            c = iter_next(&core.a, &it)
            if c == 0:
                if core.a.err:
                    core._fail(slen)
                break
            if qart_push(&buf, c) < 0:
                raise MemoryError("scan_from: out of memory")
        return build_items(core, &buf, 0)
    finally:
        qart_buf_free(&buf)

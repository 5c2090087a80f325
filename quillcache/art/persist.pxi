# Persistence (included by _art.pyx): the arena header, chunk sizes, CRC-32C, and the typed
# checkpoint meta record (``quillcache.art.meta.ArenaMeta``) exported and loaded by ArtCore.
#
# Contracts
# - Arena bytes [0, 64): magic b"QUILLART", u32 format version, u32 byte-order mark, u32 value
#   size, u32 MAX_PREFIX (zero padded).  ``_header_problem`` names the first mismatch.
# - ``load_meta`` validates an ArenaMeta against the buffer in O(1 + free lists' heads): every
#   field that memory safety depends on (used size, counts, root, free-list heads) is checked here
#   in the compiled core, whatever the Python layer checked before; a bad field raises ValueError
#   naming it.  It reads no arena byte when ``lazy`` (the header and root are then checked when
#   first used).


cdef void write_header(uint8_t* base, uint32_t value_size) noexcept nogil:
    memset(base, 0, ARENA_HEADER_BYTES)
    memcpy(base, b"QUILLART", 8)
    (<uint32_t*>(base + 8))[0] = FORMAT_VERSION_C
    (<uint32_t*>(base + 12))[0] = BYTE_ORDER_MARK_C
    (<uint32_t*>(base + 16))[0] = value_size
    (<uint32_t*>(base + 20))[0] = MAX_PREFIX


cdef object _header_problem(const uint8_t* base, uint64_t nbytes, uint32_t value_size):
    """Why the 64-byte arena header at ``base`` is not this module's for ``value_size``, or None."""
    cdef uint32_t vs
    if nbytes < ARENA_HEADER_BYTES:
        return f"buffer of {nbytes} bytes is smaller than the {ARENA_HEADER_BYTES}-byte arena header"
    if memcmp(base, b"QUILLART", 8) != 0:
        return "buffer does not start with the arena magic b'QUILLART'"
    if (<uint32_t*>(base + 12))[0] != BYTE_ORDER_MARK_C:
        return "arena byte order does not match this machine"
    if (<uint32_t*>(base + 8))[0] != FORMAT_VERSION_C or (<uint32_t*>(base + 20))[0] != MAX_PREFIX:
        return f"unsupported arena format version {(<uint32_t*>(base + 8))[0]}"
    vs = (<uint32_t*>(base + 16))[0]
    if vs != value_size:
        return f"meta value_size {value_size} does not match the arena header's {vs}"
    return None


cdef uint32_t _chunk_shift(object chunk_bytes) except 0:
    """log2 of ``chunk_bytes``: an int that is a power of two in 4 KiB..16 MiB."""
    cdef object v = check_int("chunk_bytes", chunk_bytes)
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


cdef object export_meta(const Arena* a):
    """The ArenaMeta that, with the arena bytes and the root offset, re-creates the tree."""
    cdef int c
    return ArenaMeta(
        format_version=FORMAT_VERSION_C,
        value_size=a.value_size,
        arena_used_bytes=a.used,
        num_leaves=a.num_leaves,
        num_node4=a.num_nodes[NODE4],
        num_node16=a.num_nodes[NODE16],
        num_node48=a.num_nodes[NODE48],
        num_node256=a.num_nodes[NODE256],
        free_list_bytes=a.free_bytes,
        free_list_blocks=a.free_blocks,
        free_heads=tuple([(c * 8, a.free_heads[c]) for c in range(NUM_CLASSES) if a.free_heads[c]]),
    )


cdef uint64_t _meta_u64(object meta, str name) except? 0:
    """Field ``name`` of ``meta`` as a u64 (TypeError / ValueError naming it)."""
    value = getattr(meta, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"meta {name} must be an int, got {type(value).__name__}")
    if not 0 <= value < 2**64:
        raise ValueError(f"meta {name} must be in 0..{2**64 - 1}, got {value}")
    return value


cdef int load_meta(Arena* probe, object meta, const uint8_t* base, uint64_t nbytes, uint64_t root,
                   object chunk_crcs, uint32_t shift) except -1:
    """Fill ``probe`` (zeroed) from ``meta`` for the arena at ``base`` (``nbytes`` addressable),
    checking every field against the buffer; with ``chunk_crcs`` (``shift`` = log2 chunk bytes)
    also allocate the verified bitmap and table (the caller frees them if this raises)."""
    cdef bint lazy = chunk_crcs is not None
    cdef uint64_t used, size, head, c, nwords, nchunks = 0, r
    cdef uint32_t vs
    cdef const uint32_t[::1] crcs
    cdef int t
    if not isinstance(meta, ArenaMeta):
        raise TypeError(f"meta must be an ArenaMeta, got {type(meta).__name__}")
    if _meta_u64(meta, "format_version") != FORMAT_VERSION_C:
        raise ValueError(f"meta format_version {meta.format_version} is not {FORMAT_VERSION}")
    if _meta_u64(meta, "value_size") > 255:
        raise ValueError(f"meta value_size must be in 0..255, got {meta.value_size}")
    vs = <uint32_t>meta.value_size
    if nbytes < ARENA_HEADER_BYTES:
        raise ValueError(f"buffer of {nbytes} bytes is smaller than the {ARENA_HEADER_BYTES}-byte arena header")
    if not lazy:  # (lazily: before the first operation, once its chunk is verified)
        problem = _header_problem(base, nbytes, vs)
        if problem is not None:
            raise ValueError(problem)
    used = _meta_u64(meta, "arena_used_bytes")
    if used < ARENA_HEADER_BYTES or used % 8 or used > nbytes:
        raise ValueError(f"meta arena_used_bytes {used} must be a multiple of 8 in "
                         f"{ARENA_HEADER_BYTES}..{nbytes} (the buffer size)")
    if lazy:
        crcs = chunk_crcs
        nchunks = (used + (<uint64_t>1 << shift) - 1) >> shift
        if <uint64_t>crcs.shape[0] != nchunks:
            raise ValueError(f"chunk_crcs has {crcs.shape[0]} entries but arena_used_bytes {used} "
                             f"in chunks of {1 << shift} bytes needs {nchunks}")
    probe.base = <uint8_t*>base
    probe.used = used
    probe.capacity = used
    probe.value_size = vs
    probe.num_leaves = _meta_u64(meta, "num_leaves")
    probe.num_nodes[NODE4] = _meta_u64(meta, "num_node4")
    probe.num_nodes[NODE16] = _meta_u64(meta, "num_node16")
    probe.num_nodes[NODE48] = _meta_u64(meta, "num_node48")
    probe.num_nodes[NODE256] = _meta_u64(meta, "num_node256")
    probe.free_bytes = _meta_u64(meta, "free_list_bytes")
    probe.free_blocks = _meta_u64(meta, "free_list_blocks")
    if (root == 0) != (probe.num_leaves == 0):
        raise ValueError(f"root_offset {root} is inconsistent with num_leaves {probe.num_leaves}")
    if root != 0:
        r = root & ~(<uint64_t>1)
        if lazy:  # offsets only: the root's bytes are checked when first used
            bad_root = r % 8 or r < ARENA_HEADER_BYTES or r >= used
        else:
            bad_root = ((root & 1 and leaf_at(probe, root) == NULL)
                        or ((root & 1) == 0 and node_at(probe, root) == NULL))
        if bad_root:
            raise ValueError(f"root_offset {root} does not name a node or leaf inside the "
                             f"{used} used arena bytes")
    min_bytes = probe.num_leaves * 8  # Python ints from here: no overflow
    for t in range(NODE4, NODE256 + 1):
        min_bytes += probe.num_nodes[t] * QART_NODE_SIZE[t]
    if (min_bytes + ARENA_HEADER_BYTES + probe.free_bytes > used
            or probe.free_blocks * 8 > probe.free_bytes):
        raise ValueError(f"meta counts (nodes, leaves, free_list_bytes {probe.free_bytes}, "
                         f"free_list_blocks {probe.free_blocks}) cannot fit in {used} arena bytes")
    for entry in meta.free_heads:
        block_bytes, value = entry
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) \
                or block_bytes % 8 or not 8 <= block_bytes < NUM_CLASSES * 8:
            raise ValueError(f"meta free_heads: size class {block_bytes} is not a multiple of 8 in "
                             f"8..{NUM_CLASSES * 8 - 8}")
        size = block_bytes
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
            raise ValueError(f"meta free_heads[{size}]: free-list head {value!r} is not a u64")
        head = value
        if head % 8 or head < ARENA_HEADER_BYTES or head >= used or used - head < size:
            raise ValueError(f"meta free_heads[{size}]: free-list head {head} lies outside the "
                             f"{used} used arena bytes")
        if probe.free_heads[size >> 3]:
            raise ValueError(f"meta free_heads: size class {size} is listed twice")
        probe.free_heads[size >> 3] = head
    if lazy:
        # Bitmap with one spare word: bits num_chunks.. are set, so an object straddling
        # the end of the table (at most one chunk further) tests a valid, set bit.
        nwords = (nchunks >> 6) + 2
        probe.chunk_bits = <uint64_t*>malloc(nwords * sizeof(uint64_t))
        probe.chunk_crc = <uint32_t*>malloc(nchunks * sizeof(uint32_t))
        if probe.chunk_bits == NULL or probe.chunk_crc == NULL:
            raise MemoryError(f"cannot allocate the table of {nchunks} chunk checksums")
        memset(probe.chunk_bits, 0, nwords * sizeof(uint64_t))
        for c in range(nchunks, nwords * 64):
            probe.chunk_bits[c >> 6] |= <uint64_t>1 << (c & 63)
        for c in range(nchunks):
            probe.chunk_crc[c] = crcs[c]
        probe.num_chunks = nchunks
        probe.chunk_shift = shift
        probe.table_end = used
        probe.lazy_end = used
        probe.gate = GATE_HEADER
    return 0


cdef str checksum_msg(ArtCore core):
    cdef uint64_t c = core.a.bad_chunk
    cdef uint64_t lo = c << core.a.chunk_shift
    cdef uint64_t hi = lo + (<uint64_t>1 << core.a.chunk_shift)
    if core.header_bad:
        return ("corrupt arena: the header passes its checksum but is refused ("
                f"{_header_problem(core.a.base, core.a.used, core.a.value_size)})")
    if hi > core.a.table_end:
        hi = core.a.table_end
    return f"corrupt arena: chunk {c} (bytes {lo}..{hi - 1}) checksum mismatch"


cdef object chunk_crc_table(const Arena* a, uint32_t shift):
    """uint32[ceil(used / 2**shift)]: CRC-32C of each chunk of the used arena (the last may be
    short).  The caller verified every lazily checked chunk first."""
    cdef uint64_t n, i, lo, hi, cb = <uint64_t>1 << shift
    n = (a.used + cb - 1) >> shift
    out = np.empty(n, dtype=np.uint32)
    cdef uint32_t[::1] o = out
    for i in range(n):
        lo = i << shift
        hi = lo + cb if lo + cb < a.used else a.used
        o[i] = qart_crc32c(0, a.base + lo, hi - lo)
    return out

# Results (included by _art.pyx): Python objects built from raw scan output.
#
# Contracts: a result matrix handed to numpy is owned by a ``_RowsOwner`` (freed with it, never
# copied); scan limits are checked exactly as the reference checks them.


cdef char* FORMAT_B = "B"


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
    """A scan limit: an int in 0..2**62 (bool rejected). The common case is one type test; anything
    else goes through ``quillcache._checks.check_int``, so the messages are the package's own."""
    if type(limit) is int and 0 <= limit <= MAX_LIMIT:
        return limit
    return check_int("limit", limit, 0, MAX_LIMIT)


cdef list build_items(ArtCore core, qart_offbuf* buf, size_t start):
    """(key, value) tuples for leaf offsets buf[start:], read with bounds checks."""
    cdef list out = PyList_New(buf.n - start)
    cdef size_t i
    cdef uint8_t* lf
    cdef object k, v, pair
    core.busy += 1
    try:
        for i in range(start, buf.n):
            lf = leaf_at(&core.a, buf.data[i])
            if lf == NULL:
                core._fail(0)
            k = PyBytes_FromStringAndSize(<char*>lf + 1, lf[0])
            v = PyBytes_FromStringAndSize(<char*>lf + 1 + lf[0], core.a.value_size)
            pair = PyTuple_New(2)
            Py_INCREF(k)
            PyTuple_SET_ITEM(pair, 0, k)
            Py_INCREF(v)
            PyTuple_SET_ITEM(pair, 1, v)
            Py_INCREF(pair)
            PyList_SET_ITEM(out, i - start, pair)
    finally:
        core.busy -= 1
    return out


cdef dict arena_stats(const Arena* a):
    """The counters ``ArtCore.stats()`` reports."""
    return {
        "node4": a.num_nodes[NODE4],
        "node16": a.num_nodes[NODE16],
        "node48": a.num_nodes[NODE48],
        "node256": a.num_nodes[NODE256],
        "leaves": a.num_leaves,
        "arena_used_bytes": a.used,
        "arena_capacity_bytes": a.capacity,
        "free_list_bytes": a.free_bytes,
        "free_list_blocks": a.free_blocks,
        "chunks_total": a.num_chunks,
        "chunks_verified": a.chunks_verified,
    }

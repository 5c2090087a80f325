"""Inline, GIL-free kernels of the count-min sketch core (``_sketch.pyx``).

Hash: ``h = splitmix64(key ^ splitmix64(seed))`` (``quillcache/_mix.pxd``); row ``i`` uses ``g_i = (h1 + i*h2) mod 2**32``
with ``h1``/``h2`` the low/high halves of ``h``; its column is ``(g_i * width) >> 32``
(Lemire's multiply-shift). Counters are uint32 in one row-major ``depth x width`` array and
saturate at UINT32_MAX. ``quillcache.sketch.reference`` is the specification.
"""

from libc.stdint cimport uint32_t, uint64_t

from quillcache._mix cimport splitmix64

cdef extern from *:
    """
    #define QC_SK_U32MAX 0xFFFFFFFFULL
    #define QC_SK_U64MAX 0xFFFFFFFFFFFFFFFFULL
    #define QC_SK_MAX_DEPTH 32
    """
    const uint64_t QC_SK_U32MAX
    const uint64_t QC_SK_U64MAX
    const int QC_SK_MAX_DEPTH


cdef inline uint64_t _sat_add64(uint64_t a, uint64_t b) noexcept nogil:
    cdef uint64_t s = a + b
    return s if s >= a else QC_SK_U64MAX


# Keys are processed in blocks of _BLOCK: first every key of the block is hashed and its
# ``depth`` counter offsets are computed row by row (a loop the compiler vectorises: one
# 32x32->64 multiply per lane), then the counters are updated key by key, in stream order.
# Splitting the work shortens each key's dependency chain in the update loop and lets the
# offsets vectorise (``experiments/microbench/bench_sketch.py`` measures the batched path).
cdef enum:
    _BLOCK = 64


cdef inline void _block_offsets(const uint64_t* keys, Py_ssize_t m, uint64_t skey, uint32_t w,
                                Py_ssize_t d, uint64_t* hb, uint32_t* off) noexcept nogil:
    """``hb[j]`` = hash of ``keys[j]``; ``off[i*_BLOCK + j]`` = flat counter index in row ``i``."""
    cdef uint32_t g[_BLOCK]
    cdef uint32_t h2[_BLOCK]
    cdef uint32_t* row
    cdef uint32_t base
    cdef uint64_t h
    cdef Py_ssize_t i, j
    for j in range(m):
        h = splitmix64(keys[j] ^ skey)
        hb[j] = h
        g[j] = <uint32_t>h
        h2[j] = <uint32_t>(h >> 32)
    for i in range(d):
        base = <uint32_t>i * w
        row = off + i * _BLOCK
        for j in range(m):
            row[j] = base + <uint32_t>((<uint64_t>g[j] * <uint64_t>w) >> 32)
            g[j] = g[j] + h2[j]


cdef inline uint32_t _cu_at(uint32_t* t, const uint32_t* off, Py_ssize_t d, uint64_t c) noexcept nogil:
    """Conservative update by ``c`` of the key whose offsets are ``off[i*_BLOCK]``; new estimate."""
    cdef uint32_t m = <uint32_t>QC_SK_U32MAX
    cdef uint32_t v, new
    cdef uint64_t nw
    cdef Py_ssize_t i
    for i in range(d):
        v = t[off[i * _BLOCK]]
        m = v if v < m else m
    nw = <uint64_t>m + c
    new = <uint32_t>nw if nw < QC_SK_U32MAX else <uint32_t>QC_SK_U32MAX
    for i in range(d):
        v = t[off[i * _BLOCK]]
        t[off[i * _BLOCK]] = v if v > new else new
    return new


cdef inline uint32_t _cu5_at(uint32_t* t, const uint32_t* off, uint64_t c) noexcept nogil:
    """``_cu_at`` unrolled for depth 5 (the default geometry): all loads, then all stores."""
    cdef uint32_t* p0 = t + off[0]
    cdef uint32_t* p1 = t + off[_BLOCK]
    cdef uint32_t* p2 = t + off[2 * _BLOCK]
    cdef uint32_t* p3 = t + off[3 * _BLOCK]
    cdef uint32_t* p4 = t + off[4 * _BLOCK]
    cdef uint32_t v0 = p0[0], v1 = p1[0], v2 = p2[0], v3 = p3[0], v4 = p4[0]
    cdef uint32_t m01 = v0 if v0 < v1 else v1
    cdef uint32_t m23 = v2 if v2 < v3 else v3
    cdef uint32_t m = m01 if m01 < m23 else m23
    m = m if m < v4 else v4
    cdef uint64_t nw = <uint64_t>m + c
    cdef uint32_t new = <uint32_t>nw if nw < QC_SK_U32MAX else <uint32_t>QC_SK_U32MAX
    p0[0] = v0 if v0 > new else new
    p1[0] = v1 if v1 > new else new
    p2[0] = v2 if v2 > new else new
    p3[0] = v3 if v3 > new else new
    p4[0] = v4 if v4 > new else new
    return new


cdef inline uint32_t _std_at(uint32_t* t, const uint32_t* off, Py_ssize_t d, uint64_t c) noexcept nogil:
    """Standard (saturating) update by ``c``; returns the new estimate."""
    cdef uint32_t m = <uint32_t>QC_SK_U32MAX
    cdef uint64_t nv
    cdef uint32_t v
    cdef Py_ssize_t i
    for i in range(d):
        nv = <uint64_t>t[off[i * _BLOCK]] + c
        v = <uint32_t>nv if nv < QC_SK_U32MAX else <uint32_t>QC_SK_U32MAX
        t[off[i * _BLOCK]] = v
        m = v if v < m else m
    return m


cdef inline uint32_t _std5_at(uint32_t* t, const uint32_t* off, uint64_t c) noexcept nogil:
    """``_std_at`` unrolled for depth 5."""
    cdef uint32_t* p0 = t + off[0]
    cdef uint32_t* p1 = t + off[_BLOCK]
    cdef uint32_t* p2 = t + off[2 * _BLOCK]
    cdef uint32_t* p3 = t + off[3 * _BLOCK]
    cdef uint32_t* p4 = t + off[4 * _BLOCK]
    cdef uint64_t n0 = <uint64_t>p0[0] + c, n1 = <uint64_t>p1[0] + c, n2 = <uint64_t>p2[0] + c
    cdef uint64_t n3 = <uint64_t>p3[0] + c, n4 = <uint64_t>p4[0] + c
    cdef uint32_t v0 = <uint32_t>n0 if n0 < QC_SK_U32MAX else <uint32_t>QC_SK_U32MAX
    cdef uint32_t v1 = <uint32_t>n1 if n1 < QC_SK_U32MAX else <uint32_t>QC_SK_U32MAX
    cdef uint32_t v2 = <uint32_t>n2 if n2 < QC_SK_U32MAX else <uint32_t>QC_SK_U32MAX
    cdef uint32_t v3 = <uint32_t>n3 if n3 < QC_SK_U32MAX else <uint32_t>QC_SK_U32MAX
    cdef uint32_t v4 = <uint32_t>n4 if n4 < QC_SK_U32MAX else <uint32_t>QC_SK_U32MAX
    p0[0] = v0
    p1[0] = v1
    p2[0] = v2
    p3[0] = v3
    p4[0] = v4
    cdef uint32_t m01 = v0 if v0 < v1 else v1
    cdef uint32_t m23 = v2 if v2 < v3 else v3
    cdef uint32_t m = m01 if m01 < m23 else m23
    return m if m < v4 else v4


cdef inline uint32_t _query5_at(const uint32_t* t, const uint32_t* off) noexcept nogil:
    cdef uint32_t v0 = t[off[0]], v1 = t[off[_BLOCK]], v2 = t[off[2 * _BLOCK]]
    cdef uint32_t v3 = t[off[3 * _BLOCK]], v4 = t[off[4 * _BLOCK]]
    cdef uint32_t m01 = v0 if v0 < v1 else v1
    cdef uint32_t m23 = v2 if v2 < v3 else v3
    cdef uint32_t m = m01 if m01 < m23 else m23
    return m if m < v4 else v4


cdef inline uint32_t _update_at(uint32_t* t, const uint32_t* off, Py_ssize_t d, bint conservative,
                                uint64_t c) noexcept nogil:
    """Dispatch to the right update; the branches are loop-invariant, so well predicted."""
    if conservative:
        if d == 5:
            return _cu5_at(t, off, c)
        return _cu_at(t, off, d, c)
    if d == 5:
        return _std5_at(t, off, c)
    return _std_at(t, off, d, c)


cdef inline uint32_t _query_at(const uint32_t* t, const uint32_t* off, Py_ssize_t d) noexcept nogil:
    cdef uint32_t m = <uint32_t>QC_SK_U32MAX
    cdef uint32_t v
    cdef Py_ssize_t i
    for i in range(d):
        v = t[off[i * _BLOCK]]
        m = v if v < m else m
    return m


cdef inline uint32_t _query_one(const uint32_t* t, uint32_t w, Py_ssize_t d, uint64_t h) noexcept nogil:
    """Estimate from a key hash without the block machinery (single-key calls, heap rebuilds)."""
    cdef uint32_t h2 = <uint32_t>(h >> 32)
    cdef uint32_t g = <uint32_t>h
    cdef uint32_t m = <uint32_t>QC_SK_U32MAX
    cdef uint32_t v
    cdef Py_ssize_t i
    for i in range(d):
        v = t[<uint64_t>i * w + ((<uint64_t>g * w) >> 32)]
        m = v if v < m else m
        g = g + h2
    return m

# cython: language_level=3
"""Compiled residency keys: ``residency_key`` of many object keys at once (reference:
:func:`quillcache.master.residency.residency_key`, tested equal on arbitrary text).

Invariants:
- ``residency_keys(keys)`` returns ``(hashes, identities)``: ``hashes[i]`` (uint64) and
  ``identities[16 * i:16 * (i + 1)]`` are exactly ``residency_key(keys[i])``;
- a ``kv:<16 hex>:<32 hex>`` key (lowercase hex digits only: a key with an upper-case digit is a
  different object, so it must not share the residency key) is parsed here; every other key is hashed
  with BLAKE2b-192 (``include/qc_blake2b.h``, RFC 7693) of its UTF-8 bytes, lone surrogates encoded
  as ``"surrogatepass"`` does (three bytes each, never combined into a pair);
- a key that is the same object as the key before it (one per replica, consecutively) reuses that
  key's result;
- a non-str key raises TypeError naming its position and type; nothing is returned then.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.object cimport PyObject
from libc.stdint cimport int8_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

import numpy as np

cdef extern from "Python.h":
    int PyUnicode_Check(object o)
    int PyUnicode_READY(object o) except -1
    Py_ssize_t PyUnicode_GET_LENGTH(object o)
    int PyUnicode_KIND(object o)
    void* PyUnicode_DATA(object o)
    int PyUnicode_IS_ASCII(object o)
    uint32_t PyUnicode_READ(int kind, void* data, Py_ssize_t i) nogil
    PyObject* PyList_GET_ITEM(object lst, Py_ssize_t i)
    Py_ssize_t PyList_GET_SIZE(object lst)

cdef extern from "qc_blake2b.h":
    void qc_blake2b(uint8_t* out, size_t outlen, const uint8_t* data, size_t n) nogil

DEF KV_LEN = 52  # len("kv:") + 16 + len(":") + 32
DEF IDENT = 16

cdef int8_t HEXVAL[256]


cdef void _init_hex() noexcept:
    cdef int c
    for c in range(256):
        HEXVAL[c] = -1
    for c in range(10):
        HEXVAL[ord('0') + c] = c
    for c in range(6):
        HEXVAL[ord('a') + c] = 10 + c  # (no 'A'..'F': see the module docstring)


_init_hex()


cdef inline int _hex_at(int kind, void* data, Py_ssize_t i) noexcept nogil:
    cdef uint32_t c = PyUnicode_READ(kind, data, i)
    return HEXVAL[c] if c < 256 else -1


cdef int _parse_kv(int kind, void* data, uint64_t* h, uint8_t* ident) noexcept nogil:
    """1 and ``(h, ident)`` set if the KV_LEN characters at ``data`` are a kv: key, else 0."""
    cdef Py_ssize_t i
    cdef int a, b
    cdef uint64_t x = 0
    if (PyUnicode_READ(kind, data, 0) != 0x6B or PyUnicode_READ(kind, data, 1) != 0x76  # k v
            or PyUnicode_READ(kind, data, 2) != 0x3A or PyUnicode_READ(kind, data, 19) != 0x3A):  # colons
        return 0
    for i in range(3, 19):
        a = _hex_at(kind, data, i)
        if a < 0:
            return 0
        x = (x << 4) | <uint64_t>a
    for i in range(IDENT):
        a = _hex_at(kind, data, 20 + 2 * i)
        b = _hex_at(kind, data, 21 + 2 * i)
        if a < 0 or b < 0:
            return 0
        ident[i] = <uint8_t>((a << 4) | b)
    h[0] = x
    return 1


cdef class _Scratch:
    """A growable byte buffer for the UTF-8 form of non-ASCII keys."""
    cdef uint8_t* buf
    cdef size_t cap

    def __dealloc__(self):
        free(self.buf)

    cdef uint8_t* reserve(self, size_t n) except NULL:
        if n > self.cap:
            free(self.buf)
            self.cap = 0
            self.buf = <uint8_t*>malloc(n if n > 256 else 256)
            if self.buf == NULL:
                raise MemoryError(f"{n} bytes for a key's UTF-8 form")
            self.cap = n if n > 256 else 256
        return self.buf


cdef size_t _utf8_surrogatepass(int kind, void* data, Py_ssize_t n, uint8_t* out) noexcept nogil:
    """UTF-8 of ``n`` code points into ``out`` (room for 4 * n bytes); surrogates as 3 bytes each."""
    cdef Py_ssize_t i
    cdef size_t j = 0
    cdef uint32_t c
    for i in range(n):
        c = PyUnicode_READ(kind, data, i)
        if c < 0x80:
            out[j] = <uint8_t>c
            j += 1
        elif c < 0x800:
            out[j] = <uint8_t>(0xC0 | (c >> 6))
            out[j + 1] = <uint8_t>(0x80 | (c & 0x3F))
            j += 2
        elif c < 0x10000:
            out[j] = <uint8_t>(0xE0 | (c >> 12))
            out[j + 1] = <uint8_t>(0x80 | ((c >> 6) & 0x3F))
            out[j + 2] = <uint8_t>(0x80 | (c & 0x3F))
            j += 3
        else:
            out[j] = <uint8_t>(0xF0 | (c >> 18))
            out[j + 1] = <uint8_t>(0x80 | ((c >> 12) & 0x3F))
            out[j + 2] = <uint8_t>(0x80 | ((c >> 6) & 0x3F))
            out[j + 3] = <uint8_t>(0x80 | (c & 0x3F))
            j += 4
    return j


cdef int _one(object key, _Scratch scratch, uint64_t* h, uint8_t* ident) except -1:
    """``residency_key(key)`` into ``(h, ident)``; ``key`` is a str (checked by the caller)."""
    cdef Py_ssize_t n
    cdef int kind, i
    cdef void* data
    cdef const uint8_t* src
    cdef size_t m
    cdef uint8_t d[24]
    cdef uint64_t x = 0
    PyUnicode_READY(key)
    n = PyUnicode_GET_LENGTH(key)
    kind = PyUnicode_KIND(key)
    data = PyUnicode_DATA(key)
    if n == KV_LEN and _parse_kv(kind, data, h, ident):
        return 0
    if PyUnicode_IS_ASCII(key):
        src = <const uint8_t*>data
        m = <size_t>n
    else:
        src = scratch.reserve(4 * <size_t>n)
        m = _utf8_surrogatepass(kind, data, n, <uint8_t*>src)
    qc_blake2b(d, 24, src, m)
    for i in range(8):
        x = (x << 8) | d[i]
    h[0] = x
    memcpy(ident, d + 8, IDENT)
    return 0


def residency_keys(keys):
    """``(hashes uint64[n], identities bytes[16 n])`` of ``keys`` (a list of str, or any iterable of
    them): ``residency_key(keys[i]) == (int(hashes[i]), identities[16 i:16 i + 16])``."""
    if type(keys) is not list:
        keys = list(keys)
    cdef Py_ssize_t n = PyList_GET_SIZE(keys), i
    cdef _Scratch scratch = _Scratch()
    hashes = np.empty(n, dtype=np.uint64)
    cdef uint64_t[::1] hv = hashes
    idents = PyBytes_FromStringAndSize(NULL, n * IDENT)
    cdef uint8_t* iv = <uint8_t*>PyBytes_AS_STRING(idents)
    cdef PyObject* prev = NULL
    cdef PyObject* k
    for i in range(n):
        k = PyList_GET_ITEM(keys, i)
        if k == prev:
            hv[i] = hv[i - 1]
            memcpy(iv + i * IDENT, iv + (i - 1) * IDENT, IDENT)
            continue
        if not PyUnicode_Check(<object>k):
            raise TypeError(f"keys[{i}] must be str, got {type(<object>k).__name__} {(<object>k)!r:.60}")
        _one(<object>k, scratch, &hv[i], iv + i * IDENT)
        prev = k
    return hashes, idents


def residency_key1(key):
    """``residency_key(key)`` of one str key (the compiled path of single-key adds and drops)."""
    cdef uint64_t h
    cdef uint8_t ident[IDENT]
    if not PyUnicode_Check(key):
        raise TypeError(f"key must be str, got {type(key).__name__} {key!r:.60}")
    _one(key, _Scratch(), &h, ident)
    return h, PyBytes_FromStringAndSize(<char*>ident, IDENT)


def blake2b(const uint8_t[::1] data, int digest_size):
    """``hashlib.blake2b(data, digest_size=digest_size).digest()`` by ``include/qc_blake2b.h``
    (exposed so the tests can check the C BLAKE2b on its own)."""
    cdef uint8_t out[64]
    if not 1 <= digest_size <= 64:
        raise ValueError(f"digest_size must be 1..64, got {digest_size}")
    qc_blake2b(out, <size_t>digest_size, &data[0] if data.shape[0] else NULL, <size_t>data.shape[0])
    return PyBytes_FromStringAndSize(<char*>out, digest_size)

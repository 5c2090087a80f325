"""Numba CPU kernels, bit-identical to ``reference.py`` (private; use the codecs).

``@njit(parallel=True, fastmath=False)``: rows are spread over threads with ``prange``; no
float reduction is reassociated; ``max``/``min`` are exact in any order. The scalar
steps are the ones the CUDA kernels use (``_scalar.py``). Kernels trust their arguments (shapes,
dtypes, finiteness, group sizes that divide): the codecs check them first.
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, prange

from quillcache._jitcache import guard_cache
from quillcache.kvquant import _scalar
from quillcache.kvquant.fp8 import E4M3_TABLE

_inline = njit(inline="always", fastmath=False)
sym_scale = _inline(_scalar.sym_scale)
int8_code = _inline(_scalar.int8_code)
e4m3_code = _inline(_scalar.e4m3_encode_scalar)
asym_scale = _inline(_scalar.asym_scale)
asym_zero = _inline(_scalar.asym_zero)
asym_code = _inline(_scalar.asym_code)
asym_value = _inline(_scalar.asym_value)

_TABLE = np.array(E4M3_TABLE)  # writable: one compiled signature
_kernel = njit(parallel=True, fastmath=False, cache=True, nogil=True)


@_kernel
def _int8_quantize_rows(x, xi, q, s, chunks):
    """Fused per-row int8 (rows = token x head): amax, scale and codes in one pass over each row.

    ``xi`` is ``x`` viewed as int32: ``max |x|`` of finite floats is the max of their bit patterns
    with the sign cleared, an integer reduction the compiler vectorises without reassociating
    float math (a float max reduction is not vectorised under ``fastmath=False``). Rows are
    handed out in ``chunks`` contiguous chunks, one bit-view scratch per chunk.
    """
    n, d_n = x.shape
    per = (n + chunks - 1) // chunks
    qmaxf = np.float32(127.0)
    for c in prange(chunks):
        scratch = np.empty(1, np.int32)
        as_float = scratch.view(np.float32)
        for i in range(c * per, min(n, (c + 1) * per)):
            bits = 0
            for d in range(d_n):
                bits = max(bits, xi[i, d] & 0x7FFFFFFF)
            scratch[0] = bits
            sc = sym_scale(as_float[0], qmaxf)
            s[i] = sc
            for d in range(d_n):
                r = np.rint(x[i, d] / sc)  # the same value as _scalar.int8_code, in a vectorisable form
                q[i, d] = np.int8(min(max(r, np.float32(-127.0)), qmaxf))


@_kernel
def _row_amax(x, out):
    t_n, h_n, d_n = x.shape
    for i in prange(t_n * h_n):
        t = i // h_n
        h = i - t * h_n
        amax = np.float32(0.0)
        for d in range(d_n):
            a = abs(x[t, h, d])
            if a > amax:
                amax = a
        out[t, h] = amax


@_kernel
def _int8_encode(x, s, q):
    t_n, h_n, d_n = x.shape
    ts, hs = s.shape
    for i in prange(t_n * h_n):
        t = i // h_n
        h = i - t * h_n
        sc = s[t if ts > 1 else 0, h if hs > 1 else 0]
        for d in range(d_n):
            q[t, h, d] = int8_code(x[t, h, d], sc)


@_kernel
def _int8_decode(q, s, out):
    """Rows (token x head) of ``q``/``out`` as 2-D views; ``s`` flat per row, or one scale (size 1)."""
    n, d_n = q.shape
    one = s.size == 1
    for i in prange(n):
        sc = s[0] if one else s[i]
        for d in range(d_n):
            out[i, d] = np.float32(q[i, d]) * sc


@_kernel
def _fp8_encode(x, s, c):
    t_n, h_n, d_n = x.shape
    hs = s.shape[1]
    for i in prange(t_n * h_n):
        t = i // h_n
        h = i - t * h_n
        sc = s[0, h if hs > 1 else 0]
        for d in range(d_n):
            c[t, h, d] = e4m3_code(x[t, h, d], sc)


@_kernel
def _fp8_decode(c, s, table, out):
    t_n, h_n, d_n = c.shape
    hs = s.shape[1]
    for i in prange(t_n * h_n):
        t = i // h_n
        h = i - t * h_n
        sc = s[0, h if hs > 1 else 0]
        for d in range(d_n):
            out[t, h, d] = table[c[t, h, d]] * sc


@_kernel
def _asym_params(x, gt, gd, qmaxf, s, z):
    """Per group: min, max, then scale and integer zero point; parallel over groups."""
    t_n, h_n, d_n = x.shape
    g_t, g_h, g_d = s.shape
    for g in prange(g_t * g_h * g_d):
        gi = g // (g_h * g_d)
        rem = g - gi * (g_h * g_d)
        h = rem // g_d
        gj = rem - h * g_d
        mn = x[gi * gt, h, gj * gd]
        mx = mn
        for t in range(gi * gt, gi * gt + gt):
            for d in range(gj * gd, gj * gd + gd):
                v = x[t, h, d]
                if v < mn:
                    mn = v
                if v > mx:
                    mx = v
        sc = asym_scale(mn, mx, qmaxf)
        s[gi, h, gj] = sc
        z[gi, h, gj] = asym_zero(mn, sc)


@_kernel
def _asym_encode(x, s, z, gt, gd, qmax, q):
    t_n, h_n, d_n = x.shape
    for i in prange(t_n * h_n):
        t = i // h_n
        h = i - t * h_n
        gi = t // gt
        for d in range(d_n):
            gj = d // gd
            q[t, h, d] = asym_code(x[t, h, d], s[gi, h, gj], z[gi, h, gj], qmax)


@_kernel
def _asym_decode(q, s, z, gt, gd, out):
    t_n, h_n, d_n = q.shape
    for i in prange(t_n * h_n):
        t = i // h_n
        h = i - t * h_n
        gi = t // gt
        for d in range(d_n):
            gj = d // gd
            out[t, h, d] = asym_value(np.int32(q[t, h, d]), z[gi, h, gj], s[gi, h, gj])


@_kernel
def _pack(flat, bits, out):
    per = 8 // bits
    n = flat.size
    for b in prange(out.size):
        acc = 0
        for k in range(per):
            j = b * per + k
            if j < n:
                acc |= np.int64(flat[j]) << (k * bits)
        out[b] = acc


@_kernel
def _unpack(packed, bits, out):
    per = 8 // bits
    mask = (1 << bits) - 1
    n = out.size
    for b in prange(packed.size):
        v = np.int64(packed[b])
        for k in range(per):
            j = b * per + k
            if j < n:
                out[j] = (v >> (k * bits)) & mask


# ----------------------------------------------------------------------------- the backend interface


def int8_quantize(x: np.ndarray, per_tensor: bool) -> tuple[np.ndarray, np.ndarray]:
    t, h, _ = x.shape
    q = np.empty(x.shape, np.int8)
    if not per_tensor:
        s = np.empty((t, h), np.float32)
        x2 = x.reshape(t * h, -1)
        _int8_quantize_rows(x2, x2.view(np.int32), q.reshape(t * h, -1), s.reshape(-1),
                            min(t * h, 4 * get_num_threads()))
        return q, s
    a = np.empty((t, h), np.float32)
    _row_amax(x, a)
    s = np.empty((1, 1), np.float32)
    s[0, 0] = sym_scale(np.float32(a.max()), np.float32(127.0))
    _int8_encode(x, s, q)
    return q, s


def int8_dequantize(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    out = np.empty(q.shape, np.float32)
    int8_dequantize_into(q, s, out)
    return out


def int8_dequantize_into(q: np.ndarray, s: np.ndarray, out: np.ndarray) -> None:
    """``int8_dequantize`` into a preallocated float32 ``out`` (the study times this)."""
    t, h, _ = q.shape
    _int8_decode(q.reshape(t * h, -1), s.reshape(-1), out.reshape(t * h, -1))


def int8_quantize_into(x: np.ndarray, q: np.ndarray, s: np.ndarray) -> None:
    """Per token-head ``int8_quantize`` into preallocated ``q`` (int8) and ``s`` (float32, (T, H))."""
    t, h, _ = x.shape
    x2 = x.reshape(t * h, -1)
    _int8_quantize_rows(x2, x2.view(np.int32), q.reshape(t * h, -1), s.reshape(-1),
                            min(t * h, 4 * get_num_threads()))


def fp8_quantize(x: np.ndarray, per_head: bool, scale: float | None) -> tuple[np.ndarray, np.ndarray]:
    t, h, _ = x.shape
    hs = h if per_head else 1
    s = np.empty((1, hs), np.float32)
    if scale is None:
        a = np.empty((t, h), np.float32)
        _row_amax(x, a)
        amax = a.max(axis=0) if per_head else np.array([a.max()], np.float32)
        for j in range(hs):
            s[0, j] = sym_scale(np.float32(amax[j]), np.float32(448.0))
    else:
        s[:] = np.float32(scale)
    c = np.empty(x.shape, np.uint8)
    _fp8_encode(x, s, c)
    return c, s


def fp8_dequantize(c: np.ndarray, s: np.ndarray) -> np.ndarray:
    out = np.empty(c.shape, np.float32)
    _fp8_decode(c, s, _TABLE, out)
    return out


def asym_quantize(x: np.ndarray, bits: int, gt: int, gd: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t, h, d = x.shape
    qmax = (1 << bits) - 1
    s = np.empty((t // gt, h, d // gd), np.float32)
    z = np.empty(s.shape, np.int32)
    _asym_params(x, gt, gd, np.float32(qmax), s, z)
    q = np.empty(x.shape, np.uint8)
    _asym_encode(x, s, z, gt, gd, qmax, q)
    return q, s, z


def asym_dequantize(q: np.ndarray, s: np.ndarray, z: np.ndarray, gt: int, gd: int) -> np.ndarray:
    out = np.empty(q.shape, np.float32)
    _asym_decode(q, s, z, gt, gd, out)
    return out


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    flat = codes.reshape(-1)
    out = np.empty(-(-flat.size * bits // 8), np.uint8)
    _pack(flat, bits, out)
    return out


def unpack_bits(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    out = np.empty(count, np.uint8)
    _unpack(packed, bits, out)
    return out


# flush this module's cached kernels when it or a dependency changed (quillcache._jitcache)
guard_cache(__name__, "quillcache.kvquant._scalar", "quillcache.kvquant.fp8")

"""``numba.cuda`` kernels on CuPy device arrays, bit-identical to ``reference.py`` (private).

Import cost and dependencies: importing this module imports ``numba.cuda`` (no GPU needed);
kernels compile on first launch. ``cupy`` is optional (the ``gpu`` extra): arrays that are CuPy
arrays get CuPy outputs and are launched on CuPy's current stream (``cuda.external_stream``);
NumPy arrays get NumPy outputs, which is what Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``,
set before ``numba.cuda`` is first imported) runs: the tests use it on small shapes.

Design: every pass is elementwise over the ``T*H*D`` elements (coalesced loads/stores, one thread
per element); the reductions (``max |x|`` per scale cell, ``min``/``max`` per group) are
``cuda.atomic.max`` / ``atomic.min``, which are exact in any order, so the result never depends
on scheduling; per-cell parameters (scale, zero point) are one thread per cell using the same
scalar steps as the CPU kernels (``_scalar.py``). Not tuned: no vectorised 16-byte accesses, no
fused single pass (REFERENCE §12's SGLang kernel does both); no GPU was lent to measure one.
"""

from __future__ import annotations

import math

import numpy as np
from numba import config, cuda

from quillcache.kvquant import _scalar
from quillcache.kvquant.fp8 import E4M3_TABLE

_dev = cuda.jit(device=True)
sym_scale = _dev(_scalar.sym_scale)
int8_code = _dev(_scalar.int8_code)
e4m3_code = _dev(_scalar.e4m3_encode_scalar)
asym_scale = _dev(_scalar.asym_scale)
asym_zero = _dev(_scalar.asym_zero)
asym_code = _dev(_scalar.asym_code)
asym_value = _dev(_scalar.asym_value)

THREADS = 32 if config.ENABLE_CUDASIM else 256  # the simulator runs a Python thread per CUDA thread


@cuda.jit(device=True)
def _coords(i, h_n, d_n):
    t = i // (h_n * d_n)
    r = i - t * (h_n * d_n)
    h = r // d_n
    return t, h, r - h * d_n


@cuda.jit
def _amax_k(x, out):
    i = cuda.grid(1)
    t_n, h_n, d_n = x.shape
    if i < t_n * h_n * d_n:
        t, h, d = _coords(i, h_n, d_n)
        ts, hs = out.shape
        cuda.atomic.max(out, (t if ts > 1 else 0, h if hs > 1 else 0), abs(x[t, h, d]))


@cuda.jit
def _sym_scale_k(amax, qmaxf, s):
    i = cuda.grid(1)
    ts, hs = s.shape
    if i < ts * hs:
        a = i // hs
        b = i - a * hs
        s[a, b] = sym_scale(amax[a, b], qmaxf)


@cuda.jit
def _int8_encode_k(x, s, q):
    i = cuda.grid(1)
    t_n, h_n, d_n = x.shape
    if i < t_n * h_n * d_n:
        t, h, d = _coords(i, h_n, d_n)
        ts, hs = s.shape
        q[t, h, d] = int8_code(x[t, h, d], s[t if ts > 1 else 0, h if hs > 1 else 0])


@cuda.jit
def _int8_decode_k(q, s, out):
    i = cuda.grid(1)
    t_n, h_n, d_n = q.shape
    if i < t_n * h_n * d_n:
        t, h, d = _coords(i, h_n, d_n)
        ts, hs = s.shape
        out[t, h, d] = np.float32(q[t, h, d]) * s[t if ts > 1 else 0, h if hs > 1 else 0]


@cuda.jit
def _fp8_encode_k(x, s, c):
    i = cuda.grid(1)
    t_n, h_n, d_n = x.shape
    if i < t_n * h_n * d_n:
        t, h, d = _coords(i, h_n, d_n)
        c[t, h, d] = e4m3_code(x[t, h, d], s[0, h if s.shape[1] > 1 else 0])


@cuda.jit
def _fp8_decode_k(c, s, table, out):
    i = cuda.grid(1)
    t_n, h_n, d_n = c.shape
    if i < t_n * h_n * d_n:
        t, h, d = _coords(i, h_n, d_n)
        out[t, h, d] = table[c[t, h, d]] * s[0, h if s.shape[1] > 1 else 0]


@cuda.jit
def _minmax_k(x, gt, gd, mn, mx):
    i = cuda.grid(1)
    t_n, h_n, d_n = x.shape
    if i < t_n * h_n * d_n:
        t, h, d = _coords(i, h_n, d_n)
        v = x[t, h, d]
        cuda.atomic.min(mn, (t // gt, h, d // gd), v)
        cuda.atomic.max(mx, (t // gt, h, d // gd), v)


@cuda.jit
def _asym_params_k(mn, mx, qmaxf, s, z):
    i = cuda.grid(1)
    g_t, g_h, g_d = s.shape
    if i < g_t * g_h * g_d:
        a, b, c = _coords(i, g_h, g_d)
        sc = asym_scale(mn[a, b, c], mx[a, b, c], qmaxf)
        s[a, b, c] = sc
        z[a, b, c] = asym_zero(mn[a, b, c], sc)


@cuda.jit
def _asym_encode_k(x, s, z, gt, gd, qmax, q):
    i = cuda.grid(1)
    t_n, h_n, d_n = x.shape
    if i < t_n * h_n * d_n:
        t, h, d = _coords(i, h_n, d_n)
        q[t, h, d] = asym_code(x[t, h, d], s[t // gt, h, d // gd], z[t // gt, h, d // gd], qmax)


@cuda.jit
def _asym_decode_k(q, s, z, gt, gd, out):
    i = cuda.grid(1)
    t_n, h_n, d_n = q.shape
    if i < t_n * h_n * d_n:
        t, h, d = _coords(i, h_n, d_n)
        out[t, h, d] = asym_value(np.int32(q[t, h, d]), z[t // gt, h, d // gd], s[t // gt, h, d // gd])


@cuda.jit
def _pack_k(flat, bits, out):
    b = cuda.grid(1)
    if b < out.size:
        per = 8 // bits
        acc = 0
        for k in range(per):
            j = b * per + k
            if j < flat.size:
                acc |= np.int32(flat[j]) << (k * bits)
        out[b] = acc


@cuda.jit
def _unpack_k(packed, bits, out):
    j = cuda.grid(1)
    if j < out.size:
        per = 8 // bits
        out[j] = (np.int32(packed[j // per]) >> ((j % per) * bits)) & ((1 << bits) - 1)


# ----------------------------------------------------------------------------- launching


def _xp(a):
    """cupy for CuPy arrays, else numpy (the simulator's host arrays)."""
    if type(a).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def _launch(kernel, n: int, xp, *args) -> None:
    blocks = max(1, math.ceil(n / THREADS))
    if xp is np:
        kernel[blocks, THREADS](*args)
    else:
        stream = cuda.external_stream(xp.cuda.get_current_stream().ptr)
        kernel[blocks, THREADS, stream](*args)


def _sym_scales(x, xp, ts: int, hs: int, qmax: float):
    amax = xp.zeros((ts, hs), np.float32)
    _launch(_amax_k, x.size, xp, x, amax)
    s = xp.empty((ts, hs), np.float32)
    _launch(_sym_scale_k, ts * hs, xp, amax, np.float32(qmax), s)
    return s


def int8_quantize(x, per_tensor: bool):
    xp = _xp(x)
    t, h, _ = x.shape
    s = _sym_scales(x, xp, 1 if per_tensor else t, 1 if per_tensor else h, 127.0)
    q = xp.empty(x.shape, np.int8)
    _launch(_int8_encode_k, x.size, xp, x, s, q)
    return q, s


def int8_dequantize(q, s):
    xp = _xp(q)
    out = xp.empty(q.shape, np.float32)
    _launch(_int8_decode_k, q.size, xp, q, s, out)
    return out


def fp8_quantize(x, per_head: bool, scale: float | None):
    xp = _xp(x)
    hs = x.shape[1] if per_head else 1
    if scale is None:
        s = _sym_scales(x, xp, 1, hs, 448.0)
    else:
        s = xp.full((1, hs), np.float32(scale), np.float32)
    c = xp.empty(x.shape, np.uint8)
    _launch(_fp8_encode_k, x.size, xp, x, s, c)
    return c, s


def fp8_dequantize(c, s):
    xp = _xp(c)
    out = xp.empty(c.shape, np.float32)
    _launch(_fp8_decode_k, c.size, xp, c, s, xp.array(E4M3_TABLE), out)  # a writable copy
    return out


def asym_quantize(x, bits: int, gt: int, gd: int):
    xp = _xp(x)
    t, h, d = x.shape
    gshape = (t // gt, h, d // gd)
    mn = xp.full(gshape, np.inf, np.float32)
    mx = xp.full(gshape, -np.inf, np.float32)
    _launch(_minmax_k, x.size, xp, x, gt, gd, mn, mx)
    s = xp.empty(gshape, np.float32)
    z = xp.empty(gshape, np.int32)
    qmax = (1 << bits) - 1
    _launch(_asym_params_k, mn.size, xp, mn, mx, np.float32(qmax), s, z)
    q = xp.empty(x.shape, np.uint8)
    _launch(_asym_encode_k, x.size, xp, x, s, z, gt, gd, qmax, q)
    return q, s, z


def asym_dequantize(q, s, z, gt: int, gd: int):
    xp = _xp(q)
    out = xp.empty(q.shape, np.float32)
    _launch(_asym_decode_k, q.size, xp, q, s, z, gt, gd, out)
    return out


def pack_bits(codes, bits: int):
    xp = _xp(codes)
    flat = codes.reshape(-1)
    out = xp.empty(-(-flat.size * bits // 8), np.uint8)
    _launch(_pack_k, out.size, xp, flat, bits, out)
    return out


def unpack_bits(packed, bits: int, count: int):
    xp = _xp(packed)
    out = xp.empty(count, np.uint8)
    _launch(_unpack_k, count, xp, packed, bits, out)
    return out

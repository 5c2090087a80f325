"""Scalar steps shared by the Numba CPU kernels and the ``numba.cuda`` kernels (private).

Plain Python functions, compiled twice: ``njit(inline="always")`` in ``_cpu.py`` and
``cuda.jit(device=True)`` in ``_cuda.py`` (under ``NUMBA_ENABLE_CUDASIM=1`` they run as written). Each
is self-contained (calls no other function of this module), keeps every value float32 through
``np.float32`` casts (a float64 literal would widen a float32 in Numba and change roundings),
and uses Python ``round`` (round half to even, like ``np.rint``) only on bounded values.

The specification is ``reference.py``; the comments there say why each bound holds.
"""

from __future__ import annotations

import numpy as np

INT8_QMAX = 127.0
E4M3_MAX = 448.0
ZERO_POINT_FLOOR = 2.0**-20  # a group's scale is at least its largest magnitude times this


def sym_scale(amax, qmaxf):
    """``amax / qmax`` in float32; 1 where that is 0 (an all-zero group)."""
    s = amax / qmaxf
    if s == 0:
        s = np.float32(1.0)
    return s


def int8_code(v, s):
    """``clip(rint(v / s), -127, 127)``."""
    r = round(v / s)
    if r > 127:
        r = 127
    if r < -127:
        r = -127
    return r


def e4m3_encode_scalar(v, s):
    """The e4m3fn code (0..255) of ``clamp(v / s, ±448)``, round to nearest even."""
    w = v / s
    sign = 0
    if w < 0:
        sign = 128
        w = -w
    if w > np.float32(448.0):
        w = np.float32(448.0)
    if w < np.float32(0.015625):  # subnormal: multiples of 2**-9 (w * 512 is exact)
        return sign | round(w * np.float32(512.0))  # 8 rounds into the first normal code 0x08
    p = np.float32(256.0)
    e = 8
    while w < p:  # w >= 2**-6, so at most 14 halvings
        p = p * np.float32(0.5)
        e -= 1
    r = round((w / p) * np.float32(8.0))  # exact before rounding: w / p is in [1, 2)
    if r == 16:
        r = 8
        e += 1
    return sign | ((e + 7) << 3) | (r - 8)


def asym_scale(mn, mx, qmaxf):
    """The group scale: ``mx/qmax - mn/qmax`` (no overflow), at least ``max|.| * 2**-20`` (raised by
    one subnormal step where that product rounded down), 1 if 0.

    Written so that the CUDA build computes the same bits: no ``max`` of two floats (numba.cuda cannot
    compile the builtin's varargs overload), and no float multiply whose product feeds a float add (ptxas
    may fuse such a pair into one FMA, which rounds once instead of twice): the subnormal step is added to
    the floor's integer count of 2**-149 units, every scaling in between exact (powers of two, in range)."""
    s = mx / qmaxf - mn / qmaxf
    a = abs(mn)
    b = abs(mx)
    amax = a if a > b else b
    floor = amax * np.float32(9.5367431640625e-07)  # 2**-20
    if floor * np.float32(1048576.0) < amax:  # exact product: only a subnormal floor can fail it
        units = int(floor * np.float32(1.2676506002282294e30) * np.float32(562949953421312.0))  # * 2**100 * 2**49
        floor = np.float32(units + 1) * np.float32(7.888609052210118e-31) * np.float32(1.7763568394002505e-15)
    if s < floor:
        s = floor
    if s == 0:
        s = np.float32(1.0)
    return s


def asym_zero(mn, s):
    """The integer zero point ``rint(-mn / s)`` (|.| <= 2**20 by the scale floor)."""
    return round(-mn / s)


def asym_code(v, s, z, qmax):
    """``clip(rint(v / s) + z, 0, qmax)``."""
    r = round(v / s) + z
    if r > qmax:
        r = qmax
    if r < 0:
        r = 0
    return r


def asym_value(q, z, s):
    """``(q - z) * s`` with the difference exact in float32 (no FMA can change it)."""
    return np.float32(q - z) * s

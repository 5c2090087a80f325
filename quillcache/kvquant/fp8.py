"""OCP FP8 E4M3FN ("e4m3fn", NVIDIA's ``__NV_E4M3``) encode / decode in NumPy, bit-exact.

Format: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal
(``m * 2**-9``); there is no infinity; ``S.1111.111`` (0x7F / 0xFF) is NaN, so the largest finite
magnitude is ``S.1111.110`` = 448 (``E4M3_MAX``). 0x80 is -0.0.

``e4m3_encode`` is the saturating round-to-nearest-even cast of CUDA's
``__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`` for finite input: values are clamped to
±448 first (REFERENCE §12: clamp before every fp8 cast), then rounded to the nearest representable
value, ties to the even mantissa. A negative value that rounds to zero encodes as 0x80 (-0.0); -0.0 itself encodes as 0x00.
NaN / inf are refused by the codecs before they get here; ``e4m3_encode`` itself maps NaN to 0x7F.

The Numba kernels use ``_scalar.e4m3_encode_scalar`` (a different algorithm: a power-of-two search
instead of ``frexp``); the tests bind the two together on every float32 near every code boundary.
"""

from __future__ import annotations

import numpy as np

__all__ = ["E4M3_MAX", "E4M3_NAN_CODE", "E4M3_TABLE", "e4m3_decode", "e4m3_encode"]

E4M3_MAX = 448.0
E4M3_NAN_CODE = 0x7F


def _table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    mag = np.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * np.exp2(exp - 7.0))
    out = (sign * mag).astype(np.float32)
    out[(codes & 0x7F) == 0x7F] = np.nan
    out.setflags(write=False)
    return out


E4M3_TABLE: np.ndarray = _table()  # code -> float32 value (NaN at 0x7F / 0xFF)


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """float32 values of uint8 e4m3fn codes."""
    return E4M3_TABLE[np.asarray(codes, dtype=np.uint8)]


def e4m3_encode(v: np.ndarray) -> np.ndarray:
    """uint8 e4m3fn codes of float32 values: clamp to ±448, round to nearest even (saturating)."""
    v = np.asarray(v, dtype=np.float32)
    sign = np.where(np.signbit(v) & (v != 0), np.uint8(0x80), np.uint8(0))  # -0.0 encodes as +0
    a = np.minimum(np.abs(v), np.float32(E4M3_MAX))
    sub = a < np.float32(2.0**-6)
    # subnormal range: multiples of 2**-9 (a * 512 is exact), 8 rounds up into the first normal code 0x08
    m_sub = np.rint(a * np.float32(512.0))
    # normal range: a = f * 2**e with f in [1, 2); 8 * f rounded gives the mantissa 8..16
    f, e = np.frexp(np.where(sub, np.float32(1.0), a))
    e = e.astype(np.int32) - 1
    r = np.rint(np.ldexp(f, 4).astype(np.float32))  # 8 * (2f), the mantissa with its leading 1
    carry = r == 16
    r = np.where(carry, 8, r)
    e = np.where(carry, e + 1, e)
    normal = ((e + 7) << 3) | (r.astype(np.int32) - 8)
    code = np.where(sub, m_sub.astype(np.int32), normal).astype(np.uint8)
    code = code | sign
    code[np.isnan(v)] = E4M3_NAN_CODE
    return code

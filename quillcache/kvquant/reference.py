"""The NumPy reference kernels: the SPECIFICATION every other backend must match bit for bit.

All kernels take and return C-contiguous arrays; ``x`` is float32 ``(tokens, heads, head_dim)``,
finite with ``|x| <= 2**127`` (the codecs refuse NaN / inf and larger magnitudes before any kernel
runs: with that bound no dequantized value can overflow, e.g. ``127 * (amax / 127)`` rounding up
past float32's maximum). Every step is float32 with one IEEE
rounding per operation, written so that no fused multiply-add can change a result:

Symmetric (``int8``, ``fp8_e4m3``), one scale per cell of a ``(Ts, Hs)`` grid (``Ts`` is 1 or
tokens, ``Hs`` is 1 or heads): ``amax = max |x|`` over the cell; ``s = amax / QMAX`` (127 or 448),
``s = 1`` where that is 0.
- int8: ``q = clip(rint(x / s), -127, 127)`` (int8; -128 never occurs); ``x' = float32(q) * s``.
- fp8: ``c = e4m3(clamp(x / s, ±448))`` (saturating, round half to even; ``fp8.py``);
  ``x' = E4M3_TABLE[c] * s``. With a fixed ``scale`` (vLLM's uncalibrated 1.0) ``s`` is given.

Asymmetric (``int4``, ``int2``, KIVI's layout), groups of ``gt`` tokens x ``gd`` channels
(keys: ``gt = G, gd = 1``, one group per channel per G tokens; values: ``gt = 1, gd = G``, one
group per token per G channels); ``qmax = 2**bits - 1``:
- ``s = mx / qmax - mn / qmax`` (never overflows, unlike ``mx - mn``), raised to at least the
  floor ``f = max(|mn|, |mx|) * 2**-20``, and 1 where still 0. Where ``f`` is subnormal its
  product rounds (possibly down), so it is raised by one subnormal step ``2**-149`` whenever
  ``f * 2**20 < max(|mn|, |mx|)`` (the ``* 2**20`` is exact, and the condition never holds for a
  normal ``f``). Hence ``|x / s| <= 2**20`` for every ``x`` of the group: codes and zero points
  stay exact small integers. The floor only bites for a group whose range is below 2**-20 of its
  magnitude, where it costs < 1e-6 relative error (or, for groups within 2**20 subnormal steps
  of zero, at most half a step ``2**-150`` absolute);
- the INTEGER zero point ``z = rint(-mn / s)`` (int32, ``|z| <= 2**20``: ``MAX_ZERO_POINT``);
- ``q = clip(rint(x / s) + z, 0, qmax)``; ``x' = float32(q - z) * s`` (``q - z`` is an exact
  integer: one rounding, the product).

Error: the per-element bounds (int8 within half a step ``s / 2`` of the input, KIVI within one step) hold
for normal float32 inputs only; subnormal inputs get a subnormal scale, rounded coarsely, so codes can clip
and the error reach dozens of steps (every backend alike, and tiny in absolute terms).

Bit packing (``pack_bits``): the codes in C order, ``8 // bits`` per byte, element ``k`` of a byte
in bits ``[k*bits, (k+1)*bits)`` (low bits first); the last byte is zero-padded.
"""

from __future__ import annotations

import numpy as np

from quillcache.kvquant.fp8 import E4M3_MAX, E4M3_TABLE, e4m3_encode

__all__ = ["asym_dequantize", "asym_quantize", "fp8_dequantize", "fp8_quantize", "int8_dequantize", "int8_quantize",
           "pack_bits", "unpack_bits"]

F32 = np.float32
ZERO_POINT_FLOOR = F32(2.0**-20)
ZERO_POINT_FLOOR_INVERSE = F32(2.0**20)
SUBNORMAL_STEP = F32(2.0**-149)  # float32's smallest subnormal
MAX_ZERO_POINT = 2**20  # |z| and |x / s| never exceed it (the scale floor)


def _sym_scale(amax: np.ndarray, qmax: float) -> np.ndarray:
    s = (amax / F32(qmax)).astype(F32)
    s[s == 0] = F32(1.0)
    return s


def _amax(x: np.ndarray, ts: int, hs: int) -> np.ndarray:
    t, h, _ = x.shape
    a = np.abs(x).max(axis=2)  # (T, H)
    if ts == 1:
        a = a.max(axis=0, keepdims=True)
    if hs == 1:
        a = a.max(axis=1, keepdims=True)
    return a.astype(F32)


def int8_quantize(x: np.ndarray, per_tensor: bool) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 (T, H, D), scales float32 (T, H), or (1, 1) per tensor)."""
    t, h, _ = x.shape
    s = _sym_scale(_amax(x, 1 if per_tensor else t, 1 if per_tensor else h), 127.0)
    q = np.clip(np.rint(x / s[:, :, None]), -127, 127).astype(np.int8)
    return q, s


def int8_dequantize(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    return q.astype(F32) * s[:, :, None]


def fp8_quantize(x: np.ndarray, per_head: bool, scale: float | None) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 (T, H, D), scales float32 (1, H) per head or (1, 1) per tensor)."""
    h = x.shape[1] if per_head else 1
    if scale is None:
        s = _sym_scale(_amax(x, 1, h), E4M3_MAX)
    else:
        s = np.full((1, h), scale, dtype=F32)
    with np.errstate(over="ignore"):  # a fixed scale may overflow x / s to ±inf: the clamp saturates it
        w = np.clip(x / s[:, :, None], F32(-E4M3_MAX), F32(E4M3_MAX))
    return e4m3_encode(w), s


def fp8_dequantize(c: np.ndarray, s: np.ndarray) -> np.ndarray:
    return E4M3_TABLE[c] * s[:, :, None]


def _groups(x: np.ndarray, gt: int, gd: int) -> np.ndarray:
    t, h, d = x.shape
    return x.reshape(t // gt, gt, h, d // gd, gd)


def asym_quantize(x: np.ndarray, bits: int, gt: int, gd: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes uint8 (T, H, D), scales float32 and zero points int32, both (T/gt, H, D/gd))."""
    qmax = (1 << bits) - 1
    qf = F32(qmax)
    xg = _groups(x, gt, gd)
    mn = xg.min(axis=(1, 4))
    mx = xg.max(axis=(1, 4))
    s = (mx / qf - mn / qf).astype(F32)
    amax = np.maximum(np.abs(mn), np.abs(mx))
    floor = (amax * ZERO_POINT_FLOOR).astype(F32)
    floor[floor * ZERO_POINT_FLOOR_INVERSE < amax] += SUBNORMAL_STEP  # a subnormal floor rounded down
    s = np.maximum(s, floor)
    s[s == 0] = F32(1.0)
    z = np.rint(-mn / s).astype(np.int32)
    se, ze = s[:, None, :, :, None], z[:, None, :, :, None]
    q = np.clip(np.rint(xg / se).astype(np.int64) + ze, 0, qmax).astype(np.uint8)
    return q.reshape(x.shape), s, z


def asym_dequantize(q: np.ndarray, s: np.ndarray, z: np.ndarray, gt: int, gd: int) -> np.ndarray:
    qg = _groups(q, gt, gd).astype(np.int32)
    out = (qg - z[:, None, :, :, None]).astype(F32) * s[:, None, :, :, None]
    return out.reshape(q.shape)


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes (< 2**bits) -> packed uint8, ``ceil(n * bits / 8)`` bytes."""
    per = 8 // bits
    flat = codes.reshape(-1).astype(np.uint8)
    pad = (-flat.size) % per
    if pad:
        flat = np.concatenate([flat, np.zeros(pad, np.uint8)])
    c = flat.reshape(-1, per)
    out = np.zeros(c.shape[0], np.uint8)
    for k in range(per):
        out |= c[:, k] << np.uint8(k * bits)
    return out


def unpack_bits(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The first ``count`` codes of ``packed`` (1-D uint8)."""
    per = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    out = np.empty((packed.size, per), np.uint8)
    for k in range(per):
        out[:, k] = (packed >> np.uint8(k * bits)) & mask
    return out.reshape(-1)[:count].copy()

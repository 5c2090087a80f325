"""KV-cache codecs by name (``CODECS``) and the quantized tensor they produce (``QuantizedKV``).

A codec quantizes one KV tensor of shape ``(tokens, heads, head_dim)`` (float16 or float32; a
layer's keys or its values) and dequantizes it back to the same dtype and shape:

- ``int8``: symmetric, one scale per token x head (``granularity="token_head"``, the default) or
  one per tensor (``"tensor"``); codes in [-127, 127].
- ``fp8_e4m3``: OCP e4m3fn codes, one scale per head (``"head"``, default) or per tensor
  (``"tensor"``); the scale is ``amax / 448`` of the tensor (calibrated per call) unless a fixed
  ``scale`` is given (vLLM's ``k_scale``/``v_scale``; its default 1.0 is uncalibrated). Values are
  divided by the scale, clamped to ±448 and cast with saturation, round half to even.
- ``int4`` / ``int2``: KIVI's layout, asymmetric with an integer zero point per group, codes
  bit-packed: keys per channel in groups of ``group_size`` (32) tokens, values per token in
  groups of ``group_size`` channels (``axis`` overrides: ``"channel"`` or ``"token"``).

Every codec takes ``window_tokens``: the most recent tokens kept in full precision (KIVI's
residual window; ``0`` = none, must be < tokens). The formulas are ``reference.py``'s.

Input contract (checked before any kernel runs, each error naming the value): a NumPy array (CuPy
array for the ``cuda`` backend) of dtype float16 or float32 (``KVQuantDtypeError``), 3-D with
every extent >= 1, tokens minus window divisible by the group for per-channel groups, head_dim
divisible by the group for per-token groups (``KVQuantShapeError``); every value finite:
NaN / ±inf are refused with ``NonFiniteError`` naming the first (token, head, channel), never
saturated; a magnitude above ``MAX_ABS = 2**127`` with ``OutOfRangeError`` (its dequantized value
could overflow). float16 input is always in range, and its dequantized values are clipped to
float16's largest finite value (a group's rounded zero point, or fp8's saturated code times a
fixed scale, can overshoot a value near ±65504 by part of a step; the clip only moves a value
toward the original). Inputs are never modified.

``dequantize`` and ``encode_block`` check a ``QuantizedKV`` they are given (a public type, which may be
built by hand; ``QuantizedKV.check_layout``) before any kernel reads it: its fields must be ones an encoder
writes (codec, kind, dtype, granularity, group size, shape, ``scale_option``) and its arrays the layout those
fields imply (``expected_layout``: array dtypes and sizes) holding contents an encoder writes
(``content_problem``, the same function ``decode_block`` applies to a block's sections: scales positive and
finite, zero points within ``MAX_ZERO_POINT``, no int8 code -128, no fp8 NaN code, zero padding bits, a
finite window, no code decoding beyond ``MAGNITUDE_LIMIT``); otherwise ``KVQuantError`` names the field or
array. So what ``check_layout`` accepts encodes to a block ``decode_block`` accepts, and dequantizes to finite
values alike on every backend. The ``window`` of a ``quantize`` result is a copy: changing the
input afterwards changes nothing quantized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Union

import numpy as np

from quillcache._checks import check_choice, check_float, check_int
from quillcache.kvquant.errors import (KVQuantDtypeError, KVQuantError, KVQuantShapeError, NonFiniteError,
                                       OutOfRangeError)
from quillcache.kvquant.fp8 import E4M3_NAN_CODE, E4M3_TABLE
from quillcache.kvquant.kernels import KernelBackend, backend
from quillcache.kvquant.reference import MAX_ZERO_POINT
from quillcache.registry import Registry

__all__ = ["CODECS", "DTYPES", "GRANULARITIES", "MAGNITUDE_LIMIT", "MAX_ABS", "Fp8E4M3Codec", "Int8Codec", "KINDS",
           "KiviCodec", "QuantizedKV", "Codec", "content_problem", "expected_layout", "make_codec",
           "scale_option_problem"]

KINDS = ("key", "value")
DTYPES = ("float16", "float32")
MAX_GROUP = 65535
MAX_ABS = 2.0**127  # the largest magnitude quantized (see reference.py)
FLOAT16_MAX = 65504.0
CODEC_BITS = {"int8": 8, "fp8_e4m3": 8, "int4": 4, "int2": 2}  # bits per code
# the granularities each codec writes (KIVI's: the grouping axis)
GRANULARITIES = {"int8": ("token_head", "tensor"), "fp8_e4m3": ("head", "tensor"), "int4": ("channel", "token"),
                 "int2": ("channel", "token")}
MAX_EXTENT = 2**32 - 1  # a block's u32 header fields: tokens, heads, head_dim
_F32_MAX = float(np.finfo(np.float32).max)
# the largest magnitude a code may decode to: float32's largest finite value, and twice float16's (what an
# encoder's zero point rounding can reach for float16 input; dequantize clips it)
MAGNITUDE_LIMIT = {"float32": _F32_MAX, "float16": 2 * FLOAT16_MAX}


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def expected_layout(codec: str, granularity: str, group_size: int, tokens_quantized: int, heads: int,
                    head_dim: int) -> tuple[tuple[int, ...], int, int]:
    """(scale grid shape, zero-point count, payload bytes) of a tensor with these header fields."""
    n = tokens_quantized * heads * head_dim
    if codec == "int8":
        grid = (tokens_quantized, heads) if granularity == "token_head" else (1, 1)
        return grid, 0, n
    if codec == "fp8_e4m3":
        return ((1, heads) if granularity == "head" else (1, 1)), 0, n
    if granularity == "channel":
        grid = (tokens_quantized // group_size, heads, head_dim)
    else:
        grid = (tokens_quantized, heads, head_dim // group_size)
    return grid, math.prod(grid), -(-n * CODEC_BITS[codec] // 8)


def scale_option_problem(codec: str, scale_option: object) -> str | None:
    """Why ``scale_option`` is not one an encoder writes, or None: NaN, or for ``fp8_e4m3`` also a fixed
    scale that is a positive finite float32 (what a block's f32 header field holds)."""
    if isinstance(scale_option, bool) or not isinstance(scale_option, (float, int, np.floating, np.integer)):
        return f"{scale_option!r} is not a float"
    if math.isnan(scale_option):
        return None
    if codec != "fp8_e4m3":
        return f"{scale_option} for {codec} (only fp8's fixed scale sets it; expects NaN)"
    with np.errstate(over="ignore"):
        f32 = np.float32(scale_option)  # the codec's own test (Fp8E4M3Codec): what the block's f32 field holds
    if not (scale_option > 0 and np.isfinite(f32) and f32 > 0):
        return f"{scale_option} is neither NaN nor a positive finite float32 scale"
    return None


def content_problem(codec: str, dtype: str, scale_option: float, scales, zeros, payload, window,
                    num_codes: int) -> tuple[str, str] | None:
    """The first ``(field, reason)`` of a quantized tensor's contents that no encoder writes, or None.

    The one definition of valid contents, shared by ``QuantizedKV.check_layout`` (so ``dequantize`` and
    ``encode_block``) and ``decode_block``: scales positive and finite (fp8's all equal to its fixed scale
    when it has one), zero points within ``MAX_ZERO_POINT``, no int8 code -128, no fp8 NaN code, zero padding
    bits after the last int4/int2 code, a finite window, and no code decoding to a magnitude beyond
    ``MAGNITUDE_LIMIT[dtype]``. What passes dequantizes to finite values of ``dtype`` on every backend.
    The arrays (NumPy or CuPy) must already have the dtypes and sizes ``expected_layout`` gives for
    ``num_codes`` codes, and ``scale_option`` have passed ``scale_option_problem``. The checks are whole-array
    reductions (no temporaries over the codes; vectorised, so cheap enough for every encode), plus a float64
    pass over the int4/int2 scale grid only when the bound from the extreme scale and zero points is beyond
    the limit.
    """
    smin, smax = float(scales.min()), float(scales.max())
    if not (smin > 0 and smax <= _F32_MAX):  # NaN fails both comparisons
        return "scales", "a scale is not a positive finite number"
    if codec == "fp8_e4m3" and not math.isnan(scale_option) and not smin == smax == float(np.float32(scale_option)):
        return "scales", f"a scale differs from the block's fixed fp8 scale_option {scale_option}"
    lo = hi = 0
    if zeros.size:  # int32 min/max: no widening copy, and |z| <= 2**20 cannot overflow the comparison
        lo, hi = int(zeros.min()), int(zeros.max())
        if lo < -MAX_ZERO_POINT or hi > MAX_ZERO_POINT:
            return "zeros", (f"a zero point of magnitude {max(-lo, hi)} exceeds MAX_ZERO_POINT={MAX_ZERO_POINT} "
                             f"(no encoder writes one)")
    if codec == "int8":
        if int(payload.view(np.int8).min()) == -128:
            return "payload", "int8 code -128 never occurs in an encoded block"
        peak = 127.0 * smax
    elif codec == "fp8_e4m3":
        # the largest code & 0x7F present, in two reductions without a temporary: the int8 view's maximum is
        # the largest code below 0x80 (negative if there is none), uint8's minus 0x80 the largest above
        top = max(int(payload.view(np.int8).max()), int(payload.max()) - 0x80)
        if top == E4M3_NAN_CODE:
            return "payload", "an fp8 NaN code (0x7F/0xFF) never occurs in an encoded block"
        peak = float(E4M3_TABLE[top]) * smax
    else:
        bits = CODEC_BITS[codec]
        used = num_codes * bits
        if used % 8 and int(payload[-1]) >> (used % 8):
            return "payload", "padding bits of the last byte are not zero"
        # a group's codes decode to at most max(|z|, |qmax - z|) * s = (|z - qmax/2| + qmax/2) * s (exact in
        # float64); the largest step over the extreme zero points bounds them all, and only a tensor beyond
        # the limit by that coarse bound pays for the exact pass over the scale grid
        half = ((1 << bits) - 1) / 2
        peak = (max(abs(lo - half), abs(hi - half)) + half) * smax
        if not peak <= MAGNITUDE_LIMIT[dtype]:
            m = zeros.astype(np.float64)
            m -= half
            m = abs(m)
            m += half
            m *= scales
            peak = float(m.max())
    if window.size and not bool(_xp(window).isfinite(window).all()):
        return "window", "a full-precision window value is not finite"
    limit = MAGNITUDE_LIMIT[dtype]
    if not peak <= limit:
        return "scales", (f"a code would decode to magnitude {peak:.6g}, beyond {limit:.6g} for {dtype} (no "
                          f"encoder writes such a scale)")
    return None


@dataclass(frozen=True, kw_only=True, eq=False)
class QuantizedKV:
    """One quantized tensor: everything needed to dequantize it (and what a block serializes).

    ``payload`` is the codes as uint8 (int8 codes viewed as uint8; int4/int2 packed), ``scales``
    float32 and ``zeros`` int32 (empty for symmetric codecs) in the codec's group grid,
    ``window`` the last ``window_tokens`` tokens in the original dtype (``quantize``'s own copy, never a
    view of its input).
    """

    codec: str
    kind: str
    granularity: str
    dtype: str
    shape: tuple[int, int, int]
    group_size: int
    window_tokens: int
    scales: np.ndarray
    zeros: np.ndarray
    payload: np.ndarray
    window: np.ndarray
    scale_option: float = math.nan  # fp8's fixed scale; NaN = calibrated per call

    @property
    def num_elements(self) -> int:
        return self.shape[0] * self.shape[1] * self.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (the block adds a fixed header and a crc32c)."""
        return int(self.payload.nbytes + self.scales.nbytes + self.zeros.nbytes + self.window.nbytes)

    def check_layout(self) -> None:
        """``KVQuantError`` naming the first field that no encoder writes: a codec, kind, dtype or granularity
        not among the codec's (``CODEC_BITS``, ``KINDS``, ``DTYPES``, ``GRANULARITIES``), a group size or shape
        a block could not hold, a ``scale_option`` other than NaN or fp8's positive finite fixed scale, an
        array whose dtype or size is not what the fields imply, or contents no encoder writes
        (``content_problem``, the checks ``decode_block`` applies: e.g. a zero point beyond ``MAX_ZERO_POINT``
        in magnitude, where ``q - z`` would no longer be exact and the backends could disagree). What passes
        dequantizes to finite values alike on every backend and encodes to a block ``decode_block`` accepts."""
        if not isinstance(self.codec, str) or self.codec not in CODEC_BITS:
            raise KVQuantError(f"codec={self.codec!r} must be one of {list(CODEC_BITS)}")
        for name, value, allowed in (("kind", self.kind, KINDS), ("dtype", self.dtype, DTYPES),
                                     ("granularity", self.granularity, GRANULARITIES[self.codec])):
            if not isinstance(value, str) or value not in allowed:
                raise KVQuantError(f"{name}={value!r} must be one of {list(allowed)} (for codec {self.codec})")
        shape_ok = (isinstance(self.shape, (tuple, list)) and len(self.shape) == 3
                    and all(_is_int(n) and 1 <= n <= MAX_EXTENT for n in self.shape))
        if not shape_ok or not _is_int(self.window_tokens) or not 0 <= self.window_tokens < self.shape[0]:
            raise KVQuantError(f"shape={self.shape} window_tokens={self.window_tokens}: need (tokens, heads, "
                               f"head_dim) integers in [1, {MAX_EXTENT}] and 0 <= window_tokens < tokens")
        t, h, d = self.shape
        if self.codec in ("int4", "int2"):
            extent = t - self.window_tokens if self.granularity == "channel" else d
            if not _is_int(self.group_size) or not 1 <= self.group_size <= MAX_GROUP or extent % self.group_size:
                raise KVQuantError(f"group_size={self.group_size} does not divide {extent} ({self.granularity} "
                                   f"groups) or is not in [1, {MAX_GROUP}]")
        elif self.group_size != 0:
            raise KVQuantError(f"group_size={self.group_size} for {self.codec} (it has no groups: expects 0)")
        grid, n_zeros, payload_bytes = expected_layout(self.codec, self.granularity, self.group_size,
                                                       t - self.window_tokens, h, d)
        for name, arr, dtype, shape in (("scales", self.scales, "float32", grid),
                                        ("zeros", self.zeros, "int32", grid if n_zeros else (0,)),
                                        ("payload", self.payload, "uint8", (payload_bytes,)),
                                        ("window", self.window, self.dtype, (self.window_tokens, h, d))):
            if not hasattr(arr, "dtype") or not hasattr(arr, "shape"):
                raise KVQuantError(f"{name} is a {type(arr).__name__}, not a NumPy (or CuPy) array")
            if str(arr.dtype) != dtype or tuple(arr.shape) != shape:
                raise KVQuantError(f"{name} is {arr.dtype} {tuple(arr.shape)}; a {self.codec} tensor of shape "
                                   f"{self.shape} ({self.granularity}) needs {dtype} {shape}")
        why = scale_option_problem(self.codec, self.scale_option)
        if why is not None:
            raise KVQuantError(f"scale_option: {why}")
        problem = content_problem(self.codec, self.dtype, self.scale_option, self.scales, self.zeros, self.payload,
                                  self.window, (t - self.window_tokens) * h * d)
        if problem is not None:
            raise KVQuantError(f"{problem[0]}: {problem[1]}")

    def codec_object(self) -> "Codec":
        return make_codec(self.codec, **_options_of(self))

    def dequantize(self, backend_name: str = "numba") -> np.ndarray:
        self.check_layout()  # before the codec is built from the fields: an error names the field
        return self.codec_object()._dequantize_checked(self, backend_name)  # checked once, not twice


def _xp(a):
    return np if isinstance(a, np.ndarray) else __import__(type(a).__module__.split(".")[0])


def _check_tensor(x, codec: "Codec", kind: str) -> None:
    check_choice("kind", kind, KINDS, error=KVQuantError)
    if not (isinstance(x, np.ndarray) or hasattr(x, "__cuda_array_interface__")):
        raise KVQuantDtypeError(f"x must be a NumPy (or CuPy) array, got {type(x).__name__}")
    if str(x.dtype) not in DTYPES:
        raise KVQuantDtypeError(f"x.dtype={x.dtype} is not supported; KV tensors must be one of {list(DTYPES)}")
    if x.ndim != 3 or min(x.shape) < 1:
        raise KVQuantShapeError(f"x.shape={tuple(x.shape)} must be (tokens, heads, head_dim), each >= 1")
    t, _, d = x.shape
    w = codec.window_tokens
    if w >= t:
        raise KVQuantShapeError(f"window_tokens={w} must be < tokens={t}")
    gt, gd = codec.group_extents(kind)
    if (t - w) % gt:
        raise KVQuantShapeError(f"{codec.name}: tokens - window_tokens = {t} - {w} = {t - w} is not divisible by "
                                f"group_size={gt} (per-channel groups of {gt} tokens)")
    if d % gd:
        raise KVQuantShapeError(f"{codec.name}: head_dim={d} is not divisible by group_size={gd} "
                                f"(per-token groups of {gd} channels)")
    xp = _xp(x)
    amax = float(xp.abs(x).max())  # NaN and inf propagate: one pass checks both rules
    if not math.isfinite(amax):
        idx = _first(xp, ~xp.isfinite(x))
        raise NonFiniteError(f"x{list(idx)}={float(x[idx])} is not finite; NaN and inf are refused (a KV cache "
                             f"holding them is already corrupt)")
    if amax > MAX_ABS:
        idx = _first(xp, xp.abs(x) > MAX_ABS)
        raise OutOfRangeError(f"|x{list(idx)}|={float(x[idx])!r} exceeds MAX_ABS=2**127; it could not be "
                              f"dequantized without overflow")


def _first(xp, mask) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(int(xp.argmax(mask.reshape(-1))), mask.shape))


@dataclass(frozen=True, kw_only=True)
class Codec:
    """What every codec has: a name, a window of full-precision recent tokens."""

    name: ClassVar[str] = ""
    window_tokens: int = 0

    def __post_init__(self) -> None:
        check_int("window_tokens", self.window_tokens, 0, 2**31 - 1, error=KVQuantError, type_error=KVQuantError)

    def group_extents(self, kind: str) -> tuple[int, int]:
        """(tokens, channels) per scale group for the shape checks (1, 1: no divisibility rule)."""
        return 1, 1

    # --- the codec-specific part
    def _encode(self, k: KernelBackend, x, kind: str) -> dict:
        raise NotImplementedError

    def _decode(self, k: KernelBackend, q: QuantizedKV):
        raise NotImplementedError

    # --- shared
    def quantize(self, x, *, kind: str = "key", backend: str = "numba") -> QuantizedKV:
        """Quantize ``x`` (tokens, heads, head_dim); ``kind`` picks KIVI's grouping (key / value)."""
        _check_tensor(x, self, kind)
        k = _backend(backend)
        xp = _xp(x)
        t_q = x.shape[0] - self.window_tokens
        xq = xp.ascontiguousarray(x[:t_q], dtype=np.float32)
        parts = self._encode(k, xq, kind)
        return QuantizedKV(codec=self.name, kind=kind, dtype=str(x.dtype), shape=tuple(int(n) for n in x.shape),
                           window_tokens=self.window_tokens, window=xp.array(x[t_q:], copy=True, order="C"), **parts)

    def dequantize(self, q: QuantizedKV, *, backend: str = "numba"):
        """The tensor back, in its original dtype and shape (window tokens exact)."""
        if q.codec != self.name:
            raise KVQuantError(f"a {q.codec!r} tensor cannot be dequantized by codec {self.name!r}")
        q.check_layout()
        return self._dequantize_checked(q, backend)

    def _dequantize_checked(self, q: QuantizedKV, backend: str):
        """``dequantize`` of a ``q`` of this codec that passed ``check_layout``."""
        k = _backend(backend)
        xp = _xp(q.payload)
        out = xp.empty(q.shape, dtype=q.dtype)
        t_q = q.shape[0] - q.window_tokens
        y = self._decode(k, q)
        if q.dtype == "float16":  # an overshoot past ±65504 would cast to ±inf (module docstring)
            # clipped and cast in one pass, straight into the result (no float32 temporary)
            xp.clip(y, np.float32(-FLOAT16_MAX), np.float32(FLOAT16_MAX), out=out[:t_q])
        else:
            out[:t_q] = y
        out[t_q:] = q.window
        return out

    def bytes_per_element(self, shape: tuple[int, int, int], kind: str = "key") -> float:
        """Array bytes per element of a ``shape`` tensor (scales, zero points and window included)."""
        x = np.zeros(shape, np.float16)
        return self.quantize(x, kind=kind, backend="reference").nbytes / x.size


def _backend(name: str) -> KernelBackend:
    try:
        return backend(name)
    except (KeyError, ValueError) as e:
        raise KVQuantError(str(e)) from None


def _f32_shape(q: QuantizedKV) -> tuple[int, int, int]:
    return (q.shape[0] - q.window_tokens, q.shape[1], q.shape[2])


@dataclass(frozen=True, kw_only=True)
class Int8Codec(Codec):
    name: ClassVar[str] = "int8"
    granularity: str = "token_head"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("granularity", self.granularity, ("token_head", "tensor"), error=KVQuantError)

    def _encode(self, k, x, kind):
        q, s = k.int8_quantize(x, self.granularity == "tensor")
        return dict(granularity=self.granularity, group_size=0, scales=s, zeros=_xp(q).empty((0,), np.int32),
                    payload=q.reshape(-1).view(np.uint8))

    def _decode(self, k, q):
        return k.int8_dequantize(q.payload.view(np.int8).reshape(_f32_shape(q)), q.scales)


@dataclass(frozen=True, kw_only=True)
class Fp8E4M3Codec(Codec):
    name: ClassVar[str] = "fp8_e4m3"
    granularity: str = "head"
    scale: Union[float, None] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("granularity", self.granularity, ("head", "tensor"), error=KVQuantError)
        if self.scale is not None:
            check_float("scale", self.scale, 0.0, lo_open=True, error=KVQuantError, type_error=KVQuantError)
            if not np.isfinite(np.float32(self.scale)) or np.float32(self.scale) == 0:
                raise KVQuantError(f"scale={self.scale} is not a positive finite float32")

    def _encode(self, k, x, kind):
        c, s = k.fp8_quantize(x, self.granularity == "head", self.scale)
        return dict(granularity=self.granularity, group_size=0, scales=s, zeros=_xp(c).empty((0,), np.int32),
                    payload=c.reshape(-1), scale_option=math.nan if self.scale is None else float(self.scale))

    def _decode(self, k, q):
        return k.fp8_dequantize(q.payload.reshape(_f32_shape(q)), q.scales)


@dataclass(frozen=True, kw_only=True)
class KiviCodec(Codec):
    """``int4`` / ``int2``: asymmetric groups with integer zero points, bit-packed (KIVI's layout)."""

    bits: int = 4
    group_size: int = 32
    axis: Union[str, None] = None  # None: keys per channel, values per token (KIVI)

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"int{self.bits}"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bits not in (2, 4):
            raise KVQuantError(f"bits={self.bits!r} must be 2 or 4")
        check_int("group_size", self.group_size, 1, MAX_GROUP, error=KVQuantError, type_error=KVQuantError)
        if self.axis is not None:
            check_choice("axis", self.axis, ("channel", "token"), error=KVQuantError)

    def grouping(self, kind: str) -> str:
        return self.axis or ("channel" if kind == "key" else "token")

    def group_extents(self, kind: str) -> tuple[int, int]:
        return (self.group_size, 1) if self.grouping(kind) == "channel" else (1, self.group_size)

    def _encode(self, k, x, kind):
        gt, gd = self.group_extents(kind)
        q, s, z = k.asym_quantize(x, self.bits, gt, gd)
        return dict(granularity=self.grouping(kind), group_size=self.group_size, scales=s, zeros=z,
                    payload=k.pack_bits(q, self.bits))

    def _decode(self, k, q):
        gt, gd = (q.group_size, 1) if q.granularity == "channel" else (1, q.group_size)
        shape = _f32_shape(q)
        codes = k.unpack_bits(q.payload, self.bits, shape[0] * shape[1] * shape[2]).reshape(shape)
        return k.asym_dequantize(codes, q.scales, q.zeros, gt, gd)


def _int8(*, granularity: str = "token_head", window_tokens: int = 0) -> Int8Codec:
    return Int8Codec(granularity=granularity, window_tokens=window_tokens)


def _fp8(*, granularity: str = "head", scale: float | None = None, window_tokens: int = 0) -> Fp8E4M3Codec:
    return Fp8E4M3Codec(granularity=granularity, scale=scale, window_tokens=window_tokens)


def _int4(*, group_size: int = 32, axis: str | None = None, window_tokens: int = 0) -> KiviCodec:
    return KiviCodec(bits=4, group_size=group_size, axis=axis, window_tokens=window_tokens)


def _int2(*, group_size: int = 32, axis: str | None = None, window_tokens: int = 0) -> KiviCodec:
    return KiviCodec(bits=2, group_size=group_size, axis=axis, window_tokens=window_tokens)


CODECS: Registry = Registry("kv codec")
CODECS.register("int8", _int8)
CODECS.register("fp8_e4m3", _fp8)
CODECS.register("int4", _int4)
CODECS.register("int2", _int2)


def make_codec(name: str, **options) -> Codec:
    """``CODECS.create(name, **options)``; an unknown name or option raises, naming it."""
    try:
        return CODECS.create(name, **options)  # type: ignore[return-value]
    except TypeError as e:
        raise KVQuantError(str(e)) from None


def _options_of(q: QuantizedKV) -> dict:
    if q.codec == "int8":
        return dict(granularity=q.granularity, window_tokens=q.window_tokens)
    if q.codec == "fp8_e4m3":
        return dict(granularity=q.granularity, window_tokens=q.window_tokens,
                    scale=None if math.isnan(q.scale_option) else q.scale_option)
    return dict(group_size=q.group_size, window_tokens=q.window_tokens, axis=q.granularity)

"""The self-describing block format of a quantized KV tensor (DRAM, SSD or the wire).

A block decodes with no outside context. Layout (all integers little-endian)::

    header (68 bytes, struct "<4sHHBBBBBBHIIIIQQQQf"):
      magic "QKVB" | version u16 (1) | header_bytes u16 (68)
      codec u8 (1 int8, 2 fp8_e4m3, 3 int4, 4 int2) | kind u8 (0 key, 1 value)
      layout u8 (0: (tokens, heads, head_dim), C order) | dtype u8 (0 float16, 1 float32)
      granularity u8 (0 token_head, 1 tensor, 2 head, 3 channel, 4 token) | bits u8
      group_size u16 (0 for int8 / fp8)
      tokens u32 | heads u32 | head_dim u32 | window_tokens u32
      scales_bytes u64 | zeros_bytes u64 | payload_bytes u64 | window_bytes u64
      scale_option f32 (fp8's fixed scale; NaN when calibrated)
    scales (float32) | zeros (int32) | payload (uint8 codes) | window (dtype)
    crc32c u32 of every byte before it

Decoding checks, in order, and raises ``KVBlockError`` naming the field: length, magic, version,
header size, total length against the declared sections, crc32c (any flipped bit fails here), then
the header's meaning (known codec / kind / layout / dtype / granularity, bits of the codec, shape
>= 1, window < tokens, group size dividing, ``scale_option`` NaN except for fp8's fixed scale,
every section's size equal to what the shape implies) and the sections' contents (scales
positive and finite, fp8's all equal to its fixed scale when it has one, zero points within the
bound ``|z| <= 2**20`` (``reference.MAX_ZERO_POINT``), no int8 code -128, no fp8 NaN code, zero
padding bits, a finite window, and no code decoding to a magnitude beyond ``MAGNITUDE_LIMIT`` of
the block's dtype: float32's largest finite value, and twice float16's (what an encoder's zero
point rounding can reach for float16 input, clipped on dequantization). A block that passes
decodes to exactly the tensor that was encoded, or, if resealed by hand, at least to finite values
of its dtype; every other block is refused.
"""

from __future__ import annotations

import math
import struct

import crc32c
import numpy as np

from quillcache.kvquant.codecs import (CODEC_BITS, DTYPES, FLOAT16_MAX, GRANULARITIES, KINDS, QuantizedKV,
                                      expected_layout)
from quillcache.kvquant.errors import KVBlockError
from quillcache.kvquant.fp8 import E4M3_NAN_CODE, E4M3_TABLE
from quillcache.kvquant.reference import MAX_ZERO_POINT

__all__ = ["BLOCK_MAGIC", "BLOCK_VERSION", "HEADER_BYTES", "decode_block", "encode_block"]

BLOCK_MAGIC = b"QKVB"
BLOCK_VERSION = 1
_HEADER = struct.Struct("<4sHHBBBBBBHIIIIQQQQf")
HEADER_BYTES = _HEADER.size
_CRC_BYTES = 4
CODEC_IDS = {"int8": 1, "fp8_e4m3": 2, "int4": 3, "int2": 4}
GRANULARITY_IDS = {"token_head": 0, "tensor": 1, "head": 2, "channel": 3, "token": 4}
MAGNITUDE_LIMIT = {"float32": float(np.finfo(np.float32).max), "float16": 2 * FLOAT16_MAX}


def _host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()


def encode_block(q: QuantizedKV) -> bytes:
    """The block of ``q`` (device arrays are copied to the host first); ``q.check_layout()`` first, so a
    hand-built ``QuantizedKV`` with a field no encoder writes raises ``KVQuantError`` naming it."""
    q.check_layout()
    scales, zeros = _host(q.scales).astype("<f4"), _host(q.zeros).astype("<i4")
    payload, window = _host(q.payload).astype(np.uint8), _host(q.window)
    window = window.astype(window.dtype.newbyteorder("<"))
    t, h, d = q.shape
    header = _HEADER.pack(BLOCK_MAGIC, BLOCK_VERSION, HEADER_BYTES, CODEC_IDS[q.codec], KINDS.index(q.kind), 0,
                          DTYPES.index(q.dtype), GRANULARITY_IDS[q.granularity], CODEC_BITS[q.codec], q.group_size,
                          t, h, d, q.window_tokens, scales.nbytes, zeros.nbytes, payload.nbytes, window.nbytes,
                          q.scale_option)
    body = b"".join((header, scales.tobytes(), zeros.tobytes(), payload.tobytes(), window.tobytes()))
    return body + struct.pack("<I", crc32c.crc32c(body))


def _peak_magnitude(codec: str, scales: np.ndarray, zeros: np.ndarray, payload: np.ndarray) -> float:
    """An upper bound (float64, exact products) on the magnitude any of the block's codes decodes to."""
    s = scales.astype(np.float64)
    if codec == "int8":
        return 127.0 * float(s.max())
    if codec == "fp8_e4m3":
        return float(E4M3_TABLE[int((payload & 0x7F).max())]) * float(s.max())
    qmax = (1 << CODEC_BITS[codec]) - 1
    z = zeros.astype(np.int64)
    return float((np.maximum(np.abs(z), np.abs(qmax - z)) * s).max())


def decode_block(buf: bytes | bytearray | memoryview) -> QuantizedKV:
    """The ``QuantizedKV`` a block holds; ``KVBlockError`` (naming the field) for anything malformed."""
    mv = memoryview(buf).cast("B")
    if len(mv) < HEADER_BYTES + _CRC_BYTES:
        raise KVBlockError("length", f"{len(mv)} bytes is shorter than a header and a crc ({HEADER_BYTES + 4})")
    (magic, version, header_bytes, codec_id, kind_id, layout, dtype_id, gran_id, bits, group, t, h, d, w, n_scales,
     n_zeros, n_payload, n_window, scale_option) = _HEADER.unpack_from(mv, 0)
    if magic != BLOCK_MAGIC:
        raise KVBlockError("magic", f"{bytes(magic)!r} is not {BLOCK_MAGIC!r}: not a quantized KV block")
    if version != BLOCK_VERSION:
        raise KVBlockError("version", f"version {version} is not supported (this build reads {BLOCK_VERSION})")
    if header_bytes != HEADER_BYTES:
        raise KVBlockError("header_bytes", f"{header_bytes} != {HEADER_BYTES}")
    total = HEADER_BYTES + n_scales + n_zeros + n_payload + n_window + _CRC_BYTES
    if total != len(mv):
        raise KVBlockError("length", f"the header declares {total} bytes, the block has {len(mv)}")
    body_end = len(mv) - _CRC_BYTES
    stored = struct.unpack_from("<I", mv, body_end)[0]
    actual = crc32c.crc32c(mv[:body_end])
    if stored != actual:
        raise KVBlockError("crc32c", f"stored {stored:#010x} != computed {actual:#010x}: the block is corrupted")
    # --- the header's meaning
    codec = {v: k for k, v in CODEC_IDS.items()}.get(codec_id)
    if codec is None:
        raise KVBlockError("codec", f"unknown codec id {codec_id}; known: {CODEC_IDS}")
    if kind_id >= len(KINDS):
        raise KVBlockError("kind", f"unknown kind id {kind_id}")
    if layout != 0:
        raise KVBlockError("layout", f"unknown layout id {layout}")
    if dtype_id >= len(DTYPES):
        raise KVBlockError("dtype", f"unknown dtype id {dtype_id}")
    gran = {v: k for k, v in GRANULARITY_IDS.items()}.get(gran_id)
    if gran not in GRANULARITIES[codec]:
        raise KVBlockError("granularity", f"granularity id {gran_id} is not one of {codec}'s {GRANULARITIES[codec]}")
    if bits != CODEC_BITS[codec]:
        raise KVBlockError("bits", f"{bits} bits for codec {codec} (expects {CODEC_BITS[codec]})")
    if min(t, h, d) < 1 or w >= t:
        raise KVBlockError("shape", f"tokens={t} heads={h} head_dim={d} window_tokens={w}")
    t_q = t - w
    if codec in ("int4", "int2"):
        extent = t_q if gran == "channel" else d
        if group < 1 or extent % group:
            raise KVBlockError("group_size", f"group_size={group} does not divide {extent} ({gran} groups)")
    elif group != 0:
        raise KVBlockError("group_size", f"group_size={group} for {codec} (expects 0)")
    if codec == "fp8_e4m3" and not (math.isnan(scale_option) or (math.isfinite(scale_option) and scale_option > 0)):
        raise KVBlockError("scale_option", f"{scale_option} is neither NaN nor a positive finite scale")
    if codec != "fp8_e4m3" and not math.isnan(scale_option):
        raise KVBlockError("scale_option", f"{scale_option} for {codec} (only fp8's fixed scale sets it; expects NaN)")
    dtype = np.dtype(DTYPES[dtype_id]).newbyteorder("<")
    grid, n_z, payload_bytes = expected_layout(codec, gran, group, t_q, h, d)
    for name, got, want in (("scales_bytes", n_scales, 4 * math.prod(grid)), ("zeros_bytes", n_zeros, 4 * n_z),
                            ("payload_bytes", n_payload, payload_bytes),
                            ("window_bytes", n_window, w * h * d * dtype.itemsize)):
        if got != want:
            raise KVBlockError(name, f"{got} != {want} implied by the header ({codec}, {gran}, shape {(t, h, d)})")
    # --- the sections' contents
    off = HEADER_BYTES
    scales = np.frombuffer(mv, "<f4", math.prod(grid), off).astype(np.float32).reshape(grid)
    off += n_scales
    zeros = np.frombuffer(mv, "<i4", n_z, off).astype(np.int32).reshape(grid if n_z else (0,))
    off += n_zeros
    payload = np.frombuffer(mv, np.uint8, n_payload, off).copy()
    off += n_payload
    window = np.frombuffer(mv, dtype, w * h * d, off).astype(DTYPES[dtype_id]).reshape(w, h, d)
    if not (np.isfinite(scales).all() and (scales > 0).all()):
        raise KVBlockError("scales", "a scale is not a positive finite number")
    if codec == "fp8_e4m3" and not math.isnan(scale_option) and (scales != np.float32(scale_option)).any():
        raise KVBlockError("scales", f"a scale differs from the block's fixed fp8 scale_option {scale_option}")
    if n_z and np.abs(zeros.astype(np.int64)).max() > MAX_ZERO_POINT:
        raise KVBlockError("zeros", f"a zero point exceeds {MAX_ZERO_POINT} in magnitude")
    if codec == "int8" and (payload == 0x80).any():
        raise KVBlockError("payload", "int8 code -128 never occurs in an encoded block")
    if codec == "fp8_e4m3" and ((payload & 0x7F) == E4M3_NAN_CODE).any():
        raise KVBlockError("payload", "an fp8 NaN code (0x7F/0xFF) never occurs in an encoded block")
    if codec in ("int4", "int2"):
        used = t_q * h * d * bits
        if used % 8 and payload[-1] >> (used % 8):
            raise KVBlockError("payload", "padding bits of the last byte are not zero")
    if not np.isfinite(window).all():
        raise KVBlockError("window", "a full-precision window value is not finite")
    peak, limit = _peak_magnitude(codec, scales, zeros, payload), MAGNITUDE_LIMIT[DTYPES[dtype_id]]
    if not peak <= limit:
        raise KVBlockError("scales", f"a code would decode to magnitude {peak:.6g}, beyond {limit:.6g} for "
                                     f"{DTYPES[dtype_id]} (no encoder writes such a scale)")
    return QuantizedKV(codec=codec, kind=KINDS[kind_id], granularity=gran, dtype=DTYPES[dtype_id], shape=(t, h, d),
                       group_size=group, window_tokens=w, scales=scales, zeros=zeros, payload=payload, window=window,
                       scale_option=float(scale_option))

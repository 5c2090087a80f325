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

Decoding checks, in order, and raises ``KVBlockError`` naming the field: the buffer (``buf``: a
C-contiguous bytes-like object), length, magic, version, header size, total length against the
declared sections, crc32c (any flipped bit fails here), then the header's meaning (known codec /
kind / layout / dtype / granularity, bits of the codec, shape >= 1, window < tokens, group size
dividing, ``scale_option`` NaN except for fp8's fixed scale, every section's size equal to what the
shape implies) and the sections' contents (``codecs.content_problem``, which
``QuantizedKV.check_layout`` applies before ``encode_block`` writes a block, so encoding and
decoding accept the same tensors: scales positive and finite, fp8's all equal to its fixed scale
when it has one, zero points within the bound ``|z| <= 2**20`` (``reference.MAX_ZERO_POINT``), no
int8 code -128, no fp8 NaN code, zero padding bits, a finite window, and no code decoding to a
magnitude beyond ``MAGNITUDE_LIMIT`` of the block's dtype: float32's largest finite value, and twice
float16's (what an encoder's zero point rounding can reach for float16 input, clipped on
dequantization). A block that passes decodes to exactly the tensor that was encoded, or, if resealed
by hand, at least to finite values of its dtype; every other block is refused.
"""

from __future__ import annotations

import math
import struct

import crc32c
import numpy as np

from quillcache.kvquant.codecs import (CODEC_BITS, DTYPES, GRANULARITIES, KINDS, MAGNITUDE_LIMIT, QuantizedKV,
                                      content_problem, expected_layout, scale_option_problem)
from quillcache.kvquant.errors import KVBlockError

__all__ = ["BLOCK_MAGIC", "BLOCK_VERSION", "HEADER_BYTES", "decode_block", "encode_block"]

BLOCK_MAGIC = b"QKVB"
BLOCK_VERSION = 1
_HEADER = struct.Struct("<4sHHBBBBBBHIIIIQQQQf")
HEADER_BYTES = _HEADER.size
_CRC_BYTES = 4
CODEC_IDS = {"int8": 1, "fp8_e4m3": 2, "int4": 3, "int2": 4}
GRANULARITY_IDS = {"token_head": 0, "tensor": 1, "head": 2, "channel": 3, "token": 4}


def _host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()


def encode_block(q: QuantizedKV) -> bytes:
    """The block of ``q`` (device arrays are copied to the host first); ``q.check_layout()`` first, so a
    hand-built ``QuantizedKV`` with a field or contents no encoder writes raises ``KVQuantError`` naming it
    (what is written, ``decode_block`` reads back)."""
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


def decode_block(buf: bytes | bytearray | memoryview) -> QuantizedKV:
    """The ``QuantizedKV`` a block holds; ``KVBlockError`` (naming the field) for anything malformed."""
    try:
        mv = memoryview(buf).cast("B")
    except TypeError as e:  # not bytes-like, or a non-contiguous view (cast needs C-contiguous memory)
        raise KVBlockError("buf", f"{type(buf).__name__} is not a C-contiguous bytes-like object ({e})") from None
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
    why = scale_option_problem(codec, scale_option)
    if why is not None:
        raise KVBlockError("scale_option", why)
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
    problem = content_problem(codec, DTYPES[dtype_id], scale_option, scales, zeros, payload, window, t_q * h * d)
    if problem is not None:  # the same checks as QuantizedKV.check_layout: encode and decode accept one set
        raise KVBlockError(*problem)
    return QuantizedKV(codec=codec, kind=KINDS[kind_id], granularity=gran, dtype=DTYPES[dtype_id], shape=(t, h, d),
                       group_size=group, window_tokens=w, scales=scales, zeros=zeros, payload=payload, window=window,
                       scale_option=float(scale_option))

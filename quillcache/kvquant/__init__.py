"""KV-cache quantization: int8 / fp8 e4m3 / int4 / int2 codecs, their kernels, and a block format.

- ``make_codec(name, **options)`` / ``CODECS``: the codecs (``codecs.py`` states each formula's
  contract; ``reference.py`` is the bit-level specification).
- ``codec.quantize(x, kind="key", backend="numba") -> QuantizedKV``; ``codec.dequantize(q)`` or
  ``q.dequantize()``; ``quantize`` / ``dequantize`` below do the same by codec name.
- ``encode_block(q) -> bytes`` / ``decode_block(buf) -> QuantizedKV``: a versioned,
  self-describing, crc32c-checked block (``block.py``).
- ``KERNELS``: the kernel backends, ``reference`` (NumPy), ``numba`` (CPU) and ``cuda``
  (``numba.cuda`` on CuPy arrays; Numba's CUDA simulator in the tests), bit-identical.
- Errors (all ``KVQuantError``, a ``ValueError``): ``KVQuantDtypeError``, ``KVQuantShapeError``,
  ``NonFiniteError`` (NaN / inf are refused, never saturated), ``OutOfRangeError`` (``|x| > 2**127``),
  ``KVBlockError``.

Importing this package loads neither Numba's CPU kernels nor ``numba.cuda``: a backend is loaded
the first time it is used.
"""

from __future__ import annotations

from quillcache.kvquant.block import BLOCK_MAGIC, BLOCK_VERSION, decode_block, encode_block
from quillcache.kvquant.codecs import (CODECS, MAX_ABS, Codec, Fp8E4M3Codec, Int8Codec, KiviCodec, QuantizedKV,
                                       make_codec)
from quillcache.kvquant.errors import (KVBlockError, KVQuantDtypeError, KVQuantError, KVQuantShapeError,
                                       NonFiniteError, OutOfRangeError)
from quillcache.kvquant.fp8 import E4M3_MAX, e4m3_decode, e4m3_encode
from quillcache.kvquant.kernels import KERNELS

__all__ = ["BLOCK_MAGIC", "BLOCK_VERSION", "CODECS", "Codec", "E4M3_MAX", "Fp8E4M3Codec", "Int8Codec", "KERNELS",
           "KVBlockError", "KVQuantDtypeError", "KVQuantError", "KVQuantShapeError", "KiviCodec", "MAX_ABS", "NonFiniteError",
           "OutOfRangeError",
           "QuantizedKV", "decode_block", "dequantize", "e4m3_decode", "e4m3_encode", "encode_block", "make_codec",
           "quantize"]


def quantize(x, codec: str = "int8", *, kind: str = "key", backend: str = "numba", **options) -> QuantizedKV:
    """``make_codec(codec, **options).quantize(x, kind=kind, backend=backend)``."""
    return make_codec(codec, **options).quantize(x, kind=kind, backend=backend)


def dequantize(q: QuantizedKV, *, backend: str = "numba"):
    """The tensor ``q`` holds, in its original dtype and shape (``q.dequantize(backend)``: its layout is checked
    before its codec is built from its fields, so an error names the field)."""
    if not isinstance(q, QuantizedKV):
        raise KVQuantError(f"q must be a QuantizedKV (from quantize or decode_block), got {type(q).__name__}")
    return q.dequantize(backend)

"""``TierCodec``: a ``quillcache.kvquant`` codec applied to a node's DRAM and SSD tiers.

The GPU tier keeps fp16/bf16 KV (as vLLM's CPU offloading does); a block leaving the GPU for DRAM
is quantized, and a block fetched back into a GPU is decoded and dequantized. DRAM and SSD hold the
same quantized bytes, so DRAM <-> SSD demotion and promotion move them unchanged.

Stored block (what the tiers hold, and what moves between tiers and over the network)::

    encode_block(quantize(K)) | encode_block(quantize(V))

with K and V the block's keys and values of every layer, each ``(tokens, layers x kv_heads,
head_dim)``: the layers are folded into the head axis, which leaves every codec's grouping what it
would be per layer (int8: one scale per token x head; fp8: one scale per head; int4/int2 KIVI: keys
per channel in groups of tokens, values per token in groups of channels). Each half is a
self-describing ``QKVB`` block with its own crc32c (``quillcache.kvquant.block``); the split point
is ``key_block_bytes``, fixed by the shape and the codec.

Sizes come from the codec itself (``encode_block`` of a zero tensor of the block's shape, computed
once), never from a constant: ``block_bytes = len(K block) + len(V block)``, which is
``fp16_block_bytes x bytes_per_element / 2`` plus two block headers (68 bytes) and crc32cs (4).
``bytes_per_element`` counts codes, float32 scales and int32 zero points (``Codec.bytes_per_element``).

KIVI's groups (int4 / int2) are ``group_size = gcd(32, tokens, head_dim)`` so that a block's tokens
and a head's channels are whole groups (32 for 512-token blocks of 128-channel heads; 16 for
16-token blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from quillcache._checks import check_int
from quillcache.kvquant import CODECS, Codec, decode_block, encode_block, make_codec

__all__ = ["FP16", "REL_MSE_BOUND", "TIER_CODECS", "TierCodec", "check_tier_codec", "rel_mse"]

FP16 = "fp16"  # no codec: the tiers hold the GPU's 16-bit KV as is
KIVI_GROUP = 32
# relMSE a decoded block may show against the tensor that was encoded, on Gaussian data: about 4x
# REFERENCE §12's Gaussian figures (int8 4.2e-5, fp8 7.0e-4, int4 6.1e-3, int2 0.155 at a group of 32)
# and far below the ~2 of a block decoded for the wrong key. A test bound, not a quality claim.
REL_MSE_BOUND = {"int8": 2e-4, "fp8_e4m3": 3e-3, "int4": 3e-2, "int2": 0.35}


def tier_codec_names() -> tuple[str, ...]:
    return (FP16, *CODECS.names())


TIER_CODECS = tier_codec_names()


def rel_mse(approx: np.ndarray, exact: np.ndarray) -> float:
    """``sum((approx - exact)**2) / sum(exact**2)`` in float64."""
    a, e = approx.astype(np.float64), exact.astype(np.float64)
    return float(((a - e) ** 2).sum() / max(float((e**2).sum()), 1e-300))


def check_tier_codec(name: object, field: str = "kv_codec") -> str:
    """``name`` if it is ``fp16`` or a ``quillcache.kvquant`` codec; ValueError naming ``field`` and
    listing the codecs."""
    if not isinstance(name, str) or name not in TIER_CODECS:
        raise ValueError(f"{field}={name!r} is not a KV codec; known: {', '.join(TIER_CODECS)} (fp16 = no codec)")
    return name


@dataclass(frozen=True)
class TierCodec:
    """One codec for one block shape: ``tokens`` per block, ``layers`` x ``kv_heads`` heads of
    ``head_dim`` (one tensor-parallel rank's share), K and V each. ``name`` is a kvquant codec
    (``fp16`` is "no codec" and is not a ``TierCodec``)."""

    name: str
    tokens: int
    layers: int
    kv_heads: int
    head_dim: int
    codec: Codec = field(init=False, repr=False, compare=False)
    key_block_bytes: int = field(init=False)
    value_block_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        if check_tier_codec(self.name) == FP16:
            raise ValueError("fp16 is no codec: the tiers store the KV as is (use None, not a TierCodec)")
        for f in ("tokens", "layers", "kv_heads", "head_dim"):
            check_int(f, getattr(self, f), 1)
        opts = {"group_size": math.gcd(KIVI_GROUP, self.tokens, self.head_dim)} if self.name in ("int4", "int2") else {}
        codec = make_codec(self.name, **opts)
        object.__setattr__(self, "codec", codec)
        object.__setattr__(self, "key_block_bytes", self._encoded_len("key"))
        object.__setattr__(self, "value_block_bytes", self._encoded_len("value"))

    def _encoded_len(self, kind: str) -> int:
        """``len(encode_block(quantize(zeros)))`` of the block's shape. A block's sections grow
        linearly in its heads (every codec here groups within a head), so the lengths at 1, 2 and 3
        heads give it without quantizing the whole shape; if they were not linear, it is measured."""
        t, h, d = self.shape

        def length(heads: int) -> int:
            zero = np.zeros((t, heads, d), np.float16)
            return len(encode_block(self.codec.quantize(zero, kind=kind, backend="reference")))

        l1, l2, l3 = length(1), length(2), length(3)
        if l2 - l1 == l3 - l2:
            return l1 + (h - 1) * (l2 - l1)
        return length(h)

    @property
    def shape(self) -> tuple[int, int, int]:
        """Shape of the block's K (and of its V): ``(tokens, layers x kv_heads, head_dim)``."""
        return (self.tokens, self.layers * self.kv_heads, self.head_dim)

    @property
    def elements(self) -> int:
        """KV elements of one block (K and V)."""
        return 2 * math.prod(self.shape)

    @property
    def fp16_block_bytes(self) -> int:
        return 2 * self.elements

    @property
    def block_bytes(self) -> int:
        """Bytes of one stored block (both ``QKVB`` blocks, headers and crcs included)."""
        return self.key_block_bytes + self.value_block_bytes

    @property
    def bytes_per_element(self) -> float:
        """Array bytes per element (codes, scales, zero points; K and V averaged), from the codec."""
        return (self.codec.bytes_per_element(self.shape, "key") + self.codec.bytes_per_element(self.shape, "value")) / 2

    @property
    def ratio(self) -> float:
        """Stored bytes / fp16 bytes of a block."""
        return self.block_bytes / self.fp16_block_bytes

    def encode(self, k: np.ndarray, v: np.ndarray, *, backend: str = "numba") -> bytes:
        """The stored block of keys ``k`` and values ``v`` (float16, ``shape`` each)."""
        for name, a in (("k", k), ("v", v)):
            if tuple(a.shape) != self.shape:
                raise ValueError(f"{name}.shape={tuple(a.shape)} is not the block's {self.shape}")
        kb = encode_block(self.codec.quantize(k, kind="key", backend=backend))
        vb = encode_block(self.codec.quantize(v, kind="value", backend=backend))
        assert len(kb) == self.key_block_bytes and len(vb) == self.value_block_bytes
        return kb + vb

    def decode(self, data, *, backend: str = "numba") -> tuple[np.ndarray, np.ndarray]:
        """``(k, v)`` of a stored block, dequantized; ``KVBlockError`` if either half is malformed or
        fails its crc32c, ValueError if the length is not a block's."""
        mv = memoryview(data).cast("B")
        if len(mv) != self.block_bytes:
            raise ValueError(f"a {self.name} block of shape {self.shape} is {self.block_bytes} bytes, got {len(mv)}")
        qk = decode_block(mv[: self.key_block_bytes])
        qv = decode_block(mv[self.key_block_bytes:])
        for q, kind in ((qk, "key"), (qv, "value")):
            if q.codec != self.name or q.kind != kind or q.shape != self.shape:
                raise ValueError(f"the stored {kind} block is {q.codec} {q.kind} {q.shape}, expected "
                                 f"{self.name} {kind} {self.shape}")
        return self.codec.dequantize(qk, backend=backend), self.codec.dequantize(qv, backend=backend)

    def within_error(self, decoded: np.ndarray, original: np.ndarray) -> bool:
        """Whether ``decoded`` is within this codec's error of ``original`` (relMSE at most
        ``REL_MSE_BOUND``; values of the same scale as Gaussian KV)."""
        return rel_mse(decoded, original) <= REL_MSE_BOUND[self.name]

    def blocks_in(self, capacity_bytes: int, alignment: int = 1) -> int:
        """Whole stored blocks that fit in ``capacity_bytes`` at ``alignment``-byte footprints."""
        return capacity_bytes // (-(-self.block_bytes // alignment) * alignment)

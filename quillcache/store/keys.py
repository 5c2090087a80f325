"""The key of a stored block: its chained block hash under one identity scope.

Invariant: two blocks with the same content hash but different identity digests are different
keys (DESIGN: identity-governed reuse). ``StoreKey.to_bytes()`` is a fixed 24-byte big-endian
encoding (hash u64 | identity 16 B), so keys sort by hash first, like the residency index.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

KEY_BYTES = 24
_KEY = struct.Struct(">Q16s")
_U64_MAX = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class StoreKey:
    """A block hash (uint64) and the 16-byte identity digest it was computed under."""

    block_hash: int
    identity: bytes

    def __post_init__(self) -> None:
        h = self.block_hash
        if isinstance(h, bool) or not isinstance(h, int):
            raise TypeError(f"StoreKey.block_hash must be int, got {type(h).__name__}")
        if not 0 <= h <= _U64_MAX:
            raise ValueError(f"StoreKey.block_hash={h} is outside uint64")
        ident = self.identity
        if not isinstance(ident, bytes):
            raise TypeError(f"StoreKey.identity must be bytes, got {type(ident).__name__}")
        if len(ident) != 16:
            raise ValueError(f"StoreKey.identity must be a 16-byte digest, got {len(ident)} bytes")

    def to_bytes(self) -> bytes:
        return _KEY.pack(self.block_hash, self.identity)

    @classmethod
    def from_bytes(cls, raw: bytes) -> "StoreKey":
        if len(raw) != KEY_BYTES:
            raise ValueError(f"a StoreKey is {KEY_BYTES} bytes, got {len(raw)}")
        h, ident = _KEY.unpack(raw)
        return cls(h, ident)

    def hex(self) -> str:
        """Short printable form for messages and file names: 16 hex digits + 32 hex digits."""
        return f"{self.block_hash:016x}-{self.identity.hex()}"

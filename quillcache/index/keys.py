"""Key layout of the residency index: fixed-length, prefix-free key families.

Every replica of a block is two records:

- primary, by block: ``b"B" | block_hash u64 BE | node u32 BE | identity 16 B | tier u8`` (30 bytes)
  → value ``segment u32 BE | offset u64 BE | size u32 BE`` (16 bytes). ``locate(h)`` is a prefix
  scan over the 9-byte prefix ``b"B" | h``, which returns every replica (every node, tier and
  identity) of that block in one ordered walk.
- secondary, by node: ``b"N" | node u32 BE | block_hash u64 BE | identity 16 B | tier u8`` (30 bytes)
  → empty value. "Everything on node N" (node failure cleanup) is a prefix scan over ``b"N" | n``.

Node names are interned to u32 numbers through a third family, ``b"M" | utf-8 name | 0x00`` → u32 BE,
kept in the same store, so the mapping is as durable as the records that use it.

Invariants: within a family all keys have the same length, and families differ in their first byte,
so no key is a proper prefix of another (what the ART needs). Big-endian integers make byte order
equal numeric order, so scans come back sorted by (block hash, node, identity, tier). The tier
comes last because a block of one identity on one node normally sits in exactly one tier (the
data plane moves it between tiers), so the tier byte rarely branches and the tree stays a level
shallower than with the tier before the identity (measured in the storage study).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from quillcache._checks import check_int
from quillcache.types import CacheTier

PRIMARY = b"B"
SECONDARY = b"N"
NODE_NAME = b"M"
KEY_BYTES = 30
VALUE_BYTES = 16
IDENTITY_BYTES = 16
BLOCK_PREFIX_BYTES = 9
NODE_PREFIX_BYTES = 5
MAX_NODE_NAME_BYTES = 200
U64_MAX = (1 << 64) - 1
U32_MAX = (1 << 32) - 1

_PRIMARY = struct.Struct(">cQI16sB")
_SECONDARY = struct.Struct(">cIQ16sB")
_VALUE = struct.Struct(">IQI")
assert _PRIMARY.size == _SECONDARY.size == KEY_BYTES and _VALUE.size == VALUE_BYTES


class IndexKeyError(ValueError):
    """A key, prefix or entry field that does not fit the layout."""


@dataclass(frozen=True, slots=True)
class ReplicaKey:
    """Names one replica: a block under one identity, on one node, in one tier."""

    block_hash: int
    node: str
    tier: CacheTier
    identity: bytes


@dataclass(frozen=True, slots=True)
class ResidencyEntry:
    """Where one replica's bytes are: ``[offset_bytes, offset_bytes + size_bytes)`` of a segment."""

    block_hash: int
    node: str
    tier: CacheTier
    identity: bytes
    segment_id: int
    offset_bytes: int
    size_bytes: int

    @property
    def key(self) -> ReplicaKey:
        return ReplicaKey(self.block_hash, self.node, self.tier, self.identity)


def check_block_hash(h: object) -> int:
    """A 64-bit block hash (Python or NumPy integer) as an int, or IndexKeyError naming it."""
    return check_int("block hash", h, 0, U64_MAX, error=IndexKeyError, type_error=IndexKeyError)


def check_identity(identity: object) -> bytes:
    if not isinstance(identity, (bytes, bytearray)) or len(identity) != IDENTITY_BYTES:
        n = len(identity) if isinstance(identity, (bytes, bytearray)) else type(identity).__name__
        raise IndexKeyError(f"identity must be a {IDENTITY_BYTES}-byte digest (Identity.digest()), got {n}")
    return bytes(identity)


def check_tier(tier: object) -> CacheTier:
    try:
        return CacheTier(tier)
    except ValueError:
        raise IndexKeyError(f"tier {tier!r} is not a CacheTier ({[t.name for t in CacheTier]})") from None


def node_name_key(name: str) -> bytes:
    if not isinstance(name, str) or not name:
        raise IndexKeyError(f"node name must be a non-empty str, got {name!r}")
    raw = name.encode("utf-8")
    if b"\x00" in raw or len(raw) > MAX_NODE_NAME_BYTES:
        raise IndexKeyError(f"node name {name!r} must be 1..{MAX_NODE_NAME_BYTES} UTF-8 bytes without NUL")
    return NODE_NAME + raw + b"\x00"


def node_name_from_key(key: bytes) -> str:
    return key[1:-1].decode("utf-8")


def primary_key(block_hash: int, node_no: int, tier: int, identity: bytes) -> bytes:
    return _PRIMARY.pack(PRIMARY, block_hash, node_no, identity, tier)


def secondary_key(block_hash: int, node_no: int, tier: int, identity: bytes) -> bytes:
    return _SECONDARY.pack(SECONDARY, node_no, block_hash, identity, tier)


def block_prefix(block_hash: int) -> bytes:
    return PRIMARY + check_block_hash(block_hash).to_bytes(8, "big")


def node_prefix(node_no: int) -> bytes:
    return SECONDARY + node_no.to_bytes(4, "big")


def pack_value(segment_id: int, offset_bytes: int, size_bytes: int) -> bytes:
    """The 16-byte value of a replica's location; each field must be an integer (Python or NumPy,
    not bool) in range - ``segment_id`` u32, ``offset_bytes`` u64, ``size_bytes`` u32 - else
    ``IndexKeyError`` naming the field and its value."""
    seg = check_int("segment_id", segment_id, 0, U32_MAX, error=IndexKeyError, type_error=IndexKeyError)
    off = check_int("offset_bytes", offset_bytes, 0, U64_MAX, error=IndexKeyError, type_error=IndexKeyError)
    size = check_int("size_bytes", size_bytes, 0, U32_MAX, error=IndexKeyError, type_error=IndexKeyError)
    return _VALUE.pack(seg, off, size)


def unpack_primary(key: bytes) -> tuple[int, int, int, bytes]:
    """``(block_hash, node_no, tier, identity)`` of a primary key."""
    if len(key) != KEY_BYTES or key[:1] != PRIMARY:
        raise IndexKeyError(f"not a primary residency key: {key[:12]!r}... ({len(key)} bytes)")
    _, h, n, ident, t = _PRIMARY.unpack(key)
    return h, n, t, ident


def unpack_secondary(key: bytes) -> tuple[int, int, int, bytes]:
    """``(block_hash, node_no, tier, identity)`` of a secondary key."""
    if len(key) != KEY_BYTES or key[:1] != SECONDARY:
        raise IndexKeyError(f"not a secondary residency key: {key[:12]!r}... ({len(key)} bytes)")
    _, n, h, ident, t = _SECONDARY.unpack(key)
    return h, n, t, ident


def unpack_value(value: bytes) -> tuple[int, int, int]:
    if len(value) != VALUE_BYTES:
        raise IndexKeyError(f"residency value must be {VALUE_BYTES} bytes, got {len(value)}")
    return _VALUE.unpack(value)

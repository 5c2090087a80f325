"""Typed checkpoint meta of an ART arena: the small state that, with the arena bytes and the root
offset, re-creates an ``ArtTree`` (``ArtTree.export_meta()`` -> ``ArtTree.attach(..., meta)``).

Contracts
- ``ArenaMeta`` is a frozen record of unsigned 64-bit ints (bool refused) plus ``free_heads``, the
  head offset of each non-empty free list as ``(block_bytes, head_offset)`` pairs, ascending and
  unique by ``block_bytes`` (a positive multiple of 8), with ``head_offset > 0``.  Constructing one
  checks only these intrinsic properties (TypeError / ValueError naming the field); everything
  that depends on the arena (used size against the buffer, counts that must fit, heads inside the
  used bytes, size classes the format knows, the format version) is checked by ``attach``, which
  refuses a bad field with a ValueError naming it.
- ``to_bytes()`` / ``from_bytes()`` are an exact, versioned little-endian encoding (what the
  residency index stores in its checkpoint header): ``from_bytes(m.to_bytes()) == m``, and
  ``from_bytes`` refuses anything that is not exactly one such record.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import ClassVar

__all__ = ["ArenaMeta"]

_U64_MAX = 2**64 - 1
# magic, record version, number of free heads, then the ten counters in field order
_HEAD = struct.Struct("<8sII10Q")
_FREE_HEAD = struct.Struct("<QQ")  # block_bytes, head_offset
_MAGIC = b"QARTMETA"
_RECORD_VERSION = 1


def _u64(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ArenaMeta.{name} must be an int, got {type(value).__name__}")
    if not 0 <= value <= _U64_MAX:
        raise ValueError(f"ArenaMeta.{name} must be in 0..{_U64_MAX}, got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class ArenaMeta:
    """Counters and free-list heads of one arena (see the module docstring)."""

    format_version: int
    value_size: int
    arena_used_bytes: int
    num_leaves: int
    num_node4: int
    num_node16: int
    num_node48: int
    num_node256: int
    free_list_bytes: int
    free_list_blocks: int
    free_heads: tuple[tuple[int, int], ...] = ()

    COUNTERS: ClassVar[tuple[str, ...]] = (
        "format_version", "value_size", "arena_used_bytes", "num_leaves", "num_node4", "num_node16",
        "num_node48", "num_node256", "free_list_bytes", "free_list_blocks",
    )

    def __post_init__(self) -> None:
        for name in self.COUNTERS:
            _u64(name, getattr(self, name))
        heads = self.free_heads
        if not isinstance(heads, tuple):
            raise TypeError(f"ArenaMeta.free_heads must be a tuple of (block_bytes, head_offset) pairs, "
                            f"got {type(heads).__name__}")
        prev = 0
        for entry in heads:
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise TypeError(f"ArenaMeta.free_heads entries must be (block_bytes, head_offset) pairs, got {entry!r}")
            block_bytes = _u64("free_heads block_bytes", entry[0])
            head = _u64(f"free_heads[{block_bytes}]", entry[1])
            if block_bytes == 0 or block_bytes % 8:
                raise ValueError(f"ArenaMeta.free_heads: size class {block_bytes} is not a positive multiple of 8")
            if block_bytes <= prev:
                raise ValueError(f"ArenaMeta.free_heads must be strictly ascending by block_bytes, got "
                                 f"{block_bytes} after {prev}")
            if head == 0:
                raise ValueError(f"ArenaMeta.free_heads[{block_bytes}]: an empty list has no entry (head 0)")
            prev = block_bytes

    def to_bytes(self) -> bytes:
        """The exact encoding: header (magic, version, number of heads, counters) + heads."""
        counts = [getattr(self, name) for name in self.COUNTERS]
        parts = [_HEAD.pack(_MAGIC, _RECORD_VERSION, len(self.free_heads), *counts)]
        parts.extend(_FREE_HEAD.pack(size, head) for size, head in self.free_heads)
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> ArenaMeta:
        """Decode ``to_bytes()`` output; ValueError for anything else (TypeError: not bytes-like)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"ArenaMeta.from_bytes needs bytes, got {type(data).__name__}")
        raw = bytes(data)
        if len(raw) < _HEAD.size:
            raise ValueError(f"ArenaMeta.from_bytes: {len(raw)} bytes is shorter than the {_HEAD.size}-byte header")
        magic, version, n_heads, *counts = _HEAD.unpack_from(raw, 0)
        if magic != _MAGIC:
            raise ValueError(f"ArenaMeta.from_bytes: bad magic {magic!r} (want {_MAGIC!r})")
        if version != _RECORD_VERSION:
            raise ValueError(f"ArenaMeta.from_bytes: record version {version} is not {_RECORD_VERSION}")
        want = _HEAD.size + n_heads * _FREE_HEAD.size
        if len(raw) != want:
            raise ValueError(f"ArenaMeta.from_bytes: {len(raw)} bytes, but {n_heads} free heads need exactly {want}")
        heads = tuple(_FREE_HEAD.unpack_from(raw, _HEAD.size + i * _FREE_HEAD.size) for i in range(n_heads))
        return cls(*counts, free_heads=heads)

"""Core identifiers and the identity scope every cached block belongs to.

Invariants:
- ``BlockHash`` is an unsigned 64-bit chained sequence hash (REFERENCE §1); it names a block
  *and everything before it*, so equal hashes mean equal prefixes under the same hash seed.
- An ``Identity`` is immutable and fully describes who may reuse a block: two blocks with equal
  content hashes but different identities are different cache entries (DESIGN: identity-governed
  safe reuse). ``Identity.digest()`` is a stable 16-byte BLAKE2b digest of every field, so it is
  the same in every process and every run.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field, fields
from typing import NewType

# A chained sequence hash of one full block of tokens (uint64). Separate type because block
# hashes, node ids and segment ids are all integers/strings and must never be mixed up.
BlockHash = NewType("BlockHash", int)
# A node (store process / engine worker) in the pool, e.g. "node-0" or "10.0.0.3:7000".
NodeId = NewType("NodeId", str)
# A registered memory segment (DRAM buffer or SSD slab) within the pool.
SegmentId = NewType("SegmentId", int)

_MAX_NAME_CHARS = 256
_KNOWN_DTYPES = frozenset({"float16", "bfloat16", "float32", "float8_e4m3", "float8_e5m2", "int8"})


class CacheTier(enum.IntEnum):
    """Where a block's bytes live, fastest first. Lower value = closer to compute."""

    GPU = 0
    DRAM = 1
    SSD = 2
    REMOTE = 3


def _check_name(field_name: str, value: object, *, allow_empty: bool) -> None:
    if not isinstance(value, str):
        raise TypeError(f"Identity.{field_name} must be str, got {type(value).__name__}")
    if not allow_empty and not value:
        raise ValueError(f"Identity.{field_name} must not be empty")
    if len(value) > _MAX_NAME_CHARS:
        raise ValueError(
            f"Identity.{field_name} is {len(value)} characters; at most {_MAX_NAME_CHARS} allowed"
        )
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ValueError(f"Identity.{field_name}={value!r} contains control characters")
    try:
        value.encode("utf-8")  # canonical_bytes encodes every name: a lone surrogate could not be
    except UnicodeEncodeError as e:
        raise ValueError(f"Identity.{field_name}={value!r} is not encodable as UTF-8 ({e.reason} at "
                         f"{e.start})") from None


@dataclass(frozen=True, kw_only=True)
class KvLayout:
    """Physical layout of KV bytes: blocks are only interchangeable with an equal layout."""

    dtype: str = "bfloat16"
    block_size_tokens: int = 16
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in _KNOWN_DTYPES:
            raise ValueError(f"KvLayout.dtype={self.dtype!r}; expected one of {sorted(_KNOWN_DTYPES)}")
        for name in ("block_size_tokens", "tp_rank", "tp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"KvLayout.{name} must be int, got {type(v).__name__}")
        if not 1 <= self.block_size_tokens <= 65536:
            raise ValueError(f"KvLayout.block_size_tokens={self.block_size_tokens}; expected 1..65536")
        if not 1 <= self.tp_size < 2**32:  # canonical_bytes packs it into 4 bytes
            raise ValueError(f"KvLayout.tp_size={self.tp_size}; expected 1..{2**32 - 1}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"KvLayout.tp_rank={self.tp_rank}; expected 0..{self.tp_size - 1}")


@dataclass(frozen=True, kw_only=True)
class Identity:
    """The reuse scope of a cached block: model, tokenizer, adapter, tenant and KV layout.

    ``adapter`` is the LoRA adapter name ("" = base model). ``tenant`` is the isolation
    domain ("" = no tenant, i.e. a public scope).
    """

    model: str
    tokenizer: str = ""
    adapter: str = ""
    tenant: str = ""
    layout: KvLayout = field(default_factory=KvLayout)

    def __post_init__(self) -> None:
        _check_name("model", self.model, allow_empty=False)
        for name in ("tokenizer", "adapter", "tenant"):
            _check_name(name, getattr(self, name), allow_empty=True)
        if not isinstance(self.layout, KvLayout):
            raise TypeError(f"Identity.layout must be KvLayout, got {type(self.layout).__name__}")

    def canonical_bytes(self) -> bytes:
        """Length-prefixed encoding of every field, in declaration order (unambiguous)."""
        parts: list[bytes] = []
        for f in fields(self):
            if f.name == "layout":
                continue
            raw = getattr(self, f.name).encode("utf-8")
            parts.append(len(raw).to_bytes(4, "little") + raw)
        lay = self.layout
        raw = lay.dtype.encode("utf-8")
        parts.append(len(raw).to_bytes(4, "little") + raw)
        for v in (lay.block_size_tokens, lay.tp_rank, lay.tp_size):
            parts.append(int(v).to_bytes(4, "little"))
        return b"".join(parts)

    def digest(self) -> bytes:
        """Stable 16-byte BLAKE2b digest of the whole identity."""
        return hashlib.blake2b(self.canonical_bytes(), digest_size=16, person=b"qc-identity").digest()

    def with_tenant(self, tenant: str) -> "Identity":
        """The same scope for another tenant."""
        return Identity(
            model=self.model, tokenizer=self.tokenizer, adapter=self.adapter, tenant=tenant, layout=self.layout
        )

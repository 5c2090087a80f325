"""Typed vLLM KV events (REFERENCE section 10), with block hashes in ONE normalised form.

vLLM publishes ``EventBatch{ts, events, data_parallel_rank}`` whose events are ``BlockStored``, ``BlockRemoved`` and
``AllBlocksCleared``. Its block hashes reach the wire in three forms: a signed i64 (older vLLM, Python ``hash``),
an unsigned u64 (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: the low 64 bits of the digest read big-endian), or the
raw digest bytes (newer vLLM's default). :func:`normalize_hash` maps all three to one form, the **u64 int**:

- an int ``h`` in ``[-2**63, 2**64)`` -> ``h mod 2**64`` (an i64 and the u64 with the same bits are one hash);
- bytes ``b`` (1..64 of them) -> ``int.from_bytes(b, "big") & (2**64 - 1)`` — exactly vLLM's own conversion of a
  digest to an int hash, so the bytes form and the int form of one block give the same value.

Invariants of the dataclasses (checked by the decoder, relied on by consumers): every hash is a u64 int;
``BlockStored.block_size >= 1`` and ``len(token_ids) == len(block_hashes) * block_size`` (the stored blocks'
tokens, in order); token ids are ints in ``[0, 2**32)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType, Union

__all__ = [
    "MEDIUM_GPU",
    "U64_MASK",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineBlockHash",
    "EventBatch",
    "KvEvent",
    "normalize_hash",
]

U64_MASK = (1 << 64) - 1
MEDIUM_GPU = "GPU"

# An engine's own block hash after normalize_hash (u64). It is NOT the gateway's hash: it names the engine's block
# under the engine's hash function and seed, so it is only meaningful per engine.
EngineBlockHash = NewType("EngineBlockHash", int)


def normalize_hash(value: object, *, field: str = "hash") -> int:
    """The u64 form of a wire hash (module docstring); ``ValueError`` naming ``field`` for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"{field} must be an int or bytes, got bool")
    if isinstance(value, int):
        if not -(1 << 63) <= value <= U64_MASK:
            raise ValueError(f"{field}={value} is outside the i64/u64 range")
        return value & U64_MASK
    if isinstance(value, (bytes, bytearray, memoryview)):
        b = bytes(value)
        if not 1 <= len(b) <= 64:
            raise ValueError(f"{field} has {len(b)} bytes; a digest has 1..64")
        return int.from_bytes(b, "big") & U64_MASK
    raise ValueError(f"{field} must be an int or bytes, got {type(value).__name__}")


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks newly cached by the engine, in chain order; ``parent_block_hash`` precedes the first (None: a root)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None

    def block_tokens(self, i: int) -> tuple[int, ...]:
        """The tokens of the ``i``-th stored block."""
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine evicted (each hash names one block; its descendants may remain, unreachable)."""

    block_hashes: tuple[int, ...]
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped every cached block (e.g. a prefix-cache reset)."""


KvEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message: events in the order the engine applied them. ``unknown_events`` counts events of a
    type this decoder does not know (skipped, for forward compatibility with newer vLLM)."""

    ts: float
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = None
    unknown_events: int = 0

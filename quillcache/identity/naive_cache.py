"""The naive content-hash cache: the baseline the identity guard is measured against.

It keys blocks on token content only, as LMCache (chunk hash without tenant or adapter) and
SGLang HiCache (chained page hash over token ids) do (REFERENCE section 1): the key of a block is
the content-only Dynamo chain hash (``hash_blocks(tokens, block_size)`` with no LoRA/namespace
seed), so two tenants, two adapters, two models sharing a tokenizer, or two KV layouts that send
the same prefix get the same key and share the cached KV.

Semantics (prefix cache, LRU):
- ``lookup`` returns how many LEADING blocks are cached (the first miss ends the hit) and
  refreshes them in LRU order;
- ``insert`` stores the blocks that are not cached yet; an existing key is NOT re-stored (LMCache's
  ``put`` skips contained keys), so the first writer's KV is what later requests get;
- with ``capacity_blocks`` the least recently used block is evicted first.

Instrumentation only: the cache records which identity digest wrote each block
(``writers``) so the safety study can audit its hits; the cache itself never consults it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from quillcache._checks import check_int
from quillcache.hashing.blocks import check_block_size, hash_blocks

__all__ = ["NaiveContentCache"]


def _as_hashes(block_hashes: Sequence[int] | np.ndarray) -> list[int]:
    if isinstance(block_hashes, np.ndarray):
        if block_hashes.ndim != 1 or block_hashes.dtype.kind not in "ui":
            raise TypeError(f"block_hashes must be a 1-D integer array, got {block_hashes.dtype} {block_hashes.shape}")
        if block_hashes.dtype.kind == "i" and len(block_hashes) and int(block_hashes.min()) < 0:
            raise ValueError("block hashes must be non-negative")
        return block_hashes.tolist()
    if isinstance(block_hashes, (str, bytes)) or not isinstance(block_hashes, Sequence):
        raise TypeError(f"block_hashes must be a sequence of integers, got {type(block_hashes).__name__}")
    out = []
    for i, h in enumerate(block_hashes):
        out.append(check_int(f"block_hashes[{i}]", h, 0, 2**64 - 1, type_error=ValueError))
    return out


class NaiveContentCache:
    """A prefix cache keyed on token content only (no identity in the key)."""

    def __init__(self, block_size_tokens: int = 16, capacity_blocks: int | None = None) -> None:
        self.block_size_tokens = check_block_size(block_size_tokens)
        if capacity_blocks is not None:
            capacity_blocks = check_int("capacity_blocks", capacity_blocks, 1)  # None = unbounded
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, bytes] = OrderedDict()  # content hash -> writer digest
        self.num_evictions = 0

    def hash_tokens(self, tokens) -> np.ndarray:
        """The content-only key of every full block of ``tokens``."""
        return hash_blocks(tokens, self.block_size_tokens)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return int(block_hash) in self._blocks

    def lookup(self, block_hashes: Sequence[int] | np.ndarray) -> int:
        """Number of leading blocks cached (refreshing them as recently used)."""
        blocks = self._blocks
        n = 0
        for h in _as_hashes(block_hashes):
            if h not in blocks:
                break
            blocks.move_to_end(h)
            n += 1
        return n

    def writers(self, block_hashes: Sequence[int] | np.ndarray, n: int | None = None) -> list[bytes]:
        """Recorded writer digest of each of the first ``n`` blocks (all must be cached)."""
        hs = _as_hashes(block_hashes)
        if n is not None:
            hs = hs[:n]
        try:
            return [self._blocks[h] for h in hs]
        except KeyError as exc:
            raise KeyError(f"block {exc.args[0]:#x} is not cached") from None

    def insert(self, block_hashes: Sequence[int] | np.ndarray, writer: bytes) -> int:
        """Store every block not cached yet (first writer wins); returns how many were stored."""
        if not isinstance(writer, (bytes, bytearray)) or len(writer) != 16:
            raise TypeError(f"writer must be a 16-byte identity digest, got {writer!r:.60}")
        writer = bytes(writer)
        blocks = self._blocks
        stored = 0
        for h in _as_hashes(block_hashes):
            if h in blocks:
                blocks.move_to_end(h)
                continue
            blocks[h] = writer
            stored += 1
        cap = self.capacity_blocks
        if cap is not None:
            while len(blocks) > cap:
                blocks.popitem(last=False)
                self.num_evictions += 1
        return stored

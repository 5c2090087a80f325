"""``SimBlockCache``: the stand-in engine's prefix cache — hash-chained blocks, LRU over a GPU capacity in blocks.

It follows vLLM v1's prefix cache (``vllm/v1/core/block_pool.py``), the part the gateway depends on:

- Block identity: only FULL blocks of ``block_size`` tokens are cached. ``digest[i] = sha256(digest[i-1] ||
  le_u32(len(extra_i)) || extra_i || le_u32(tokens_i))`` (``extra_i`` the length-prefixed extra keys) with
  ``digest[-1] = ROOT`` (a fixed sha256 of this module's seed string, so restarts
  and separate processes agree, like vLLM's sha256 default). ``extra_keys_i = [lora_name]`` for every block and
  ``[lora_name, cache_salt]`` for the FIRST block only (vLLM's extra keys: the salt enters block 0 and the chain
  carries it). This is the ENGINE's hash: it differs from the gateway's (Dynamo xxh3) by design.
- Cached prefix of a request = the longest run of consecutive cached blocks from its first block.
- Capacity counts every cached block. Blocks of running requests are pinned (reference counted) and never
  evicted; unpinned cached blocks form an LRU list. A release appends a request's blocks to the LRU tail in
  REVERSE order (its last block first), so a chain is evicted from its tail and its prefix stays reachable longest.
- Storing a block into a full cache evicts the LRU head; when every cached block is pinned, storing stops (the
  remaining blocks of that request are not cached: vLLM would preempt; the stand-in just does not cache them).
- Each store/evict is reported (``StoreResult``) so the engine publishes vLLM KV events: a ``BlockStored`` per
  contiguous run of NEW blocks (its parent is the block before the run), a ``BlockRemoved`` for evicted blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["ROOT_DIGEST", "SimBlockCache", "StoreResult", "StoredRun", "engine_block_digests"]

assert array("I").itemsize == 4, "token ids are packed as 4-byte unsigned ints"
ROOT_DIGEST = hashlib.sha256(b"quillcache engine-sim block hash root v1").digest()


def _extra_bytes(lora_name: str | None, cache_salt: str | None, first: bool) -> bytes:
    parts = [lora_name, cache_salt] if first else [lora_name]
    out = bytearray()
    for p in parts:  # length-prefixed, None distinct from "": unambiguous
        if p is None:
            out += b"\xff\xff\xff\xff"
        else:
            b = p.encode("utf-8")
            out += len(b).to_bytes(4, "little") + b
    return bytes(out)


def engine_block_digests(token_ids: Sequence[int], block_size: int, *, lora_name: str | None = None,
                         cache_salt: str | None = None, start_block: int = 0,
                         parent: bytes | None = None) -> list[bytes]:
    """The engine's sha256 chain over the full blocks of ``token_ids`` (module docstring): ``digest[i] =
    sha256(digest[i-1] || le_u32(len(extra_i)) || extra_i || le_u32(tokens_i))`` with ``extra_i`` the
    length-prefixed extra keys. ``start_block``/``parent`` continue a chain already computed up to block
    ``start_block - 1`` (whose digest is ``parent``) and return the digests from ``start_block`` on."""
    if start_block and parent is None:
        raise ValueError("start_block > 0 needs the parent digest")
    data = array("I", token_ids).tobytes()
    step = 4 * block_size
    extra_first = _extra_bytes(lora_name, cache_salt, True)
    extra_rest = _extra_bytes(lora_name, cache_salt, False)
    head_first = len(extra_first).to_bytes(4, "little") + extra_first
    head_rest = len(extra_rest).to_bytes(4, "little") + extra_rest
    out: list[bytes] = []
    prev = ROOT_DIGEST if parent is None else parent
    sha = hashlib.sha256
    for i in range(start_block, len(token_ids) // block_size):
        prev = sha(prev + (head_first if i == 0 else head_rest) + data[i * step:(i + 1) * step]).digest()
        out.append(prev)
    return out


@dataclass(frozen=True, slots=True)
class StoredRun:
    """A contiguous run of newly cached blocks: ``parent`` is the digest before it (None: the chain's root)."""

    digests: tuple[bytes, ...]
    parent: bytes | None
    first_block: int  # index of the run's first block in the request's chain


@dataclass(slots=True)
class StoreResult:
    runs: list[StoredRun] = field(default_factory=list)
    evicted: list[bytes] = field(default_factory=list)
    pinned: list[bytes] = field(default_factory=list)  # what the caller must release()
    num_uncached: int = 0  # blocks that found no room


class SimBlockCache:
    """Prefix cache of one stand-in engine (module docstring for every invariant)."""

    def __init__(self, capacity_blocks: int) -> None:
        if not isinstance(capacity_blocks, int) or capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be an int >= 1, got {capacity_blocks!r}")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # unpinned, least recently used first
        self._pinned: dict[bytes, int] = {}  # digest -> ref_cnt

    # ---- queries ------------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return len(self._lru) + len(self._pinned)

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._pinned)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._pinned or digest in self._lru

    def match_prefix(self, digests: Sequence[bytes]) -> int:
        """Number of consecutive cached blocks from the start."""
        n = 0
        for d in digests:
            if d not in self:
                break
            n += 1
        return n

    # ---- updates ------------------------------------------------------------------------------
    def _pin(self, d: bytes) -> None:
        if d in self._pinned:
            self._pinned[d] += 1
        else:
            del self._lru[d]
            self._pinned[d] = 1

    def pin_prefix(self, digests: Sequence[bytes]) -> list[bytes]:
        """Pin the cached prefix of ``digests`` (a request starts using it); returns what was pinned."""
        n = self.match_prefix(digests)
        for d in digests[:n]:
            self._pin(d)
        return list(digests[:n])

    def store(self, digests: Sequence[bytes], start: int) -> StoreResult:
        """Cache ``digests[start:]`` (the blocks after the request's cached prefix), pinning each; evicts LRU
        blocks for room and stops when every cached block is pinned."""
        res = StoreResult()
        run: list[bytes] = []
        run_start = start
        for i in range(start, len(digests)):
            d = digests[i]
            if d in self:  # already cached (an orphan whose parent was evicted): reuse it, ends a run
                self._pin(d)
                res.pinned.append(d)
                if run:
                    res.runs.append(StoredRun(tuple(run), digests[run_start - 1] if run_start else None, run_start))
                    run = []
                continue
            if self.num_cached_blocks >= self.capacity_blocks:
                if not self._lru:
                    res.num_uncached = len(digests) - i
                    break
                victim, _ = self._lru.popitem(last=False)
                res.evicted.append(victim)
            self._pinned[d] = 1
            res.pinned.append(d)
            if not run:
                run_start = i
            run.append(d)
        if run:
            res.runs.append(StoredRun(tuple(run), digests[run_start - 1] if run_start else None, run_start))
        return res

    def release(self, digests: Sequence[bytes]) -> None:
        """Unpin blocks a request used; those reaching ref_cnt 0 join the LRU tail, last block first."""
        for d in reversed(digests):
            cnt = self._pinned.get(d)
            assert cnt is not None, "release of a block that is not pinned"
            if cnt > 1:
                self._pinned[d] = cnt - 1
            else:
                del self._pinned[d]
                self._lru[d] = None

    def clear(self) -> list[bytes]:
        """Drop every unpinned block (a prefix-cache reset); returns them. Pinned blocks stay."""
        gone = list(self._lru)
        self._lru.clear()
        return gone

"""Reconcile the residency index with what a tier actually holds after a restart.

Order of operations in normal running (what keeps the index from pointing at missing bytes):

- **store**: make the bytes durable first (``SsdTier.put`` returned, or the ``put_async``
  callback fired), *then* put the index entry. A crash in between leaves bytes without an entry
  (harmless: reconcile adds it back).
- **delete**: remove the index entry first (and flush the index), *then* delete the bytes. A
  crash in between leaves bytes without an entry (again harmless). A delete that was not yet
  durable in the tier may bring the block back after a crash: reconcile adds its entry back.

So after a crash the only possible disagreements are entries for blocks the tier lost (a block
whose bytes were dropped as torn or corrupt at recovery) and blocks the tier holds without an
entry. :func:`reconcile_index` fixes both, and entries whose location changed, in one pass over
the node's entries in that tier: afterwards every index entry of ``(node, tier)`` names a block
the tier holds, at the location it reports. It flushes the index before returning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from quillcache.index import IndexBackend, ResidencyEntry
from quillcache.store.keys import StoreKey
from quillcache.types import CacheTier


@dataclass(frozen=True)
class ReconcileReport:
    """How many index entries of ``(node, tier)`` reconcile kept, removed, added and moved."""

    node: str
    tier: CacheTier
    kept: int
    removed: int  # entries of blocks the tier no longer holds
    added: int  # blocks the tier holds that had no entry
    updated: int  # entries whose (segment, offset, size) changed

    @property
    def changed(self) -> int:
        return self.removed + self.added + self.updated


def reconcile_index(index: IndexBackend, node: str, tier: CacheTier,
                    live: Mapping[StoreKey, tuple[int, int, int]]) -> ReconcileReport:
    """Make the index's entries of ``(node, tier)`` equal ``live`` (key -> (segment, offset, size))."""
    if not isinstance(index, IndexBackend):
        raise TypeError(f"index must be an IndexBackend, got {type(index).__name__}")
    if not isinstance(node, str) or not node:
        raise ValueError(f"node must be a non-empty str, got {node!r}")
    tier = CacheTier(tier)
    if not isinstance(live, Mapping):
        raise TypeError(f"live must be a Mapping[StoreKey, (segment, offset, size)], got {type(live).__name__}")
    have: dict[StoreKey, ResidencyEntry] = {}
    for e in index.entries_on_node(node):
        if e.tier == tier:
            have[StoreKey(e.block_hash, e.identity)] = e
    removed = [e.key for k, e in have.items() if k not in live]
    puts: list[ResidencyEntry] = []
    added = updated = 0
    for key, loc in live.items():
        if not isinstance(key, StoreKey):
            raise TypeError(f"live keys must be StoreKey, got {type(key).__name__}")
        seg, off, size = loc
        e = have.get(key)
        if e is not None and (e.segment_id, e.offset_bytes, e.size_bytes) == (seg, off, size):
            continue
        if e is None:
            added += 1
        else:
            updated += 1
        puts.append(ResidencyEntry(key.block_hash, node, tier, key.identity, seg, off, size))
    if removed:
        index.remove(removed)
    if puts:
        index.put(puts)
    index.flush()
    kept = len(have) - len(removed) - updated
    return ReconcileReport(node, tier, kept, len(removed), added, updated)

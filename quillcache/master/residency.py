"""The master's side of the residency-index seam: object key → index records.

The master is the only writer of the residency records of the objects it manages, and it writes
them in the same ``apply`` that changes its own tables, so the planner (which reads the index) and
the master (which answers ``get_replicas`` from its tables) never disagree about a COMPLETE object:

- an object's replicas enter the index at ``put_end`` (a PENDING object is never located), and
  leave it when the object is removed, evicted or reclaimed, or its segment is unmounted/expired;
- each replica is one :class:`~quillcache.index.ResidencyEntry`: ``block_hash`` and ``identity``
  come from the key (:func:`residency_key`), node = the segment's node, tier = the segment's tier,
  and the segment id, offset and size are the replica's.

Key mapping. A key made by :func:`kv_object_key` (``"kv:<16 hex block hash>:<32 hex identity>"``)
maps to exactly that block hash and identity, so the planner locates KV blocks the master stores
under the identity that governs their reuse. Any other key maps to a 24-byte BLAKE2b digest of its
UTF-8 bytes split 8 / 16 (block hash / identity): a 192-bit name, so two keys meet in the index
only with negligible probability (2**-96 by the birthday bound at 2**48 keys).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from quillcache.index import IndexBackend, ReplicaKey, ResidencyEntry
from quillcache.types import CacheTier

__all__ = ["IndexProjection", "kv_object_key", "residency_key"]

_KV_PREFIX = "kv:"
_KV_LEN = len(_KV_PREFIX) + 16 + 1 + 32


def kv_object_key(block_hash: int, identity: bytes) -> str:
    """The object key of a KV block: ``residency_key`` maps it back to ``(block_hash, identity)``."""
    if not 0 <= block_hash < 1 << 64 or len(identity) != 16:
        raise ValueError(f"block_hash={block_hash} must be u64 and identity 16 bytes (got {len(identity)})")
    return f"{_KV_PREFIX}{block_hash:016x}:{identity.hex()}"


def residency_key(key: str) -> tuple[int, bytes]:
    """``(block_hash, identity)`` under which ``key``'s replicas are recorded in the index."""
    if len(key) == _KV_LEN and key.startswith(_KV_PREFIX) and key[19] == ":":
        try:
            return int(key[3:19], 16), bytes.fromhex(key[20:])
        except ValueError:
            pass
    d = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=24).digest()
    return int.from_bytes(d[:8], "big"), d[8:]


class IndexProjection:
    """Writes replica residency into an :class:`IndexBackend` (see the module docstring).

    ``add``/``drop`` only queue the change; ``publish`` writes the queue to the index in order and
    ``discard`` forgets it. The service publishes after its log records are committed, so the index
    never shows a replica whose ``PUT_END`` could still be lost by a crash."""

    def __init__(self, index: IndexBackend) -> None:
        self.index = index
        # (True, _Adds) runs of additions, kept as columns for IndexBackend.put_columns; (False, [ReplicaKey])
        self._queue: list[tuple[bool, object]] = []

    def add(self, key: str, replicas: Iterable[tuple[str, CacheTier, int, int, int]]) -> None:
        """Record ``(node_id, tier, segment_id, offset_bytes, size_bytes)`` replicas of ``key``."""
        h, ident = residency_key(key)
        queue = self._queue
        if queue and queue[-1][0]:
            cols = queue[-1][1]
        else:
            cols = _Adds()
            queue.append((True, cols))
        for node, tier, seg, off, size in replicas:
            cols.hashes.append(h)
            cols.identities.append(ident)
            cols.nodes.append(node)
            cols.tiers.append(tier)
            cols.segments.append(seg)
            cols.offsets.append(off)
            cols.sizes.append(size)

    def add_columns(self, keys: list[str], nodes: list[str], tiers: list, segments: list[int], offsets: list[int],
                    sizes: list[int]) -> None:
        """``add`` of many replicas as columns: replica i is ``(nodes[i], tiers[i], segments[i],
        offsets[i], sizes[i])`` of ``keys[i]`` (a key repeats once per replica, consecutively)."""
        queue = self._queue
        if queue and queue[-1][0]:
            cols = queue[-1][1]
        else:
            cols = _Adds()
            queue.append((True, cols))
        hashes, idents = cols.hashes, cols.identities
        last = None
        h = ident = None
        for key in keys:
            if key is not last:
                h, ident = residency_key(key)
                last = key
            hashes.append(h)
            idents.append(ident)
        cols.nodes += nodes
        cols.tiers += tiers
        cols.segments += segments
        cols.offsets += offsets
        cols.sizes += sizes

    def drop(self, key: str, replicas: Iterable[tuple[str, CacheTier]]) -> None:
        """Forget the ``(node_id, tier)`` replicas of ``key`` (absent ones are ignored)."""
        h, ident = residency_key(key)
        rows = [ReplicaKey(h, node, tier, ident) for node, tier in replicas]
        if self._queue and not self._queue[-1][0]:
            self._queue[-1][1].extend(rows)
        else:
            self._queue.append((False, rows))

    def publish(self) -> None:
        queue, self._queue = self._queue, []
        for is_add, rows in queue:
            if is_add:
                rows.put_into(self.index)
            else:
                self.index.remove(rows)

    def publish_missing(self) -> tuple[int, int]:
        """Publish only what the index lacks (recovery): the queue is reduced to each replica's last
        change (a put replaces, a drop deletes, so the last one decides the replica's final state),
        then replicas already present with the same segment, offset and size, and drops of replicas
        already absent, are left out. The index ends in the state ``publish`` would give, without
        writing again what a previous recovery of the same log tail already wrote (each write is
        also a record in a persistent index's own log). Returns ``(written, skipped)``."""
        queue, self._queue = self._queue, []
        final: dict[tuple, ResidencyEntry | ReplicaKey | None] = {}
        for is_add, rows in queue:
            for r in (rows.entries() if is_add else rows):
                final[(r.block_hash, r.node, int(r.tier), r.identity)] = r if is_add else None
        if not final:
            return 0, 0
        present = self._present({k[0] for k in final})
        puts, drops = [], []
        for k, r in final.items():
            have = present.get(k)
            if r is None:
                if have is not None:
                    drops.append(ReplicaKey(k[0], k[1], CacheTier(k[2]), k[3]))
            elif have != (r.segment_id, r.offset_bytes, r.size_bytes):
                puts.append(r)
        if puts:
            self.index.put(puts)
        if drops:
            self.index.remove(drops)
        return len(puts) + len(drops), len(final) - len(puts) - len(drops)

    def _present(self, hashes: set[int]) -> dict[tuple, tuple[int, int, int]]:
        """``(block_hash, node, tier, identity) -> (segment_id, offset, size)`` of every replica the
        index holds for ``hashes`` (one batched lookup)."""
        arr = np.fromiter(hashes, dtype=np.uint64, count=len(hashes))
        res = self.index.locate_arrays(arr)
        keys, vals = res.keys, res.values
        if not len(keys):
            return {}
        names = {no: self.index.node_name(no) for no in np.unique(keys["node_no"]).tolist()}
        idents = keys["identity"].tobytes()
        w = keys.dtype["identity"].itemsize
        return {(h, names[no], t, idents[i * w:(i + 1) * w]): (s, o, z)
                for i, (h, no, t, s, o, z) in enumerate(zip(
                    keys["block_hash"].tolist(), keys["node_no"].tolist(), keys["tier"].tolist(),
                    vals["segment_id"].tolist(), vals["offset_bytes"].tolist(), vals["size_bytes"].tolist()))}

    def discard(self) -> None:
        self._queue = []

    def flush(self) -> None:
        self.publish()
        self.index.flush()

    def is_empty(self) -> bool:
        return not self.index.nodes()


class _Adds:
    """A run of queued additions as columns (one list per field), written by one ``put_columns``."""

    __slots__ = ("hashes", "identities", "nodes", "tiers", "segments", "offsets", "sizes")

    def __init__(self) -> None:
        self.hashes: list[int] = []
        self.identities: list[bytes] = []
        self.nodes: list[str] = []
        self.tiers: list[int] = []
        self.segments: list[int] = []
        self.offsets: list[int] = []
        self.sizes: list[int] = []

    def put_into(self, index: IndexBackend) -> None:
        n = len(self.nodes)
        index.put_columns(np.fromiter(self.hashes, dtype=np.uint64, count=n), b"".join(self.identities), self.nodes,
                          np.fromiter(self.tiers, dtype=np.uint8, count=n),
                          np.fromiter(self.segments, dtype=np.uint32, count=n),
                          np.fromiter(self.offsets, dtype=np.uint64, count=n),
                          np.fromiter(self.sizes, dtype=np.uint32, count=n))

    def entries(self) -> list[ResidencyEntry]:
        return [ResidencyEntry(h, node, CacheTier(t), ident, seg, off, size) for h, ident, node, t, seg, off, size
                in zip(self.hashes, self.identities, self.nodes, self.tiers, self.segments, self.offsets, self.sizes)]

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
under the identity that governs their reuse (its 48 hex places must be lowercase ASCII hex digits,
the form ``kv_object_key`` writes: keys that differ only in the case of a hex digit are distinct objects
to the master, so at most one of them may own a ``(block hash, identity)``). Any other key maps to a
24-byte BLAKE2b digest of its UTF-8 bytes (lone surrogates as ``"surrogatepass"`` encodes them) split
8 / 16 (block hash / identity): a 192-bit name, so two keys meet in the index only with negligible
probability (2**-96 by the birthday bound at 2**48 keys).

:func:`residency_key` is the plain-Python reference; the projection computes keys with the compiled
``_residency.residency_keys`` / ``residency_key1`` (tested equal to it), so a batch publish does no
per-key Python work beyond the columns its caller builds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from quillcache.index import IndexBackend, ReplicaKey, ResidencyEntry
from quillcache.master._residency import residency_key1, residency_keys
from quillcache.types import CacheTier

__all__ = ["IndexProjection", "RESIDENCY_KEY_VERSION", "kv_object_key", "residency_key"]

_KV_PREFIX = "kv:"
_KV_LEN = len(_KV_PREFIX) + 16 + 1 + 32
_HEX = frozenset("0123456789abcdef")  # lowercase only (module docstring: one kv key per residency key)
RESIDENCY_KEY_VERSION = 2  # 1: kv keys of either case parsed (snapshots' res_hash/res_ident columns then differ)


def kv_object_key(block_hash: int, identity: bytes) -> str:
    """The object key of a KV block: ``residency_key`` maps it back to ``(block_hash, identity)``."""
    if not 0 <= block_hash < 1 << 64 or len(identity) != 16:
        raise ValueError(f"block_hash={block_hash} must be u64 and identity 16 bytes (got {len(identity)})")
    return f"{_KV_PREFIX}{block_hash:016x}:{identity.hex()}"


def residency_key(key: str) -> tuple[int, bytes]:
    """``(block_hash, identity)`` under which ``key``'s replicas are recorded in the index.

    The plain-Python reference of ``_residency.residency_keys`` (which the projection uses). A key is
    of the kv: form only when all 48 of its hex places are lowercase ASCII hex digits: ``int()``'s
    signs, ``0x``, underscores, whitespace and non-ASCII digits, and ``bytes.fromhex``'s whitespace,
    would otherwise give negative block hashes or short identities; upper-case digits would let two
    distinct keys share one index entry. Every other key is hashed."""
    if (len(key) == _KV_LEN and key.startswith(_KV_PREFIX) and key[19] == ":" and _HEX.issuperset(key[3:19])
            and _HEX.issuperset(key[20:])):
        return int(key[3:19], 16), bytes.fromhex(key[20:])
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
        h, ident = residency_key1(key)
        cols = self._adds()
        for node, tier, seg, off, size in replicas:
            cols.hashes.append(h)
            cols.identities.append(ident)
            cols.nodes.append(node)
            cols.tiers.append(tier)
            cols.segments.append(seg)
            cols.offsets.append(off)
            cols.sizes.append(size)

    def _adds(self) -> _Adds:
        queue = self._queue
        if queue and queue[-1][0]:
            return queue[-1][1]
        cols = _Adds()
        queue.append((True, cols))
        return cols

    def add_columns(self, keys: list[str], nodes: list[str], tiers, segments, offsets, sizes) -> None:
        """``add`` of many replicas as columns: replica i is ``(nodes[i], tiers[i], segments[i],
        offsets[i], sizes[i])`` of ``keys[i]`` (a key repeats once per replica, consecutively).
        ``tiers``/``segments``/``offsets``/``sizes`` are lists or integer arrays; the residency keys
        are computed in one compiled call (``_residency.residency_keys``)."""
        hashes, idents = residency_keys(keys)
        n = len(hashes)
        if len(nodes) != n:
            raise ValueError(f"add_columns: {n} keys but {len(nodes)} node names (one per replica)")
        cols = (hashes, idents, list(nodes), _column("tiers", tiers, np.uint8, n, True),
                _column("segments", segments, np.uint32, n), _column("offsets", offsets, np.uint64, n),
                _column("sizes", sizes, np.uint32, n))
        self._adds().add_chunk(cols)

    def add_hashed_columns(self, hashes: np.ndarray, identities: bytes, nodes: list[str], tiers, segments,
                           offsets, sizes) -> None:
        """``add_columns`` with the residency keys already computed (``hashes`` uint64 and the
        concatenated 16-byte ``identities`` of each replica's key, e.g. stored in a snapshot)."""
        n = len(hashes)
        if len(nodes) != n or len(identities) != 16 * n:
            raise ValueError(f"add_hashed_columns: {n} hashes, {len(nodes)} node names, {len(identities)} identity bytes")
        cols = (np.asarray(hashes, dtype=np.uint64), bytes(identities), list(nodes), _column("tiers", tiers, np.uint8, n, True),
                _column("segments", segments, np.uint32, n), _column("offsets", offsets, np.uint64, n),
                _column("sizes", sizes, np.uint32, n))
        self._adds().add_chunk(cols)

    def drop(self, key: str, replicas: Iterable[tuple[str, CacheTier]]) -> None:
        """Forget the ``(node_id, tier)`` replicas of ``key`` (absent ones are ignored)."""
        h, ident = residency_key1(key)
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

    def pending(self) -> bool:
        """True while queued changes have not reached the index."""
        return bool(self._queue)

    def flush(self) -> None:
        self.publish()
        self.index.flush()

    def is_empty(self) -> bool:
        return not self.index.nodes()


def _column(name: str, values, dtype, n: int, uniform: bool = False) -> np.ndarray:
    """``values`` (a list of ``n`` ints, or an integer array of ``n``) as a ``dtype`` array (so chunks
    concatenate without promotion). An array of another integer dtype is range-checked first (a value
    out of ``dtype``'s range raises ValueError naming the column; nothing wraps). ``uniform``: a list of
    one repeated object (the tiers of a one-tier batch) becomes ``np.full`` without a per-item conversion."""
    if isinstance(values, np.ndarray):
        if values.shape != (n,) or values.dtype.kind not in "ui":
            raise ValueError(f"add_columns: {name} is a {values.dtype} array of shape {values.shape}, expected "
                             f"an integer array of shape ({n},) (one value per replica)")
        if values.dtype == dtype:
            return values
        info = np.iinfo(dtype)
        if n and (int(values.min()) < 0 or int(values.max()) > info.max):
            raise ValueError(f"add_columns: {name} has a value out of range [0, {info.max}] (min {int(values.min())}, "
                             f"max {int(values.max())})")
        return values.astype(dtype)
    if uniform and n and type(values) is list and len(values) == n and values.count(values[0]) == n:
        return np.full(n, int(values[0]), dtype=dtype)
    if len(values) != n:
        raise ValueError(f"add_columns: {name} has {len(values)} values, expected {n} (one per replica)")
    return np.fromiter(values, dtype=dtype, count=n)


class _Adds:
    """A run of queued additions, written by one ``put_columns``: column chunks (``add_columns``, in
    order) and, after them, single-key rows (``add``) as lists; ``add_chunk`` first turns pending
    rows into a chunk, so the order of additions is kept."""

    __slots__ = ("chunks", "hashes", "identities", "nodes", "tiers", "segments", "offsets", "sizes")

    def __init__(self) -> None:
        self.chunks: list[tuple] = []
        self._clear_rows()

    def _clear_rows(self) -> None:
        self.hashes: list[int] = []
        self.identities: list[bytes] = []
        self.nodes: list[str] = []
        self.tiers: list[int] = []
        self.segments: list[int] = []
        self.offsets: list[int] = []
        self.sizes: list[int] = []

    def _rows_chunk(self) -> None:
        n = len(self.nodes)
        if n:
            self.chunks.append((np.fromiter(self.hashes, dtype=np.uint64, count=n), b"".join(self.identities),
                                self.nodes, np.fromiter(self.tiers, dtype=np.uint8, count=n),
                                np.fromiter(self.segments, dtype=np.uint32, count=n),
                                np.fromiter(self.offsets, dtype=np.uint64, count=n),
                                np.fromiter(self.sizes, dtype=np.uint32, count=n)))
            self._clear_rows()

    def add_chunk(self, cols: tuple) -> None:
        self._rows_chunk()
        self.chunks.append(cols)

    def columns(self) -> tuple:
        """All additions as one set of ``put_columns`` arguments."""
        self._rows_chunk()
        chunks = self.chunks
        if len(chunks) == 1:
            return chunks[0]
        if not chunks:
            return (np.empty(0, np.uint64), b"", [], np.empty(0, np.uint8), np.empty(0, np.uint32),
                    np.empty(0, np.uint64), np.empty(0, np.uint32))
        nodes: list[str] = []
        for c in chunks:
            nodes += c[2]
        return (np.concatenate([c[0] for c in chunks]), b"".join(c[1] for c in chunks), nodes,
                *(np.concatenate([c[f] for c in chunks]) for f in range(3, 7)))

    def put_into(self, index: IndexBackend) -> None:
        index.put_columns(*self.columns())

    def entries(self) -> list[ResidencyEntry]:
        hashes, idents, nodes, tiers, segs, offs, sizes = self.columns()
        return [ResidencyEntry(h, node, CacheTier(t), idents[16 * i:16 * i + 16], seg, off, size)
                for i, (h, node, t, seg, off, size) in enumerate(zip(
                    hashes.tolist(), nodes, tiers.tolist(), segs.tolist(), offs.tolist(), sizes.tolist()))]

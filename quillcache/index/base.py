"""The ``IndexBackend`` seam: block → every replica's location, over an ordered byte-key store.

A backend implements five raw primitives over byte keys (``_raw_write``, ``_raw_get``,
``_raw_scan``, ``_raw_flush``, ``_raw_close``); this class builds the residency operations on top
with the key layout of :mod:`quillcache.index.keys`, so every backend stores exactly the same
records and answers every operation of this class exactly the same way (``len`` included).

Invariants:
- For every replica there is exactly one primary and one secondary record, written in the same
  ``_raw_write`` batch (a backend applies a batch atomically with respect to ``flush``/crash).
- ``locate`` returns, per requested hash, every replica in key order: by interned node number
  (the order in which the index first saw each node name), then identity digest, then tier.
- ``len(index)`` is the number of replicas (primary records) in every backend; node-name and
  secondary records are not counted.
- After ``flush()`` returns, every earlier ``put``/``remove`` survives a crash (each backend states
  the mechanism); after ``close()`` the backend refuses further calls.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quillcache.index import keys as K
from quillcache.types import CacheTier


# Big-endian views of the fixed-length primary key and value (see keys.py), for zero-copy decoding.
PRIMARY_KEY_DTYPE = np.dtype(
    [("family", "u1"), ("block_hash", ">u8"), ("node_no", ">u4"), ("identity", "V16"), ("tier", "u1")]
)
VALUE_DTYPE = np.dtype([("segment_id", ">u4"), ("offset_bytes", ">u8"), ("size_bytes", ">u4")])
_SECONDARY_KEY_DTYPE = np.dtype(
    [("family", "u1"), ("node_no", ">u4"), ("block_hash", ">u8"), ("identity", "V16"), ("tier", "u1")]
)
assert PRIMARY_KEY_DTYPE.itemsize == _SECONDARY_KEY_DTYPE.itemsize == K.KEY_BYTES
assert VALUE_DTYPE.itemsize == K.VALUE_BYTES


@dataclass(frozen=True)
class LocateResult:
    """Every replica of each requested block, as columns (CSR): block ``j``'s replicas are rows
    ``offsets[j]:offsets[j+1]``, in key order. ``node_no`` is the index's interned node number
    (``IndexBackend.node_name(no)`` gives the name)."""

    offsets: np.ndarray  # int64, len = number of requested hashes + 1
    keys: np.ndarray  # PRIMARY_KEY_DTYPE records
    values: np.ndarray  # VALUE_DTYPE records

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def count(self, j: int) -> int:
        return int(self.offsets[j + 1] - self.offsets[j])


_TIERS = tuple(CacheTier)  # tier byte -> enum member without Enum.__call__ (hot path)
assert all(int(t) == i for i, t in enumerate(_TIERS))


RAW_RECORD_BYTES = K.KEY_BYTES + K.VALUE_BYTES


def iter_raw(packed: bytes) -> Iterator[tuple[bytes, bytes]]:
    """(primary key, value) pairs of a :meth:`IndexBackend.locate_raw` result."""
    if len(packed) % RAW_RECORD_BYTES:
        raise ValueError(f"packed records are {RAW_RECORD_BYTES} bytes each; got {len(packed)} bytes")
    for i in range(0, len(packed), RAW_RECORD_BYTES):
        yield packed[i : i + K.KEY_BYTES], packed[i + K.KEY_BYTES : i + RAW_RECORD_BYTES]


class IndexClosedError(RuntimeError):
    """The backend was closed."""


class NotAnIndexError(ValueError):
    """A path that does not hold an index of the requested kind (or holds a damaged one)."""


class IndexCorruptionError(NotAnIndexError):
    """The on-disk state is damaged in a way recovery must not guess about."""


class IndexBackend(abc.ABC):
    """Residency index over an ordered key-value store of byte keys."""

    kind: str = "abstract"

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path is not None else None
        if self.path is not None and self.path.exists() and not self.path.is_dir():
            # every backend stores a directory; a regular file here is someone else's data
            raise NotAnIndexError(f"{self.path} is a file, not an index directory: refusing to open it as a "
                                  f"{self.kind!r} index")
        self._closed = False
        self._node_no: dict[str, int] = {}
        self._node_name: dict[int, str] = {}
        self.logical_bytes_written = 0

    # ---- raw primitives (backend-specific) ---------------------------------------------------
    @abc.abstractmethod
    def _raw_write(self, puts: Sequence[tuple[bytes, bytes]], deletes: Sequence[bytes]) -> None:
        """Apply puts then deletes as one batch."""

    @abc.abstractmethod
    def _raw_get(self, key: bytes) -> bytes | None:
        """Value of one key, or None."""

    @abc.abstractmethod
    def _raw_scan(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """Every (key, value) whose key starts with ``prefix``, in ascending key order."""

    def _raw_scan_many(self, prefixes: Sequence[bytes]) -> list[list[tuple[bytes, bytes]]]:
        """Batched scans; backends override this when they can do better than a loop."""
        return [self._raw_scan(p) for p in prefixes]

    @abc.abstractmethod
    def _raw_flush(self) -> None:
        """Make every applied batch durable."""

    @abc.abstractmethod
    def _raw_close(self) -> None:
        """Release resources (flushing first)."""

    # ---- node-name interning -----------------------------------------------------------------
    def _load_node_table(self) -> None:
        for key, value in self._raw_scan(K.NODE_NAME):
            if len(value) != 4:
                raise NotAnIndexError(f"{self.path}: node table entry {key!r} has a {len(value)}-byte value")
            no = int.from_bytes(value, "big")
            name = K.node_name_from_key(key)
            self._node_no[name] = no
            self._node_name[no] = name

    def _intern(self, node: str, pending: list[tuple[bytes, bytes]]) -> int:
        no = self._node_no.get(node)
        if no is None:
            nk = K.node_name_key(node)
            no = len(self._node_no) + 1
            if no > K.U32_MAX:
                raise K.IndexKeyError("more than 2^32-1 distinct node names")
            self._node_no[node] = no
            self._node_name[no] = node
            pending.append((nk, no.to_bytes(4, "big")))
        return no

    def _check_open(self) -> None:
        if self._closed:
            raise IndexClosedError(f"{self.kind} index at {self.path} is closed")

    # ---- the seam ----------------------------------------------------------------------------
    def put(self, entries: Iterable[K.ResidencyEntry]) -> int:
        """Insert or replace replicas; returns how many entries were written."""
        self._check_open()
        puts: list[tuple[bytes, bytes]] = []
        known = len(self._node_no)
        n = 0
        try:
            for e in entries:
                if not isinstance(e, K.ResidencyEntry):
                    raise TypeError(f"put() takes ResidencyEntry objects, got {type(e).__name__}")
                h = K.check_block_hash(e.block_hash)
                ident = K.check_identity(e.identity)
                tier = K.check_tier(e.tier)
                value = K.pack_value(e.segment_id, e.offset_bytes, e.size_bytes)
                no = self._intern(e.node, puts)
                puts.append((K.primary_key(h, no, tier, ident), value))
                puts.append((K.secondary_key(h, no, tier, ident), b""))
                n += 1
            if puts:
                self._raw_write(puts, ())
        except BaseException:
            # Nothing of a refused batch is applied: forget node names interned by it.
            for no in range(known + 1, len(self._node_no) + 1):
                del self._node_no[self._node_name.pop(no)]
            raise
        self.logical_bytes_written += sum(len(k) + len(v) for k, v in puts)
        return n

    def put_columns(self, block_hashes: np.ndarray, identities: bytes, nodes: Sequence[str],
                    tiers: np.ndarray, segment_ids: np.ndarray, offsets_bytes: np.ndarray,
                    sizes_bytes: np.ndarray) -> int:
        """``put`` of ``n`` replicas given as columns (no per-replica objects): ``block_hashes`` uint64,
        ``identities`` the ``n`` 16-byte identities concatenated, ``nodes`` ``n`` node names, ``tiers``
        CacheTier values, ``segment_ids`` u32, ``offsets_bytes`` u64, ``sizes_bytes`` u32. Writes exactly
        the records ``put`` writes for the same replicas in the same order (one ``_raw_write`` batch),
        checks every field first (IndexKeyError naming the first bad one; nothing written), returns ``n``."""
        self._check_open()
        n = len(nodes)
        h = np.asarray(block_hashes)
        cols = {"tiers": np.asarray(tiers), "segment_ids": np.asarray(segment_ids),
                "offsets_bytes": np.asarray(offsets_bytes), "sizes_bytes": np.asarray(sizes_bytes)}
        if h.dtype != np.uint64 or h.shape != (n,):
            raise K.IndexKeyError(f"block_hashes must be a uint64 array of {n} (one per node name), got "
                                  f"{h.dtype} {h.shape}")
        if not isinstance(identities, (bytes, bytearray)) or len(identities) != n * K.IDENTITY_BYTES:
            got = len(identities) if isinstance(identities, (bytes, bytearray)) else type(identities).__name__
            raise K.IndexKeyError(f"identities must be {n} x {K.IDENTITY_BYTES} bytes, got {got}")
        limits = {"tiers": len(_TIERS) - 1, "segment_ids": K.U32_MAX, "offsets_bytes": K.U64_MAX,
                  "sizes_bytes": K.U32_MAX}
        for name, col in cols.items():
            if col.shape != (n,) or col.dtype.kind not in "ui":
                raise K.IndexKeyError(f"{name} must be an integer array of {n}, got {col.dtype} {col.shape}")
            if n and (int(col.min()) < 0 or int(col.max()) > limits[name]):
                raise K.IndexKeyError(f"{name} has a value out of range [0, {limits[name]}] (min {int(col.min())}, "
                                      f"max {int(col.max())})")
        if not n:
            return 0
        puts: list[tuple[bytes, bytes]] = []
        known = len(self._node_no)
        try:
            # the distinct names in first-seen order (interned in that order, as put() does); one name
            # for the whole batch (the common case) is np.full, else one C-level map over the names
            distinct = dict.fromkeys(nodes)
            for node in distinct:
                if not isinstance(node, str):
                    raise K.IndexKeyError(f"node names must be str, got {type(node).__name__}")
                K.node_name_key(node)  # checks the name as put() does
                distinct[node] = self._intern(node, puts)
            if len(distinct) == 1:
                node_nos = np.full(n, distinct[nodes[0]], dtype=np.uint32)
            else:
                node_nos = np.fromiter(map(distinct.__getitem__, nodes), dtype=np.uint32, count=n)
        except BaseException:
            for no in range(known + 1, len(self._node_no) + 1):
                del self._node_no[self._node_name.pop(no)]
            raise
        ident = np.frombuffer(bytes(identities), dtype="V16")
        pk = np.empty(n, dtype=PRIMARY_KEY_DTYPE)
        pk["family"] = K.PRIMARY[0]
        pk["block_hash"], pk["node_no"], pk["identity"], pk["tier"] = h, node_nos, ident, cols["tiers"]
        sk = np.empty(n, dtype=_SECONDARY_KEY_DTYPE)
        sk["family"] = K.SECONDARY[0]
        sk["node_no"], sk["block_hash"], sk["identity"], sk["tier"] = node_nos, h, ident, cols["tiers"]
        vals = np.empty(n, dtype=VALUE_DTYPE)
        vals["segment_id"], vals["offset_bytes"], vals["size_bytes"] = (
            cols["segment_ids"], cols["offsets_bytes"].astype(np.uint64), cols["sizes_bytes"])
        try:
            self._write_columns(puts, pk, sk, vals)
        except BaseException:
            for no in range(known + 1, len(self._node_no) + 1):
                del self._node_no[self._node_name.pop(no)]
            raise
        self.logical_bytes_written += sum(len(k) + len(v) for k, v in puts) + n * (2 * K.KEY_BYTES + K.VALUE_BYTES)
        return n

    def _write_columns(self, name_puts: list[tuple[bytes, bytes]], primary: np.ndarray, secondary: np.ndarray,
                       values: np.ndarray) -> None:
        """Write node-name records and ``n`` replicas' primary keys, secondary keys and values (packed
        arrays) in one ``_raw_write`` batch. A backend with a columnar write path overrides this."""
        pkb, skb, vb = primary.tobytes(), secondary.tobytes(), values.tobytes()
        kb, vbytes = K.KEY_BYTES, K.VALUE_BYTES
        puts = list(name_puts)
        for i in range(len(primary)):
            puts.append((pkb[i * kb:(i + 1) * kb], vb[i * vbytes:(i + 1) * vbytes]))
            puts.append((skb[i * kb:(i + 1) * kb], b""))
        self._raw_write(puts, ())

    def remove(self, replica_keys: Iterable[K.ReplicaKey | K.ResidencyEntry]) -> int:
        """Delete replicas (absent ones are ignored, without error).

        Returns how many of the given keys name a node the index knows: each of those is deleted
        if present, so an absent replica on a known node counts 1, while a key on a node the index
        never saw is skipped (counts 0, nothing is written). It is not the number of replicas
        actually removed."""
        self._check_open()
        deletes: list[bytes] = []
        for rk in replica_keys:
            if not isinstance(rk, (K.ReplicaKey, K.ResidencyEntry)):
                raise TypeError(f"remove() takes ReplicaKey or ResidencyEntry objects, got {type(rk).__name__}")
            h = K.check_block_hash(rk.block_hash)
            ident = K.check_identity(rk.identity)
            tier = K.check_tier(rk.tier)
            no = self._node_no.get(rk.node)
            if no is None:
                continue
            deletes.append(K.primary_key(h, no, tier, ident))
            deletes.append(K.secondary_key(h, no, tier, ident))
        if deletes:
            self.logical_bytes_written += sum(len(k) for k in deletes)
            self._raw_write((), deletes)
        return len(deletes) // 2

    def _entry(self, key: bytes, value: bytes) -> K.ResidencyEntry:
        h, no, tier, ident = K.unpack_primary(key)
        seg, off, size = K.unpack_value(value)
        return K.ResidencyEntry(h, self._node_name[no], _TIERS[tier], ident, seg, off, size)

    def locate_raw(self, block_hash: int) -> bytes:
        """Every replica's primary record of one block, packed: ``KEY_BYTES`` of key then
        ``VALUE_BYTES`` of value per replica, in key order (b"" if none). This is the index's own
        point-lookup cost, without per-replica Python objects; decode with :func:`iter_raw`."""
        self._check_open()
        return b"".join(k + v for k, v in self._raw_scan_many([K.block_prefix(block_hash)])[0])

    def locate(self, block_hashes: Iterable[int]) -> list[list[K.ResidencyEntry]]:
        """Every replica of each block, one list per requested hash (empty if none), in one call."""
        self._check_open()
        prefixes = [K.block_prefix(h) for h in block_hashes]
        return [[self._entry(k, v) for k, v in rows] for rows in self._raw_scan_many(prefixes)]

    def _raw_scan_many_packed(self, prefixes: Sequence[bytes]) -> tuple[bytes, bytes, np.ndarray]:
        """Concatenated keys, concatenated values and per-prefix counts of a batched scan of
        fixed-length primary records; backends override this when they can skip Python objects."""
        rows = self._raw_scan_many(prefixes)
        counts = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        return b"".join(k for r in rows for k, _ in r), b"".join(v for r in rows for _, v in r), counts

    def locate_arrays(self, block_hashes: Iterable[int] | np.ndarray) -> LocateResult:
        """``locate`` without building Python objects: the hot path of the control plane."""
        self._check_open()
        if isinstance(block_hashes, np.ndarray):
            if block_hashes.ndim != 1 or block_hashes.dtype.kind not in "ui":
                raise TypeError(f"block_hashes must be a 1-D integer array, got {block_hashes.dtype} {block_hashes.shape}")
            if block_hashes.dtype.kind == "i" and (block_hashes < 0).any():
                raise K.IndexKeyError("block hashes must be non-negative")
            prefixes_arr = np.empty((len(block_hashes), K.BLOCK_PREFIX_BYTES), dtype=np.uint8)
            prefixes_arr[:, 0] = K.PRIMARY[0]
            prefixes_arr[:, 1:] = block_hashes.astype(">u8").view(np.uint8).reshape(-1, 8)
            prefixes = [bytes(r) for r in prefixes_arr] if not self._packed_prefix_arrays else prefixes_arr
        else:
            prefixes = [K.block_prefix(h) for h in block_hashes]
        keys, values, counts = self._raw_scan_many_packed(prefixes)
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return LocateResult(
            offsets,
            np.frombuffer(keys, dtype=PRIMARY_KEY_DTYPE),
            np.frombuffer(values, dtype=VALUE_DTYPE),
        )

    # Backends whose packed scan takes an (n, 9) uint8 array of prefixes set this.
    _packed_prefix_arrays = False

    def node_name(self, node_no: int) -> str:
        return self._node_name[int(node_no)]

    def scan_prefix(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """Raw ordered scan of every record whose key starts with ``prefix``."""
        self._check_open()
        if not isinstance(prefix, (bytes, bytearray)):
            raise TypeError(f"prefix must be bytes, got {type(prefix).__name__}")
        if len(prefix) > K.KEY_BYTES:
            raise K.IndexKeyError(f"prefix of {len(prefix)} bytes is longer than a key ({K.KEY_BYTES})")
        return self._raw_scan(bytes(prefix))

    def entries_on_node(self, node: str) -> list[K.ResidencyEntry]:
        """Every replica held by ``node`` (a prefix scan of the secondary family)."""
        self._check_open()
        no = self._node_no.get(node)
        if no is None:
            return []
        out = []
        for key, _ in self._raw_scan(K.node_prefix(no)):
            h, _, tier, ident = K.unpack_secondary(key)
            value = self._raw_get(K.primary_key(h, no, tier, ident))
            if value is None:
                raise NotAnIndexError(f"{self.kind} index at {self.path}: secondary record {key.hex()} has no "
                                      f"primary record (the index is damaged)")
            seg, off, size = K.unpack_value(value)
            out.append(K.ResidencyEntry(h, node, _TIERS[tier], ident, seg, off, size))
        return out

    def remove_node(self, node: str) -> int:
        """Drop every replica on ``node`` (node failure); returns how many were removed."""
        entries = self.entries_on_node(node)
        self.remove(e.key for e in entries)
        return len(entries)

    def flush(self) -> None:
        """Make every earlier put/remove durable."""
        self._check_open()
        self._raw_flush()

    def close(self) -> None:
        """Flush and release; idempotent."""
        if not self._closed:
            self._raw_close()
            self._closed = True

    def __enter__(self) -> "IndexBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def nodes(self) -> list[str]:
        return sorted(self._node_no)

    def __len__(self) -> int:
        """The number of replicas (primary records) held; backends override this with a cheaper
        count of the same thing (this default is an O(N) scan of the primary family)."""
        self._check_open()
        return len(self._raw_scan(K.PRIMARY))

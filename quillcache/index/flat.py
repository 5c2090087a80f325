"""Flat-map backend: a Python dict with an O(N) prefix scan — the baseline the seed measured.

``locate`` is O(1) per block through a side table (block prefix → set of primary keys), which is
what any practical hash-map index would do; arbitrary prefix scans (and so "everything on node N")
walk the whole map, O(N).

Durability: none between flushes. With a path, ``flush()`` writes the whole map as one snapshot
(temp file, fsync, rename, fsync directory), so a crash loses everything since the last flush and
every flush rewrites every record (its write amplification grows with the map). A temp file left
by a crash during a flush is an unfinished flush: opening the directory removes it.

Snapshot format 2 (:func:`encode_snapshot`): ``magic "QCFLATIX" | version u16 | reserved u16 (0) |
crc32c u32 | body_len u64`` (little-endian, 24 bytes), then the body: a msgpack list of ``[key,
value]`` pairs; the crc32c covers the body. Loading refuses with :class:`NotAnIndexError`, naming
the file and loading nothing, a bad magic, an unknown version, a length or checksum mismatch, a
malformed record, and records that do not fit together (a primary without its secondary or the
reverse, a replica on a node number the node table lacks, two names on one number). Format 1 (an
unversioned msgpack map without checksum, written before format 2) is still read, with the same
record checks; the next flush rewrites it as format 2.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from pathlib import Path

import crc32c as _crc
import msgpack

from quillcache.index import keys as K
from quillcache.index.base import IndexBackend, NotAnIndexError
from quillcache.types import CacheTier

SNAPSHOT = "flat.snapshot"
_TMP = SNAPSHOT + ".tmp"
MAGIC = b"QCFLATIX"
VERSION = 2
_HEAD = struct.Struct("<8sHHIQ")  # magic, version, reserved, crc32c of the body, body length
_MAGIC_V1 = "quillcache-flat-index-v1"


def encode_snapshot(records: Sequence[tuple[bytes, bytes]] | list[list[bytes]]) -> bytes:
    """A format-2 snapshot of ``records`` (``(key, value)`` pairs), checksummed (module docstring)."""
    body = msgpack.packb(list(records), use_bin_type=True)
    return _HEAD.pack(MAGIC, VERSION, 0, _crc.crc32c(body), len(body)) + body


def _decode_records(raw: bytes) -> object:
    """The record list of a snapshot image (format 2, or the unversioned format 1); ValueError why not."""
    if raw[:8] == MAGIC:
        if len(raw) < _HEAD.size:
            raise ValueError(f"{len(raw)} bytes is too short for the {_HEAD.size}-byte header")
        _, version, reserved, crc, body_len = _HEAD.unpack_from(raw)
        if version != VERSION:
            raise ValueError(f"format version {version} is unknown (this version reads {VERSION} and 1)")
        if reserved:
            raise ValueError(f"reserved header field is {reserved}, not 0")
        body = memoryview(raw)[_HEAD.size :]
        if len(body) != body_len:
            raise ValueError(f"the header claims a {body_len}-byte body, the file holds {len(body)}")
        if _crc.crc32c(body) != crc:
            raise ValueError("checksum mismatch (the snapshot is damaged)")
        return msgpack.unpackb(body, raw=False)
    doc = msgpack.unpackb(raw, raw=False)
    if not isinstance(doc, dict) or doc.get("magic") != _MAGIC_V1:
        raise ValueError("bad magic")
    return doc["records"]


def _record_problem(rec: object) -> str | None:
    """What is wrong with one snapshot record (a ``[key, value]`` pair of bytes), or None."""
    if not (isinstance(rec, (list, tuple)) and len(rec) == 2 and all(type(x) is bytes for x in rec)):
        return f"expected a [key, value] pair of bytes, got {rec!r:.80}"
    k, v = rec
    fam = k[:1]
    if fam in (K.PRIMARY, K.SECONDARY):
        want = K.VALUE_BYTES if fam == K.PRIMARY else 0
        if len(k) != K.KEY_BYTES or len(v) != want:
            return f"a {fam!r} record needs a {K.KEY_BYTES}-byte key and a {want}-byte value, got {len(k)} and {len(v)}"
        if k[-1] >= len(CacheTier):
            return f"a {fam!r} record has tier byte {k[-1]}, not a CacheTier"
        return None
    if fam == K.NODE_NAME:
        try:
            ok = K.node_name_key(k[1:-1].decode("utf-8")) == k
        except ValueError:  # IndexKeyError or UnicodeDecodeError
            ok = False
        if not ok or len(v) != 4:
            return f"malformed node-name record {k!r:.80} -> {v!r:.20}"
        return None
    return f"unknown key family {fam!r}"


def _consistency_problem(records: list) -> str | None:
    """What breaks the base layout's pairing invariants in well-formed records, or None: every
    primary has its secondary and the reverse, every replica's node number is in the node table,
    and no two names share a number."""
    names: dict[int, bytes] = {}
    secondaries: set[bytes] = set()
    primaries: dict[bytes, None] = {}  # ordered, without the duplicates a damaged list may hold
    for k, v in records:
        fam = k[:1]
        if fam == K.PRIMARY:
            primaries[k] = None
        elif fam == K.SECONDARY:
            secondaries.add(k)
        else:
            no = int.from_bytes(v, "big")
            if no in names:
                return f"node names {names[no]!r} and {k!r:.80} share node number {no}"
            names[no] = k
    for k in primaries:
        h, no, tier, ident = K.unpack_primary(k)
        if no not in names:
            return f"primary record {k.hex()} is on node number {no}, which the node table lacks"
        sk = K.secondary_key(h, no, tier, ident)
        if sk not in secondaries:
            return f"primary record {k.hex()} has no secondary record"
        secondaries.discard(sk)
    if secondaries:
        return f"secondary record {min(secondaries).hex()} has no primary record"
    return None


class FlatIndex(IndexBackend):
    kind = "flat"

    def __init__(self, path: str | Path | None = None) -> None:
        super().__init__(path)
        self._map: dict[bytes, bytes] = self._new_map()
        self._by_block: dict[bytes, set[bytes]] = {}
        if self.path is not None:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / _TMP).unlink(missing_ok=True)  # an unfinished flush (crash before the rename)
            snap = self.path / SNAPSHOT
            if snap.exists():
                self._load(snap)
            elif any(self.path.iterdir()):
                raise NotAnIndexError(f"{self.path} is not empty and holds no {SNAPSHOT}: not a flat index")
        self._load_node_table()

    @staticmethod
    def _new_map() -> dict[bytes, bytes]:
        return {}

    def _load(self, snap: Path) -> None:
        """Read a snapshot, checking its checksum, every record's shape and the records' pairing
        first: a damaged one raises ``NotAnIndexError`` naming the file and what is wrong (the first
        bad record), and nothing is loaded."""
        try:
            records = _decode_records(snap.read_bytes())
            if not isinstance(records, list):
                raise ValueError(f"records is a {type(records).__name__}, not a list")
            for i, rec in enumerate(records):
                why = _record_problem(rec)
                if why is not None:
                    raise ValueError(f"record {i}: {why}")
            why = _consistency_problem(records)
            if why is not None:
                raise ValueError(why)
        except Exception as exc:
            raise NotAnIndexError(f"{snap} is not a valid flat-index snapshot ({exc})") from None
        for k, v in records:
            self._apply_put(k, v)

    def _apply_put(self, k: bytes, v: bytes) -> None:
        self._map[k] = v
        if k[:1] == K.PRIMARY:
            self._by_block.setdefault(k[: K.BLOCK_PREFIX_BYTES], set()).add(k)

    def _raw_write(self, puts: Sequence[tuple[bytes, bytes]], deletes: Sequence[bytes]) -> None:
        for k, v in puts:
            self._apply_put(k, v)
        for k in deletes:
            if self._map.pop(k, None) is not None and k[:1] == K.PRIMARY:
                bucket = self._by_block.get(k[: K.BLOCK_PREFIX_BYTES])
                if bucket is not None:
                    bucket.discard(k)
                    if not bucket:
                        del self._by_block[k[: K.BLOCK_PREFIX_BYTES]]

    def _raw_get(self, key: bytes) -> bytes | None:
        return self._map.get(key)

    def _raw_scan(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        # The flat map has no order: a prefix scan is a walk over every record, O(N).
        return sorted((k, v) for k, v in self._map.items() if k.startswith(prefix))

    def _raw_scan_many(self, prefixes: Sequence[bytes]) -> list[list[tuple[bytes, bytes]]]:
        # locate(): whole-block prefixes are answered from the side table, O(replicas).
        out = []
        for p in prefixes:
            if len(p) == K.BLOCK_PREFIX_BYTES and p[:1] == K.PRIMARY:
                out.append([(k, self._map[k]) for k in sorted(self._by_block.get(p, ()))])
            else:
                out.append(self._raw_scan(p))
        return out

    def _raw_flush(self) -> None:
        if self.path is None:
            return
        payload = encode_snapshot(list(self._map.items()))
        tmp = self.path / _TMP
        with open(tmp, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path / SNAPSHOT)
        dfd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _raw_close(self) -> None:
        self._raw_flush()
        self._map.clear()
        self._by_block.clear()

    def __len__(self) -> int:
        """The number of replicas (primary records), as every backend counts (O(blocks))."""
        self._check_open()
        return sum(map(len, self._by_block.values()))

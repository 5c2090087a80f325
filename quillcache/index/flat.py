"""Flat-map backend: a Python dict with an O(N) prefix scan — the baseline the seed measured.

``locate`` is O(1) per block through a side table (block prefix → set of primary keys), which is
what any practical hash-map index would do; arbitrary prefix scans (and so "everything on node N")
walk the whole map, O(N).

Durability: none between flushes. With a path, ``flush()`` writes the whole map as one msgpack
snapshot (temp file, fsync, rename, fsync directory), so a crash loses everything since the last
flush and every flush rewrites every record (its write amplification grows with the map).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import msgpack

from quillcache.index import keys as K
from quillcache.index.base import IndexBackend, NotAnIndexError

SNAPSHOT = "flat.snapshot"
_MAGIC = "quillcache-flat-index-v1"


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


class FlatIndex(IndexBackend):
    kind = "flat"

    def __init__(self, path: str | Path | None = None) -> None:
        super().__init__(path)
        self._map: dict[bytes, bytes] = self._new_map()
        self._by_block: dict[bytes, set[bytes]] = {}
        if self.path is not None:
            self.path.mkdir(parents=True, exist_ok=True)
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
        """Read a snapshot, checking every record's shape first: a damaged one raises
        ``NotAnIndexError`` naming the file and the first bad record, and nothing is loaded."""
        try:
            doc = msgpack.unpackb(snap.read_bytes(), raw=False)
            if not isinstance(doc, dict) or doc.get("magic") != _MAGIC:
                raise ValueError("bad magic")
            records = doc["records"]
            if not isinstance(records, list):
                raise ValueError(f"records is a {type(records).__name__}, not a list")
            for i, rec in enumerate(records):
                why = _record_problem(rec)
                if why is not None:
                    raise ValueError(f"record {i}: {why}")
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
        payload = msgpack.packb({"magic": _MAGIC, "records": list(self._map.items())}, use_bin_type=True)
        tmp = self.path / (SNAPSHOT + ".tmp")
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

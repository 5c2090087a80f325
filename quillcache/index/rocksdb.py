"""RocksDB backend through ``rocksdict`` (raw mode): the LSM baseline.

Tuning (stated, so the study is reproducible):
- a fixed 9-byte prefix extractor (family byte + block hash) with a memtable prefix bloom and
  a 10-bit-per-key block-based bloom filter: ``locate`` seeks inside one block's prefix and skips
  SST files that cannot hold it; scans of other prefixes (the 5-byte node prefix, the node table)
  use ``total_order_seek``;
- a 64 MiB block cache, 64 MiB write buffer, LZ4 compression off (values are 16 bytes of
  high-entropy integers), level-style compaction with dynamic level bytes;
- writes go through one ``WriteBatch`` per call with the WAL on and ``sync=False``; ``flush()``
  syncs the WAL (``flush_wal(sync=True)``), which is the durability point.

Damage: RocksDB ends an iteration on an error (a block checksum mismatch in an SST file) the same way
it ends one at the last key, so every scan checks the iterator's status afterwards and raises
``IndexCorruptionError`` with RocksDB's message (which names the file): a damaged index never answers
"nothing there". A point read raises the same error.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import rocksdict as rd

from quillcache.index import keys as K
from quillcache.index.base import IndexBackend, IndexCorruptionError, NotAnIndexError


def _options(create: bool) -> rd.Options:
    opts = rd.Options(raw_mode=True)
    opts.create_if_missing(create)
    opts.set_prefix_extractor(rd.SliceTransform.create_fixed_prefix(K.BLOCK_PREFIX_BYTES))
    opts.set_memtable_prefix_bloom_ratio(0.1)
    table = rd.BlockBasedOptions()
    table.set_bloom_filter(10, False)
    table.set_block_cache(rd.Cache(64 << 20))
    opts.set_block_based_table_factory(table)
    opts.set_write_buffer_size(64 << 20)
    opts.set_compression_type(rd.DBCompressionType.none())
    opts.set_level_compaction_dynamic_level_bytes(True)
    opts.increase_parallelism(2)
    opts.enable_statistics()
    return opts


class RocksDbIndex(IndexBackend):
    kind = "rocksdb"

    def __init__(self, path: str | Path | None = None, *, create: bool = True) -> None:
        if path is None:
            raise ValueError("the rocksdb index needs a directory path")
        super().__init__(path)
        p = self.path
        assert p is not None
        if p.exists() and any(p.iterdir()) and not (p / "CURRENT").exists():
            raise NotAnIndexError(f"{p} is not empty and holds no RocksDB database (no CURRENT file)")
        self._opts = _options(create)
        try:
            self._db = rd.Rdict(str(p), options=self._opts)
        except Exception as exc:
            raise NotAnIndexError(f"{p}: cannot open as a RocksDB index ({exc})") from None
        self._prefix_ro = rd.ReadOptions()
        self._prefix_ro.set_prefix_same_as_start(True)
        self._total_ro = rd.ReadOptions()
        self._total_ro.set_total_order_seek(True)
        self._wo = rd.WriteOptions()
        self._load_node_table()

    def _raw_write(self, puts: Sequence[tuple[bytes, bytes]], deletes: Sequence[bytes]) -> None:
        wb = rd.WriteBatch(raw_mode=True)
        for k, v in puts:
            wb.put(k, v)
        for k in deletes:
            wb.delete(k)
        self._db.write(wb, self._wo)

    def _damaged(self, exc: Exception) -> IndexCorruptionError:
        return IndexCorruptionError(f"{self.path}: the RocksDB index is damaged ({exc})")

    def _raw_get(self, key: bytes) -> bytes | None:
        try:
            return self._db.get(key)
        except Exception as exc:  # rocksdict raises a bare Exception carrying RocksDB's status
            raise self._damaged(exc) from None

    def _scan_with(self, it, prefix: bytes) -> list[tuple[bytes, bytes]]:
        out = []
        it.seek(prefix)
        while it.valid():
            k = it.key()
            if not k.startswith(prefix):
                break
            out.append((k, it.value()))
            it.next()
        try:
            it.status()  # an iteration ended by an error looks like one ended at the last key
        except Exception as exc:
            raise self._damaged(exc) from None
        return out

    def _raw_scan(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        in_domain = len(prefix) == K.BLOCK_PREFIX_BYTES
        it = self._db.iter(self._prefix_ro if in_domain else self._total_ro)
        return self._scan_with(it, prefix)

    def _raw_scan_many(self, prefixes: Sequence[bytes]) -> list[list[tuple[bytes, bytes]]]:
        it_prefix = None
        out = []
        for p in prefixes:
            if len(p) == K.BLOCK_PREFIX_BYTES:
                if it_prefix is None:
                    it_prefix = self._db.iter(self._prefix_ro)
                out.append(self._scan_with(it_prefix, p))
            else:
                out.append(self._raw_scan(p))
        return out

    def _raw_flush(self) -> None:
        self._db.flush_wal(True)

    def _raw_close(self) -> None:
        self._db.flush_wal(True)
        self._db.close()

    def statistics(self) -> str:
        """RocksDB's own statistics dump (bytes written, compaction bytes, ...)."""
        return self._db.property_value("rocksdb.stats") or ""

    def ticker_counts(self) -> dict[str, int]:
        """RocksDB statistics tickers (``name COUNT : n`` lines of ``Options.get_statistics()``)."""
        out: dict[str, int] = {}
        for line in (self._opts.get_statistics() or "").splitlines():
            parts = line.split()
            if len(parts) == 4 and parts[1] == "COUNT" and parts[2] == ":":
                out[parts[0]] = int(parts[3])
        return out

    def property_int(self, name: str) -> int | None:
        return self._db.property_int_value(name)

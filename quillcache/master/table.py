"""The object table: a dict of :class:`ObjectRecord` that a snapshot fills lazily, from columns.

A restart must not build a million Python objects before serving, so a loaded snapshot stays in
its columns (numpy arrays + the key list) and the table maps each key to its row; a row becomes an
:class:`ObjectRecord` the first time it is looked up, changed or iterated over (``get``, ``pop``,
``values``...). Invariants: a key is in exactly one of ``_rows`` (not yet materialized) and
``_objs``; a materialized row is never read from the columns again; ``columns()`` gives the
current table as columns (unmaterialized rows copied with numpy, the others from their records),
which is what a snapshot writes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from quillcache.master._kernels import ObjectRecord, record_columns  # C fields; positional constructor (see _kernels)

__all__ = ["COLUMN_DTYPES", "ObjectRecord", "ObjectTable"]

_COMPLETE = 2  # ObjectStatus.COMPLETE (types.py; not imported to keep this module a leaf)

# column name -> dtype of the per-object columns of a snapshot
COLUMN_DTYPES = {"size": "<i8", "alloc": "<i8", "status": "u1", "put_id": "<i8", "started": "<f8",
                 "completed": "<f8", "pin": "u1", "soft_pin_end": "<f8"}


class ObjectTable:
    """Dict-like ``key -> ObjectRecord`` (module docstring)."""

    def __init__(self) -> None:
        self._objs: dict[str, ObjectRecord] = {}
        self._rows: dict[str, int] = {}
        self._cols: dict[str, np.ndarray] = {}
        self._keys: list[str] = []
        self._digests: dict[int, bytes] = {}
        self._rep_start = np.zeros(1, dtype=np.int64)
        self.lease_floor_s = -math.inf  # lease_end of rows materialized from the snapshot

    # ---------------------------------------------------------------- loading
    def load_columns(self, keys: list[str], cols: dict[str, np.ndarray], rep_count: np.ndarray,
                     rep_seg: np.ndarray, rep_off: np.ndarray, digests: dict[int, bytes]) -> None:
        assert not self._objs and not self._rows
        self._keys = keys
        self._cols = dict(cols, rep_seg=rep_seg, rep_off=rep_off, rep_count=rep_count)
        self._rep_start = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum(rep_count, out=self._rep_start[1:])
        self._digests = digests
        self._rows = dict(zip(keys, range(len(keys))))

    def _materialize(self, key: str, row: int) -> ObjectRecord:
        c = self._cols
        a, b = int(self._rep_start[row]), int(self._rep_start[row + 1])
        replicas = tuple(zip(c["rep_seg"][a:b].tolist(), c["rep_off"][a:b].tolist()))
        completed = float(c["completed"][row])
        status = int(c["status"][row])
        lease_end = self.lease_floor_s if status == _COMPLETE else -math.inf
        obj = ObjectRecord(key, int(c["size"][row]), int(c["alloc"][row]), status, replicas,
                           int(c["put_id"][row]), float(c["started"][row]), completed, lease_end,
                           completed, int(c["pin"][row]), float(c["soft_pin_end"][row]), self._digests.get(row))
        self._objs[key] = obj
        return obj

    def _materialize_all(self) -> None:
        for key, row in list(self._rows.items()):
            self._materialize(key, row)
        self._rows.clear()

    # ---------------------------------------------------------------- dict protocol
    def get(self, key: str, default=None):
        obj = self._objs.get(key)
        if obj is not None or not self._rows:
            return default if obj is None else obj
        row = self._rows.pop(key, None)
        return default if row is None else self._materialize(key, row)

    def __getitem__(self, key: str) -> ObjectRecord:
        obj = self.get(key)
        if obj is None:
            raise KeyError(key)
        return obj

    def __setitem__(self, key: str, obj: ObjectRecord) -> None:
        if self._rows:
            self._rows.pop(key, None)
        self._objs[key] = obj

    def getter(self):
        """A callable equal to ``get`` for the table's lifetime from now on: the dict's own ``get`` when
        no row is left unmaterialized (rows are never added back), else ``get``."""
        return self.get if self._rows else self._objs.get

    def put_new(self, keys: list[str], objs: list[ObjectRecord]) -> None:
        """``self[keys[i]] = objs[i]`` for every i (one dict update)."""
        if self._rows:
            rows = self._rows
            for key in keys:
                rows.pop(key, None)
        self._objs.update(zip(keys, objs))

    def present_among(self, keys: list[str]) -> set[str]:
        """The keys of ``keys`` that the table holds (set operations, no per-key lookup in Python)."""
        out = self._objs.keys() & keys
        if self._rows:
            out |= self._rows.keys() & keys
        return out

    def pop(self, key: str) -> ObjectRecord:
        obj = self.get(key)
        if obj is None:
            raise KeyError(key)
        return self._objs.pop(key)

    def __delitem__(self, key: str) -> None:
        self.pop(key)

    def __contains__(self, key: object) -> bool:
        return key in self._objs or key in self._rows

    def __len__(self) -> int:
        return len(self._objs) + len(self._rows)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._objs) + list(self._rows))

    def keys(self) -> list[str]:
        return list(self)

    def values(self):
        self._materialize_all()
        return self._objs.values()

    def items(self):
        self._materialize_all()
        return self._objs.items()

    @property
    def num_materialized(self) -> int:
        return len(self._objs)

    def materialized(self):
        """The records built so far (not the unmaterialized rows)."""
        return self._objs.values()

    # ---------------------------------------------------------------- columns
    def _rows_replicas(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For unmaterialized ``rows`` (sorted): their replica counts (int64) and the positions of their
        replicas in the ``rep_*`` columns, in row order."""
        counts = self._cols["rep_count"][rows].astype(np.int64)
        starts = self._rep_start[rows]
        idx = np.repeat(starts - np.concatenate(([0], np.cumsum(counts)[:-1])), counts) + np.arange(counts.sum())
        return counts, idx

    def unmaterialized_rows(self) -> np.ndarray:
        return np.fromiter(self._rows.values(), dtype=np.int64, count=len(self._rows))

    def count_status(self, status: int) -> int:
        n = sum(1 for o in self._objs.values() if o.status == status)
        if self._rows:
            n += int(np.count_nonzero(self._cols["status"][self.unmaterialized_rows()] == status))
        return n

    def replica_ranges(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(segment_ids, offsets, alloc_bytes)`` of every replica in the table, as arrays."""
        segs, offs, allocs = [], [], []
        for o in self._objs.values():
            for s, off in o.replicas:
                segs.append(s)
                offs.append(off)
                allocs.append(o.alloc_bytes)
        parts = [(np.asarray(segs, dtype=np.int64), np.asarray(offs, dtype=np.int64),
                  np.asarray(allocs, dtype=np.int64))]
        if self._rows:
            c = self._cols
            rows = np.sort(self.unmaterialized_rows())
            counts, idx = self._rows_replicas(rows)
            parts.append((c["rep_seg"][idx].astype(np.int64), c["rep_off"][idx].astype(np.int64),
                          np.repeat(c["alloc"][rows], counts)))
        return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]

    def complete_replicas(self) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        """Every replica of every COMPLETE object as columns ``(keys, segment_ids, offsets, sizes)``
        (one entry per replica, an object's replicas consecutive; materialized records first, then the
        unmaterialized rows in snapshot order): what the residency index holds for this table."""
        keys: list[str] = []
        segs: list[int] = []
        offs: list[int] = []
        sizes: list[int] = []
        for o in self._objs.values():
            if o.status == _COMPLETE:
                for s, off in o.replicas:
                    keys.append(o.key)
                    segs.append(s)
                    offs.append(off)
                    sizes.append(o.size_bytes)
        seg_a = np.asarray(segs, dtype=np.int64)
        off_a = np.asarray(offs, dtype=np.int64)
        size_a = np.asarray(sizes, dtype=np.int64)
        if self._rows:
            c = self._cols
            rows = np.sort(self.unmaterialized_rows())
            rows = rows[c["status"][rows] == _COMPLETE]
            counts, idx = self._rows_replicas(rows)
            per_rep = np.repeat(rows, counts)
            all_keys = self._keys
            keys += [all_keys[r] for r in per_rep.tolist()]
            seg_a = np.concatenate([seg_a, c["rep_seg"][idx].astype(np.int64)])
            off_a = np.concatenate([off_a, c["rep_off"][idx].astype(np.int64)])
            size_a = np.concatenate([size_a, c["size"][per_rep].astype(np.int64)])
        return keys, seg_a, off_a, size_a

    def columns(self) -> tuple[list[str], dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray, dict[int, bytes]]:
        """The whole table as ``(keys, cols, rep_count, rep_seg, rep_off, digests)`` (rows: materialized
        records first, then the unmaterialized rows in their snapshot order)."""
        keys, cols, rep_count, rep_seg, rep_off, digests = record_columns(list(self._objs.values()))
        return self._with_rows(keys, cols, rep_count, rep_seg, rep_off, digests)

    def _columns_py(self) -> tuple[list[str], dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray, dict[int, bytes]]:
        """``columns()`` in plain Python (the reference of ``_kernels.record_columns``)."""
        objs = list(self._objs.values())
        keys = [o.key for o in objs]
        cols = {
            "size": np.fromiter((o.size_bytes for o in objs), "<i8", len(objs)),
            "alloc": np.fromiter((o.alloc_bytes for o in objs), "<i8", len(objs)),
            "status": np.fromiter((o.status for o in objs), "u1", len(objs)),
            "put_id": np.fromiter((o.put_id for o in objs), "<i8", len(objs)),
            "started": np.fromiter((o.started_s for o in objs), "<f8", len(objs)),
            "completed": np.fromiter((o.completed_s for o in objs), "<f8", len(objs)),
            "pin": np.fromiter((o.pin for o in objs), "u1", len(objs)),
            "soft_pin_end": np.fromiter((o.soft_pin_end_s for o in objs), "<f8", len(objs)),
        }
        rep_count = np.fromiter((len(o.replicas) for o in objs), "u1", len(objs))
        rep_seg = np.asarray([s for o in objs for s, _ in o.replicas], dtype="<u4")
        rep_off = np.asarray([off for o in objs for _, off in o.replicas], dtype="<i8")
        digests = {i: o.digest for i, o in enumerate(objs) if o.digest is not None}
        return self._with_rows(keys, cols, rep_count, rep_seg, rep_off, digests)

    def _with_rows(self, keys: list[str], cols: dict[str, np.ndarray], rep_count: np.ndarray, rep_seg: np.ndarray,
                   rep_off: np.ndarray, digests: dict[int, bytes]) -> tuple:
        """The materialized records' columns followed by the unmaterialized rows' (in snapshot order)."""
        if self._rows:
            c = self._cols
            rows = np.sort(self.unmaterialized_rows())
            base = len(keys)
            keys += [self._keys[r] for r in rows.tolist()]
            for name in cols:
                cols[name] = np.concatenate([cols[name], c[name][rows]])
            counts = c["rep_count"][rows]
            _, idx = self._rows_replicas(rows)
            rep_count = np.concatenate([rep_count, counts])
            rep_seg = np.concatenate([rep_seg, c["rep_seg"][idx]])
            rep_off = np.concatenate([rep_off, c["rep_off"][idx]])
            if self._digests:
                pos = {r: base + i for i, r in enumerate(rows.tolist())}
                digests.update({pos[r]: d for r, d in self._digests.items() if r in pos})
        return keys, cols, rep_count, rep_seg, rep_off, digests

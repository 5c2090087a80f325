"""Columnar batch results of the master: ``PutColumns`` (``batch_put_start_columns``) and
``ReplicaColumns`` (``get_replicas_columns``).

A batch of N keys answers with N-long arrays plus one flat array pair for the replicas, instead of
N Python objects, so a batch costs the master, the wire and the client a few array copies rather
than N object constructions (Mooncake's batch calls take and return parallel arrays the same way).

Layout (both types): key ``i`` has ``counts[i]`` replicas, the ``counts[i]`` entries of
``segment_ids`` / ``offsets`` from ``starts()[i]``; ``sizes[i]`` is its size in bytes. A key that
failed has ``counts[i] == 0`` and its :class:`~quillcache.master.errors.MasterError` in
``errors[i]``; a key that did not fail has ``counts[i] >= 1`` (an object always has a replica).
``segments`` maps every segment id the replicas name to ``(node_id, endpoint, transport,
region_id)``, so ``result(i)`` / ``replicas(i)`` rebuild exactly the value the per-object methods
(``batch_put_start`` / ``get_replicas``) return for that key (tested). :func:`concat_columns` joins
the columns of consecutive calls (a batch the client split) into the columns of all their keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from quillcache.master.errors import InvalidParamsError, MasterError
from quillcache.master.types import PutStartResult, ReplicaDescriptor

__all__ = ["PutColumns", "ReplicaColumns", "columns_from_rows", "concat_columns"]

# array field -> dtype on the wire and in memory
PUT_DTYPES = {"put_ids": "<i8", "existing": "?", "counts": "u1", "segment_ids": "<u4", "offsets": "<i8",
              "sizes": "<i8"}
REPLICA_DTYPES = {"counts": "u1", "segment_ids": "<u4", "offsets": "<i8", "sizes": "<i8"}


def _where(segments) -> dict[int, tuple]:
    if isinstance(segments, dict):
        return segments
    return {int(row[0]): (row[1], row[2], row[3], row[4]) for row in segments}


@dataclass(slots=True, eq=False)
class _Replicas:
    counts: np.ndarray
    segment_ids: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    errors: dict[int, MasterError] = field(default_factory=dict)
    segments: dict[int, tuple] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.counts)

    def starts(self) -> np.ndarray:
        """``starts()[i]``: the index in ``segment_ids`` / ``offsets`` of key ``i``'s first replica."""
        out = np.zeros(len(self.counts) + 1, dtype=np.int64)
        np.cumsum(self.counts, out=out[1:])
        return out

    def _descriptors(self, i: int, start: int) -> tuple[ReplicaDescriptor, ...]:
        size = int(self.sizes[i])
        out = []
        for j in range(start, start + int(self.counts[i])):
            s = int(self.segment_ids[j])
            node, endpoint, transport, region = self.segments[s]
            out.append(ReplicaDescriptor(node, s, endpoint, transport, region, int(self.offsets[j]), size))
        return tuple(out)

    def ok(self) -> np.ndarray:
        """Boolean mask of the keys that did not fail."""
        mask = np.ones(len(self.counts), dtype=bool)
        if self.errors:
            mask[list(self.errors)] = False
        return mask

    def check(self) -> None:
        """Raise InvalidParamsError when the arrays do not fit the layout (module docstring)."""
        n = len(self.counts)
        if len(self.sizes) != n:
            raise InvalidParamsError(f"columns: {n} counts but {len(self.sizes)} sizes")
        total = int(self.counts.sum(dtype=np.int64))
        if len(self.segment_ids) != total or len(self.offsets) != total:
            raise InvalidParamsError(f"columns: counts sum to {total} but there are {len(self.segment_ids)} "
                                     f"segment ids and {len(self.offsets)} offsets")
        for i in self.errors:
            if not 0 <= i < n or self.counts[i]:
                raise InvalidParamsError(f"columns: error at row {i} of {n}, which has replicas or does not exist")
        if n - len(self.errors) != int(np.count_nonzero(self.counts)):
            raise InvalidParamsError("columns: a row without replicas has no error")
        missing = set(np.unique(self.segment_ids).tolist()) - set(self.segments)
        if missing:
            raise InvalidParamsError(f"columns: segments {sorted(missing)} are named but not described")


@dataclass(slots=True, eq=False)
class ReplicaColumns(_Replicas):
    """``get_replicas(keys)`` as columns (module docstring)."""

    def replicas(self, i: int) -> tuple[ReplicaDescriptor, ...] | MasterError:
        """Key ``i``'s value in ``get_replicas``: its descriptors or its error."""
        err = self.errors.get(i)
        if err is not None:
            return err
        return self._descriptors(i, int(self.counts[:i].sum(dtype=np.int64)))

    def to_list(self) -> list:
        """``get_replicas(keys)``'s value."""
        starts = self.starts().tolist()
        errors = self.errors
        return [errors[i] if i in errors else self._descriptors(i, starts[i]) for i in range(len(self.counts))]


@dataclass(slots=True, eq=False)
class PutColumns(_Replicas):
    """``batch_put_start`` as columns (module docstring); ``put_ids[i]`` and ``existing[i]`` as in
    :class:`~quillcache.master.types.PutStartResult` (``-1`` / False for a key that failed)."""

    put_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    existing: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    def result(self, i: int) -> PutStartResult | MasterError:
        """Key ``i``'s value in ``batch_put_start``: its PutStartResult or its error."""
        err = self.errors.get(i)
        if err is not None:
            return err
        return PutStartResult(self._descriptors(i, int(self.counts[:i].sum(dtype=np.int64))), int(self.put_ids[i]),
                              bool(self.existing[i]))

    def to_list(self) -> list:
        """``batch_put_start``'s value."""
        starts = self.starts().tolist()
        errors = self.errors
        return [errors[i] if i in errors else PutStartResult(self._descriptors(i, starts[i]), int(self.put_ids[i]),
                                                             bool(self.existing[i]))
                for i in range(len(self.counts))]


def columns_from_rows(segments, rows: list, *, put: bool) -> PutColumns | ReplicaColumns:
    """The columns of a compact result (``batch_put_start_compact`` when ``put``: rows ``[put_id,
    existing, size, seg, off, ...]``; else ``get_replicas_compact``: rows ``[size, seg, off, ...]``),
    each row a list or a MasterError. The reference the fast paths are tested against."""
    n = len(rows)
    first = 3 if put else 1
    counts = np.zeros(n, dtype=np.uint8)
    sizes = np.zeros(n, dtype=np.int64)
    put_ids = np.full(n, -1, dtype=np.int64)
    existing = np.zeros(n, dtype=bool)
    segs: list[int] = []
    offs: list[int] = []
    errors: dict[int, MasterError] = {}
    for i, row in enumerate(rows):
        if isinstance(row, BaseException):
            errors[i] = row
            continue
        if put:
            put_ids[i] = row[0]
            existing[i] = row[1]
        sizes[i] = row[first - 1]
        counts[i] = (len(row) - first) // 2
        segs += row[first::2]
        offs += row[first + 1::2]
    seg_arr = np.asarray(segs, dtype=np.uint32)
    off_arr = np.asarray(offs, dtype=np.int64)
    if put:
        return PutColumns(counts, seg_arr, off_arr, sizes, errors, _where(segments), put_ids, existing)
    return ReplicaColumns(counts, seg_arr, off_arr, sizes, errors, _where(segments))


def concat_columns(parts: list) -> PutColumns | ReplicaColumns:
    """The columns of the keys of ``parts`` (one type, non-empty list) in order: arrays joined, each part's error
    rows moved past the keys before it, segment descriptions merged."""
    first = parts[0]
    if len(parts) == 1:
        return first
    errors: dict[int, MasterError] = {}
    segments: dict[int, tuple] = {}
    base = 0
    for part in parts:
        errors.update((base + i, e) for i, e in part.errors.items())
        segments.update(part.segments)
        base += len(part)

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in parts])

    if isinstance(first, PutColumns):
        return PutColumns(cat("counts"), cat("segment_ids"), cat("offsets"), cat("sizes"), errors, segments,
                          cat("put_ids"), cat("existing"))
    return ReplicaColumns(cat("counts"), cat("segment_ids"), cat("offsets"), cat("sizes"), errors, segments)

"""The master's state machine: tables of segments, clients and objects, changed only by ``apply``.

``MasterState.apply(record)`` is deterministic: the same records applied in the same order to the
same snapshot give the same tables (the records carry every decision and the clock value used; see
:mod:`quillcache.master.oplog`). Restart = load the latest snapshot + apply the log tail; a standby
would apply the leader's records the same way.

Invariants (checked by ``check_invariants``, which the tests call after every step):
- every replica ``(segment_id, offset)`` of an object or of a discarded zombie put lies in a mounted
  segment, and the ranges on one segment never overlap; ``used_bytes`` of a segment is the sum of
  the ``alloc_bytes`` of the ranges on it;
- the replicas of an object are on distinct nodes; an object has at least one replica;
- a COMPLETE object's replicas are in the residency index, a PENDING one's are not;
- while ``space_attached`` (always, except during recovery), each segment's OffsetAllocator holds
  exactly those ranges (``handles``: offset → allocator handle), so it can place new puts.

Soft state, not logged (so reads and pings never wait for a disk): read leases, last-access times
and client heartbeats. After recovery every COMPLETE object is leased for one lease TTL (a reader
that held a lease before the crash is still protected), its last access is its completion time,
and every registered client is considered seen at the restart time.
"""

from __future__ import annotations

import gc
import math
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from quillcache.alloc import OffsetAllocator, OutOfSpaceError
from quillcache.master._kernels import HandleMap, all_new, end_apply, new_records
from quillcache.master.errors import StaleEpochError
from quillcache.master.oplog import Op
from quillcache.master.residency import IndexProjection
from quillcache.master.table import ObjectRecord, ObjectTable
from quillcache.master.types import DEFAULT_MAX_FORGOTTEN, ObjectStatus, PinKind, SegmentDescriptor
from quillcache.types import CacheTier

__all__ = ["FORGOTTEN_MAX_BYTES", "MasterState", "ObjectRecord", "SegmentRecord", "pause_gc"]

FORGOTTEN_MAX_BYTES = 32 << 20  # the forgotten keys' (UTF-8) and digests' bytes together (a snapshot carries them)


def _utf8_len(key: str) -> int:
    return len(key) if key.isascii() else len(key.encode("utf-8", "surrogatepass"))

_PENDING = int(ObjectStatus.PENDING)
_COMPLETE = int(ObjectStatus.COMPLETE)
_SOFT = int(PinKind.SOFT)


def pause_gc(n: int) -> bool:
    """Pause the cyclic collector for a batch call of ``n`` items (its records are acyclic; collections
    in the middle of a batch only rescan the tables); True when the caller must re-enable it."""
    if n > 64 and gc.isenabled():
        gc.disable()
        return True
    return False


class SegmentHandles:
    """Allocator handle per live range start (offset -> handle): a bulk part rebuilt at recovery
    (sorted numpy arrays, so no million-entry dict is built) plus a dict for later allocations."""

    __slots__ = ("_extra", "_offs", "_hs", "_live", "_num_bulk")

    def __init__(self, offsets: np.ndarray | None = None, handles: np.ndarray | None = None) -> None:
        self._extra = HandleMap()  # (compiled; a dict is its reference)
        self._offs = offsets if offsets is not None else np.zeros(0, dtype=np.int64)
        self._hs = handles if handles is not None else np.zeros(0, dtype=np.int64)
        self._live = np.ones(len(self._offs), dtype=bool)
        self._num_bulk = len(self._offs)

    def _bulk_index(self, off: int) -> int:
        if not self._num_bulk:
            return -1
        i = int(np.searchsorted(self._offs, off))
        return i if i < len(self._offs) and self._offs[i] == off and self._live[i] else -1

    def __contains__(self, off: int) -> bool:
        return off in self._extra or self._bulk_index(off) >= 0

    def __setitem__(self, off: int, handle: int) -> None:
        assert off not in self, f"offset {off} is already live"
        self._extra[off] = handle

    @property
    def fresh(self) -> HandleMap:
        """The map of later allocations: an offset the allocator just handed out is not live, so a
        caller may store ``fresh[offset] = handle``, or a batch with ``fresh.put_batch(offsets,
        handles)`` (int64 arrays), directly (what ``__setitem__`` does after checking)."""
        return self._extra

    def pop(self, off: int) -> int:
        h = self._extra.pop(off, None)
        if h is not None:
            return h
        i = self._bulk_index(off)
        assert i >= 0, f"no live allocation at offset {off}"
        self._live[i] = False
        self._num_bulk -= 1
        return int(self._hs[i])

    def __len__(self) -> int:
        return len(self._extra) + self._num_bulk

    def offsets(self) -> list[int]:
        return sorted(list(self._extra) + self._offs[self._live].tolist())


class SegmentRecord:
    __slots__ = ("desc", "capacity_bytes", "used_bytes", "alloc", "handles", "alignment")

    def __init__(self, desc: SegmentDescriptor, alignment: int) -> None:
        self.desc = desc
        self.alignment = alignment
        self.capacity_bytes = desc.capacity_bytes // alignment * alignment
        self.used_bytes = 0
        self.alloc: OffsetAllocator | None = None
        self.handles = SegmentHandles()

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes


class MasterState:
    """Tables + ``apply`` (module docstring). ``alignment`` and ``max_allocs`` shape the allocators."""

    def __init__(self, *, alignment: int, max_allocs: int, index: IndexProjection,
                 lease_ttl_s: float) -> None:
        self.alignment = alignment
        self.max_allocs = max_allocs
        self.index = index
        self.lease_ttl_s = lease_ttl_s
        self.segments: dict[int, SegmentRecord] = {}
        self.clients: dict[str, set[int]] = {}  # node id -> its mounted segment ids
        self.last_seen: dict[str, float] = {}  # soft state: node id -> last heartbeat/mount time
        self.objects = ObjectTable()
        self.pending: set[str] = set()  # keys of PENDING objects (few: puts in flight)
        self.discarded: list[tuple[float, int, int, int]] = []  # (deadline_s, segment_id, offset, alloc_bytes)
        self.next_put_id = 1
        self.epoch = 0  # newest epoch seen in a record
        self.lsn = 0  # last applied record's LSN (0 in memory-only mode)
        self.space_attached = True
        self.capacity_bytes = 0
        self.used_bytes = 0
        self._handlers = {op: getattr(self, name) for op, name in _HANDLERS.items()}  # op -> bound handler
        # the key list of the PUT_START_MANY record being applied, when its writer (the service's batch
        # path) has just checked that every key is new and distinct; set and cleared around that one apply
        self.checked_new_keys: list | None = None
        # the pool's last word on keys it no longer holds (``returning_refusal``): key -> digest of its last
        # COMPLETE object, b"" when it was removed (or had no digest); oldest first, at most ``max_forgotten``
        self.forgotten: OrderedDict[str, bytes] = OrderedDict()
        self.max_forgotten = DEFAULT_MAX_FORGOTTEN
        self.forgotten_bytes = 0  # keys' UTF-8 and digests' bytes, at most FORGOTTEN_MAX_BYTES (snapshots carry them)

    def use_reference_handlers(self) -> None:
        """Apply PUT_START_MANY / PUT_END_MANY with the plain-Python handlers (the references of the
        compiled ones; tests)."""
        self._handlers[Op.PUT_START_MANY] = self._put_start_many_py
        self._handlers[Op.PUT_END_MANY] = self._put_end_many_py

    # ---------------------------------------------------------------- apply
    def apply(self, rec: list, lsn: int = 0) -> None:
        """Apply one decoded record; StaleEpochError for a record of an epoch older than seen."""
        op, epoch, now = rec[0], rec[1], rec[2]
        if epoch < self.epoch:
            raise StaleEpochError(f"record {Op(op).name} (lsn {lsn}) is of epoch {epoch}, older than epoch "
                                  f"{self.epoch} already seen: refused (a deposed leader's write)")
        self.epoch = epoch
        if lsn:
            self.lsn = lsn
        self._handlers[op](now, *rec[3:])

    def _mount(self, now: float, node_id: str, segment_id: int, capacity: int, endpoint: str, transport: str,
               region_ids: list, tier: int) -> None:
        desc = SegmentDescriptor(node_id=node_id, segment_id=segment_id, capacity_bytes=capacity, endpoint=endpoint,
                                 transport=transport, region_ids=tuple(region_ids), tier=CacheTier(tier))
        seg = SegmentRecord(desc, self.alignment)
        if self.space_attached:
            seg.alloc = self._new_allocator(seg)
        self.segments[segment_id] = seg
        self.clients.setdefault(node_id, set()).add(segment_id)
        self.last_seen[node_id] = max(self.last_seen.get(node_id, -math.inf), now)
        self.capacity_bytes += seg.capacity_bytes

    def _unmount(self, now: float, segment_id: int) -> None:
        self._drop_segments([segment_id])

    def _put_start(self, now: float, key: str, size: int, alloc: int, pin: int, soft_ttl: float,
                   digest: bytes | None, put_id: int, replicas: list) -> None:
        old = self.objects.get(key)
        if old is not None:  # pre-empting a zombie put: its space is kept until its reclaim deadline
            self._preempt(old)
        reps = tuple((s, o) for s, o in replicas)
        segments = self.segments
        for seg_id, off in reps:
            seg = segments[seg_id]
            seg.used_bytes += alloc
            self.used_bytes += alloc
            if seg.alloc is not None and off not in seg.handles:  # replay: the allocator decides the same way
                self._allocate_at(seg, off, alloc)
        self.objects[key] = ObjectRecord(key, size, alloc, _PENDING, reps, put_id, now, -math.inf, -math.inf, now,
                                         pin, now + soft_ttl if pin == _SOFT else -math.inf, digest)
        self.pending.add(key)
        self.next_put_id = max(self.next_put_id, put_id + 1)

    def _put_start_many(self, now: float, soft_ttl: float, first_put_id: int, keys: list, sizes: list,
                        allocs: list, pins: list, digests: list, counts: list, flat: list) -> None:
        """``_put_start`` of each key, in order (one PUT_START_MANY record; columns, see the oplog). The
        ranges are already in the allocators when attached (the service allocated them before recording,
        as for PUT_START) and are not looked up again. Compiled (``_kernels.new_records``) unless a key
        pre-empts a zombie put; ``_put_start_many_py`` is the reference (tested equal)."""
        objects = self.objects
        if keys is self.checked_new_keys:  # the service checked this very list just now (see __init__)
            fresh = True
        elif type(keys) is not list:
            fresh = False
        elif not objects._rows:
            fresh = all_new(keys, objects._objs)
        else:
            fresh = not objects.present_among(keys) and len(set(keys)) == len(keys)
        if not fresh:
            self._put_start_many_py(now, soft_ttl, first_put_id, keys, sizes, allocs, pins, digests, counts, flat)
            return
        objs, per_seg, total = new_records(keys, list(sizes), list(allocs), list(pins), list(digests), list(counts),
                                           list(flat), now, soft_ttl, first_put_id, _PENDING, _SOFT)
        segments = self.segments
        for s, added in per_seg.items():
            segments[s].used_bytes += added
        self.used_bytes += total
        objects.put_new(keys, objs)
        self.pending.update(keys)
        self.next_put_id = max(self.next_put_id, first_put_id + len(keys))

    def _put_start_many_py(self, now: float, soft_ttl: float, first_put_id: int, keys: list, sizes: list,
                           allocs: list, pins: list, digests: list, counts: list, flat: list) -> None:
        """``_put_start_many`` in plain Python (the reference of ``_kernels.new_records``; also the path
        when a key pre-empts a zombie put)."""
        objects, segments = self.objects, self.segments
        preempted = objects.present_among(keys)
        inf = math.inf
        objs = []
        add = objs.append
        total = 0
        j = 0
        pid = first_put_id
        for i, key in enumerate(keys):
            if preempted and key in preempted:
                self._preempt(objects[key])
            alloc = allocs[i]
            c = counts[i]
            if c == 1:
                s = flat[j]
                reps = ((s, flat[j + 1]),)
                segments[s].used_bytes += alloc
            else:
                reps = tuple(zip(flat[j:j + 2 * c:2], flat[j + 1:j + 2 * c:2]))
                for s, _ in reps:
                    segments[s].used_bytes += alloc
            j += 2 * c
            total += alloc * c
            pin = pins[i]
            add(ObjectRecord(key, sizes[i], alloc, _PENDING, reps, pid, now, -inf, -inf, now, pin,
                             now + soft_ttl if pin == _SOFT else -inf, digests[i]))
            pid += 1
        self.used_bytes += total
        objects.put_new(keys, objs)
        self.pending.update(keys)
        self.next_put_id = max(self.next_put_id, pid)

    def _preempt(self, old: ObjectRecord) -> None:
        """A zombie put is pre-empted: its ranges stay allocated until its reclaim deadline."""
        assert old.status == _PENDING, f"PUT_START over complete object {old.key!r}"
        deadline = old.started_s + self._reclaim_s
        for seg_id, off in old.replicas:
            self.discarded.append((deadline, seg_id, off, old.alloc_bytes))

    def _put_end(self, now: float, key: str) -> None:
        obj = self.objects[key]
        self.pending.discard(key)
        obj.status = _COMPLETE
        obj.completed_s = obj.last_access_s = now
        if obj.pin == _SOFT:
            obj.soft_pin_end_s = now + (obj.soft_pin_end_s - obj.started_s)
        self.index.add(key, self.index_rows(obj))

    def _put_end_many(self, now: float, keys: list) -> None:
        """``_put_end`` of each key, in order (one PUT_END_MANY record). Compiled
        (``_kernels.end_apply``); ``_put_end_many_py`` is the reference (tested equal)."""
        if type(keys) is not list:
            keys = list(keys)
        table = self.objects
        segs = self.segments

        def where_of(s: int) -> tuple:
            d = segs[s].desc
            return d.node_id, d.tier

        cols = end_apply(keys, table._objs, None if not table._rows else table.get, now,
                         _COMPLETE, _SOFT, where_of)
        self.pending.difference_update(keys)
        self.index.add_columns(*cols)

    def _put_end_many_py(self, now: float, keys: list) -> None:
        """``_put_end_many`` in plain Python (the reference of ``_kernels.end_apply``)."""
        get, segs = self.objects.getter(), self.segments
        where: dict[int, tuple] = {}  # segment id -> (node id, tier)
        rkeys, nodes, tiers, seg_ids, offs, sizes = [], [], [], [], [], []
        for key in keys:
            obj = get(key)
            if obj is None:
                raise KeyError(key)
            obj.status = _COMPLETE
            obj.completed_s = obj.last_access_s = now
            if obj.pin == _SOFT:
                obj.soft_pin_end_s = now + (obj.soft_pin_end_s - obj.started_s)
            size = obj.size_bytes
            for s, off in obj.replicas:
                w = where.get(s)
                if w is None:
                    d = segs[s].desc
                    w = where[s] = (d.node_id, d.tier)
                rkeys.append(key)
                nodes.append(w[0])
                tiers.append(w[1])
                seg_ids.append(s)
                offs.append(off)
                sizes.append(size)
        self.pending.difference_update(keys)
        self.index.add_columns(rkeys, nodes, tiers, seg_ids, offs, sizes)

    def _put_revoke(self, now: float, key: str) -> None:
        self._drop_object(self.objects.pop(key))

    def _remove(self, now: float, key: str) -> None:
        self._drop_object(self.objects.pop(key), removed=True)  # no copy of it may come back

    def _evict(self, now: float, keys: list) -> None:
        for key in keys:
            self._drop_object(self.objects.pop(key))

    def _expire(self, now: float, node_id: str) -> None:
        self._drop_segments(sorted(self.clients.pop(node_id, ())))
        self.last_seen.pop(node_id, None)

    def _reclaim(self, now: float) -> None:
        keep = []
        for item in self.discarded:
            if item[0] <= now:
                self._release(item[1], item[2], item[3])
            else:
                keep.append(item)
        self.discarded = keep
        for key in sorted(self.pending):
            if self.objects[key].started_s + self._reclaim_s <= now:
                self._drop_object(self.objects.pop(key))

    def _reclaim_listed(self, now: float, keys: list, ranges: list) -> None:
        """RECLAIM_LISTED: drop the named PENDING puts, release the named discarded ranges (the writer's
        decision; nothing is re-decided, so a replay with another ``_reclaim_s`` does the same). A name
        that is not a pending put / discarded range is a ValueError, raised before anything changes."""
        release = {(r[0], r[1]) for r in ranges}
        found = [d for d in self.discarded if (d[1], d[2]) in release]
        missing = [k for k in keys if k not in self.pending]
        if missing or len(found) != len(release) or len(release) != len(ranges):
            raise ValueError(f"RECLAIM_LISTED names puts {missing!r:.80} that are not pending or ranges that "
                             f"are not discarded ({len(found)} of {len(ranges)} found)")
        if found:
            self.discarded = [d for d in self.discarded if (d[1], d[2]) not in release]
            for _, s, off, alloc in found:
                self._release(s, off, alloc)
        for key in keys:
            self._drop_object(self.objects.pop(key))

    def _epoch(self, now: float) -> None:
        pass

    def _batch(self, now: float, records: list) -> None:
        apply = self.apply
        for rec in records:  # the batch's LSN is already set
            apply(rec)

    _reclaim_s = 600.0  # set by the service from its config (zombie_reclaim_s): pre-emption deadlines, old RECLAIM

    # ---------------------------------------------------------------- helpers
    def index_rows(self, obj: ObjectRecord) -> list[tuple[str, CacheTier, int, int, int]]:
        segs = self.segments
        return [(segs[s].desc.node_id, segs[s].desc.tier, s, off, obj.size_bytes) for s, off in obj.replicas]

    def _drop_object(self, obj: ObjectRecord, removed: bool = False) -> None:
        self.pending.discard(obj.key)
        if obj.status == _COMPLETE:
            segs = self.segments
            self.index.drop(obj.key, [(segs[s].desc.node_id, segs[s].desc.tier) for s, _ in obj.replicas])
            self._forget(obj.key, b"" if removed else obj.digest or b"")
        for seg_id, off in obj.replicas:
            self._release(seg_id, off, obj.alloc_bytes)

    def _forget(self, key: str, digest: bytes) -> None:
        """Remember that the pool's last COMPLETE object of ``key`` (now dropped) had ``digest`` (b"": removed, or
        no digest); the oldest such memories go once there are more than ``max_forgotten``, or more than
        ``FORGOTTEN_MAX_BYTES`` of keys and digests (long keys: the snapshot, which an HA standby fetches in one
        call, stays bounded)."""
        f = self.forgotten
        old = f.pop(key, None)
        if old is not None:
            self.forgotten_bytes -= _utf8_len(key) + len(old)
        if self.max_forgotten > 0:
            f[key] = digest
            self.forgotten_bytes += _utf8_len(key) + len(digest)
            self.trim_forgotten()

    def load_forgotten(self, keys: list[str], digests: list[bytes]) -> None:
        """Replace the memory with ``keys`` and their ``digests``, oldest first (a snapshot's), within the bounds."""
        self.forgotten = OrderedDict(zip(keys, digests))
        self.forgotten_bytes = sum(map(_utf8_len, keys)) + sum(map(len, digests))
        self.trim_forgotten()

    def trim_forgotten(self) -> None:
        """Forget the oldest memories past ``max_forgotten`` entries or ``FORGOTTEN_MAX_BYTES`` of keys and digests."""
        f = self.forgotten
        while f and (len(f) > self.max_forgotten or self.forgotten_bytes > FORGOTTEN_MAX_BYTES):
            k, d = f.popitem(last=False)
            self.forgotten_bytes -= _utf8_len(k) + len(d)

    def returning_refusal(self, key: str, digest: bytes | None) -> str | None:
        """Why a copy of ``key`` with ``digest`` coming back from outside the pool (a node's SSD tier) must not
        be put back, or None. Refused: a key the pool holds an object of (a put decides that case), a key
        it removed, and a key whose last object it dropped had another digest (or none): the copy is older
        than the pool's last word on that key. A key it remembers nothing of (never held, or forgotten
        past ``max_forgotten``) is let through."""
        last = self.forgotten.get(key)
        if last is None:
            return None
        if last == b"":
            return "the pool removed it (or its last object had no digest)"
        if digest is None or bytes(digest) != last:
            return "the pool's last object of this key had other bytes"
        return None

    def _release(self, seg_id: int, off: int, alloc: int) -> None:
        seg = self.segments[seg_id]
        seg.used_bytes -= alloc
        self.used_bytes -= alloc
        if seg.alloc is not None:
            seg.alloc.free(seg.handles.pop(off))

    def _drop_segments(self, seg_ids: Iterable[int]) -> None:
        """Unmount: replicas on these segments vanish; objects left with none are removed. O(objects)."""
        gone = set(seg_ids)
        if not gone:
            return
        for key, obj in list(self.objects.items()):
            lost = [r for r in obj.replicas if r[0] in gone]
            if not lost:
                continue
            if obj.status == _COMPLETE:
                segs = self.segments
                self.index.drop(key, [(segs[s].desc.node_id, segs[s].desc.tier) for s, _ in lost])
            obj.replicas = tuple(r for r in obj.replicas if r[0] not in gone)
            if not obj.replicas:  # the lost ranges go with their segment (no allocator frees)
                del self.objects[key]
                self.pending.discard(key)
                if obj.status == _COMPLETE:
                    self._forget(key, obj.digest or b"")
        self.discarded = [d for d in self.discarded if d[1] not in gone]
        for seg_id in gone:
            seg = self.segments.pop(seg_id)
            self.capacity_bytes -= seg.capacity_bytes
            self.used_bytes -= seg.used_bytes
            owners = self.clients.get(seg.desc.node_id)
            if owners is not None:
                owners.discard(seg_id)

    # ---------------------------------------------------------------- space (allocators)
    def _new_allocator(self, seg: SegmentRecord) -> OffsetAllocator:
        units = seg.capacity_bytes // self.alignment
        return OffsetAllocator(max(seg.capacity_bytes, self.alignment), max(2, min(self.max_allocs, units + 1)),
                               alignment=self.alignment)

    def try_allocate(self, seg: SegmentRecord, alloc: int) -> int | None:
        """Allocate ``alloc`` bytes on ``seg``; the offset, or None if it does not fit."""
        if seg.free_bytes < alloc or seg.alloc is None:
            return None
        try:
            a = seg.alloc.allocate(alloc)
        except OutOfSpaceError:
            return None
        seg.handles[a.offset] = a.handle
        return a.offset

    def undo_allocate(self, seg_id: int, off: int) -> None:
        seg = self.segments[seg_id]
        seg.alloc.free(seg.handles.pop(off))

    def _allocate_at(self, seg: SegmentRecord, off: int, alloc: int) -> None:
        raise AssertionError(f"segment {seg.desc.segment_id}: replica at offset {off} was not allocated before apply")

    def ranges_by_segment(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Every live range per segment (objects and discarded zombies): ``(offsets, alloc_bytes)``
        sorted by offset."""
        segs, offs, allocs = self.objects.replica_ranges()
        if self.discarded:
            d = np.asarray([(s, o, a) for _, s, o, a in self.discarded], dtype=np.int64)
            segs, offs, allocs = (np.concatenate([segs, d[:, 0]]), np.concatenate([offs, d[:, 1]]),
                                  np.concatenate([allocs, d[:, 2]]))
        order = np.lexsort((offs, segs))
        segs, offs, allocs = segs[order], offs[order], allocs[order]
        out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        bounds = np.flatnonzero(np.diff(segs)) + 1
        for lo, hi in zip(np.concatenate(([0], bounds)).tolist(), np.concatenate((bounds, [len(segs)])).tolist()):
            if hi > lo:
                out[int(segs[lo])] = (offs[lo:hi], allocs[lo:hi])
        for s in self.segments:
            out.setdefault(s, (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)))
        return out

    def attach_space(self) -> None:
        """Rebuild every segment's allocator from the live ranges (end of recovery): allocate, in
        offset order on a fresh allocator, the live ranges and a filler for every gap (a fresh
        allocator places consecutive requests back to back from offset 0), then free the fillers.
        Needs ``ranges + gaps <= max_allocs``, which held in the allocator that made them."""
        for seg_id, (offs, allocs) in self.ranges_by_segment().items():
            seg = self.segments[seg_id]
            seg.alloc = self._new_allocator(seg)
            seg.handles = SegmentHandles()
            n = len(offs)
            if not n:
                continue
            ends = offs + allocs
            prev_end = np.concatenate(([0], ends[:-1]))
            gaps = offs - prev_end
            assert (gaps >= 0).all() and ends[-1] <= seg.capacity_bytes, f"segment {seg_id}: overlapping ranges"
            sizes = np.empty(2 * n, dtype=np.int64)
            sizes[0::2] = gaps
            sizes[1::2] = allocs
            is_live = np.zeros(2 * n, dtype=bool)
            is_live[1::2] = True
            keep = sizes > 0
            sizes, is_live = sizes[keep], is_live[keep]
            offsets, handles = seg.alloc.allocate_batch(sizes)
            assert np.array_equal(offsets[is_live], offs), f"segment {seg_id}: allocator rebuild placed ranges elsewhere"
            if (~is_live).any():
                seg.alloc.free_batch(handles[~is_live])
            seg.handles = SegmentHandles(offs.copy(), handles[is_live].copy())
        self.space_attached = True

    def detach_space(self) -> None:
        for seg in self.segments.values():
            seg.alloc = None
            seg.handles = SegmentHandles()
        self.space_attached = False

    # ---------------------------------------------------------------- invariants (tests)
    def check_invariants(self) -> None:
        for seg_id, (offs, allocs) in self.ranges_by_segment().items():
            seg = self.segments[seg_id]
            ends = offs + allocs
            assert (offs[1:] >= ends[:-1]).all(), f"segment {seg_id}: overlapping ranges"
            assert not len(ends) or ends[-1] <= seg.capacity_bytes, f"segment {seg_id}: range past the end"
            assert seg.used_bytes == int(allocs.sum()), f"segment {seg_id}: used_bytes drifted"
            if self.space_attached:
                assert seg.handles.offsets() == offs.tolist(), f"segment {seg_id}: allocator handles drifted"
                assert seg.alloc.num_live_allocations == len(offs)
        assert self.used_bytes == sum(s.used_bytes for s in self.segments.values())
        assert self.capacity_bytes == sum(s.capacity_bytes for s in self.segments.values())
        assert self.pending == {k for k, o in self.objects.items() if o.status == _PENDING}, "pending set drifted"
        for obj in self.objects.materialized():
            assert obj.replicas, f"object {obj.key!r} has no replica"
            nodes = [self.segments[s].desc.node_id for s, _ in obj.replicas]
            assert len(set(nodes)) == len(nodes), f"object {obj.key!r}: replicas share a node"


_HANDLERS = {Op.MOUNT: "_mount", Op.UNMOUNT: "_unmount", Op.PUT_START: "_put_start", Op.PUT_END: "_put_end",
             Op.PUT_REVOKE: "_put_revoke", Op.REMOVE: "_remove", Op.EVICT: "_evict", Op.EXPIRE: "_expire",
             Op.RECLAIM: "_reclaim", Op.EPOCH: "_epoch", Op.BATCH: "_batch", Op.PUT_END_MANY: "_put_end_many",
             Op.PUT_START_MANY: "_put_start_many", Op.RECLAIM_LISTED: "_reclaim_listed"}

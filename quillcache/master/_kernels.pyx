# cython: language_level=3
"""Compiled hot paths of the master's batch calls, each with a plain-Python reference it is tested against.

- :class:`ObjectRecord`: one object of the master's table (C fields, the same attribute names and
  positional constructor as before; readable and writable from Python).
- ``new_records``: the records of a PUT_START_MANY record without pre-emptions (reference: the loop of
  ``MasterState._put_start_many_py``).
- ``end_prefix``: the leading run of a ``batch_put_end`` that ends PENDING objects by key alone
  (reference: the common-case branch of ``MasterService.batch_put_end``).
- ``end_apply``: the PUT_END_MANY state change and its residency columns (reference:
  ``MasterState._put_end_many_py``).
- ``read_columns``: ``get_replicas`` as columns, leases granted (reference: ``MasterService._read``
  through ``get_replicas_compact``).
- ``check_new_puts`` and ``place_most_free``: the checks and the placement of a batch of new
  single-replica puts (references: ``check_put_fields`` and ``BatchPlacer.place_one``).

Invariant shared by all: a kernel either finishes the whole batch exactly as its reference would, or
changes nothing and says so (returns None / the index where it stopped), so the caller can hand the
batch (or its rest) to the reference.
"""

cimport cython
from cpython.dict cimport PyDict_GetItem
from cpython.object cimport PyObject
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.math cimport INFINITY

import numpy as np
from operator import index as _index


@cython.no_gc
cdef class ObjectRecord:
    """One object: ``(key, size_bytes, alloc_bytes, status, replicas, put_id, started_s, completed_s,
    lease_end_s, last_access_s, pin, soft_pin_end_s, digest)``; ``replicas`` = ``((segment_id,
    offset_bytes), ...)``, a tuple of int pairs.

    Not tracked by the cyclic garbage collector: a record refers only to a str, bytes and a tuple of
    int pairs, so it can never be part of a reference cycle, and a table of millions of records then
    adds nothing to a full collection's walk (tuples of ints are untracked by CPython as well)."""

    cdef public object key
    cdef public int64_t size_bytes
    cdef public int64_t alloc_bytes
    cdef public int status
    cdef public object replicas
    cdef public int64_t put_id
    cdef public double started_s
    cdef public double completed_s
    cdef public double lease_end_s
    cdef public double last_access_s
    cdef public int pin
    cdef public double soft_pin_end_s
    cdef public object digest

    def __init__(self, key, int64_t size_bytes, int64_t alloc_bytes, int status, replicas, int64_t put_id,
                 double started_s, double completed_s, double lease_end_s, double last_access_s, int pin,
                 double soft_pin_end_s, digest):
        self.key = key
        self.size_bytes = size_bytes
        self.alloc_bytes = alloc_bytes
        self.status = status
        self.replicas = replicas
        self.put_id = put_id
        self.started_s = started_s
        self.completed_s = completed_s
        self.lease_end_s = lease_end_s
        self.last_access_s = last_access_s
        self.pin = pin
        self.soft_pin_end_s = soft_pin_end_s
        self.digest = digest

    def __repr__(self):
        return (f"ObjectRecord({self.key!r}, size={self.size_bytes}, status={self.status}, "
                f"replicas={self.replicas!r}, put_id={self.put_id})")


cdef inline object _lookup(dict d, object getter, object key):
    cdef PyObject* p
    if getter is None:
        p = PyDict_GetItem(d, key)
        if p == NULL:
            return None
        return <object>p
    return getter(key)


def all_new(list keys, dict objs):
    """True when the keys are distinct and none is a key of ``objs``."""
    cdef set seen = set()
    cdef object key
    for key in keys:
        if key in objs or key in seen:
            return False
        seen.add(key)
    return True


def new_records(list keys, list sizes, list allocs, list pins, list digests, list counts, list flat, double now,
                double soft_ttl, int64_t first_put_id, int pending, int soft):
    """``(records, added_bytes_per_segment, total_bytes)`` of a PUT_START_MANY without pre-emptions:
    record i is ``ObjectRecord(keys[i], sizes[i], allocs[i], pending, replicas, first_put_id + i, now,
    -inf, -inf, now, pins[i], now + soft_ttl if pins[i] == soft else -inf, digests[i])``, its replicas
    the next ``counts[i]`` (segment, offset) pairs of ``flat``."""
    cdef Py_ssize_t i, r, n = len(keys), j = 0, c
    cdef int64_t alloc, total = 0
    cdef int pin
    cdef ObjectRecord o
    cdef list out = [None] * n
    cdef list reps
    cdef dict per_seg = {}
    cdef object s, off
    if (len(sizes) != n or len(allocs) != n or len(pins) != n or len(digests) != n or len(counts) != n):
        raise ValueError("new_records: columns of different lengths")
    for i in range(n):
        alloc = allocs[i]
        c = counts[i]
        if j + 2 * c > len(flat):
            raise ValueError("new_records: counts name more replicas than flat holds")
        reps = [None] * c
        for r in range(c):
            s = flat[j]
            off = flat[j + 1]
            j += 2
            reps[r] = (s, off)
            per_seg[s] = per_seg.get(s, 0) + alloc
        total += alloc * c
        pin = pins[i]
        o = ObjectRecord.__new__(ObjectRecord)
        o.key = keys[i]
        o.size_bytes = sizes[i]
        o.alloc_bytes = alloc
        o.status = pending
        o.replicas = tuple(reps)
        o.put_id = first_put_id + i
        o.started_s = now
        o.completed_s = -INFINITY
        o.lease_end_s = -INFINITY
        o.last_access_s = now
        o.pin = pin
        o.soft_pin_end_s = now + soft_ttl if pin == soft else -INFINITY
        o.digest = digests[i]
        out[i] = o
    return out, per_seg, total


def end_prefix(list keys, dict objs, object getter, int pending, set done, list ended, list out):
    """Walk ``keys`` from the start while each is a str, not yet in ``done``, of a PENDING object:
    add it to ``done`` and ``ended``, append None to ``out``. Returns the index of the first key that
    is not such a key (``len(keys)`` when all were)."""
    cdef Py_ssize_t i, n = len(keys)
    cdef object key, obj
    for i in range(n):
        key = keys[i]
        if type(key) is not str or key in done:
            return i
        obj = _lookup(objs, getter, key)
        if obj is None or (<ObjectRecord?>obj).status != pending:
            return i
        done.add(key)
        ended.append(key)
        out.append(None)
    return n


def end_apply(list keys, dict objs, object getter, double now, int complete, int soft, object where_of):
    """PUT_END of each key in order (each must be in the table): status ``complete``, completed and
    last access ``now``, a soft pin's end moved to ``now + (end - started)``. Returns the residency
    columns ``(keys, nodes, tiers, segment_ids, offsets, sizes)``, one entry per replica;
    ``where_of(segment_id)`` -> ``(node_id, tier)``."""
    cdef Py_ssize_t i, n = len(keys)
    cdef object key, obj, w, rep
    cdef ObjectRecord o
    cdef dict where = {}
    cdef list rkeys = [], nodes = [], tiers = [], seg_ids = [], offs = [], sizes = []
    for i in range(n):
        key = keys[i]
        obj = _lookup(objs, getter, key)
        if obj is None:
            raise KeyError(key)
        o = <ObjectRecord?>obj
        o.status = complete
        o.completed_s = now
        o.last_access_s = now
        if o.pin == soft:
            o.soft_pin_end_s = now + (o.soft_pin_end_s - o.started_s)
        size = o.size_bytes
        for rep in o.replicas:
            s = rep[0]
            w = where.get(s)
            if w is None:
                w = where_of(s)
                where[s] = w
            rkeys.append(key)
            nodes.append(w[0])
            tiers.append(w[1])
            seg_ids.append(s)
            offs.append(rep[1])
            sizes.append(size)
    return rkeys, nodes, tiers, seg_ids, offs, sizes


# read_columns error kinds (the caller builds the same messages as MasterService._read)
READ_BAD_KEY = 1
READ_NOT_FOUND = 2
READ_NOT_READY = 3


def read_columns(keys, dict objs, object getter, double now, double lease_end, int complete):
    """``get_replicas`` of ``keys`` as columns: ``(counts u1, segment_ids u4, offsets i8, sizes i8,
    failures, used)``; a COMPLETE object's lease becomes ``max(lease_end, old)`` and its last access
    ``now``; ``failures`` = ``[(row, kind, put_id), ...]`` (kinds READ_*), ``used`` = the segment ids
    named."""
    cdef Py_ssize_t i, r, n = len(keys), m = 0, cap = n + 8, c
    cdef object key, obj, rep
    cdef ObjectRecord o
    counts_a = np.zeros(n, dtype=np.uint8)
    sizes_a = np.zeros(n, dtype=np.int64)
    segs_a = np.empty(cap, dtype=np.uint32)
    offs_a = np.empty(cap, dtype=np.int64)
    cdef uint8_t[::1] counts = counts_a
    cdef int64_t[::1] sizes = sizes_a
    cdef uint32_t[::1] segs = segs_a
    cdef int64_t[::1] offs = offs_a
    cdef list failures = []
    cdef set used = set()
    cdef uint32_t last_seg = 0xFFFFFFFF, sid
    for i in range(n):
        key = keys[i]
        if type(key) is not str:
            failures.append((i, READ_BAD_KEY, 0))
            continue
        obj = _lookup(objs, getter, key)
        if obj is None:
            failures.append((i, READ_NOT_FOUND, 0))
            continue
        o = <ObjectRecord?>obj
        if o.status != complete:
            failures.append((i, READ_NOT_READY, o.put_id))
            continue
        if lease_end > o.lease_end_s:
            o.lease_end_s = lease_end
        o.last_access_s = now
        c = len(o.replicas)
        if m + c > cap:
            cap = 2 * (m + c)
            segs_a = np.resize(segs_a, cap)
            offs_a = np.resize(offs_a, cap)
            segs = segs_a
            offs = offs_a
        for rep in o.replicas:
            sid = rep[0]
            segs[m] = sid
            offs[m] = rep[1]
            m += 1
            if sid != last_seg:
                used.add(sid)
                last_seg = sid
        counts[i] = c
        sizes[i] = o.size_bytes
    return counts_a, segs_a[:m].copy(), offs_a[:m].copy(), sizes_a, failures, used


def check_new_puts(list keys, list sizes, Py_ssize_t max_key_chars, int64_t max_bytes, int64_t unit):
    """The allocation sizes (int64 array, ``size`` rounded up to ``unit``) when every key is a str of
    1..max_key_chars characters and every size an int in [1, max_bytes]; else None."""
    cdef Py_ssize_t i, n = len(keys), klen
    cdef object key, size
    cdef int64_t s
    if len(sizes) != n:
        return None
    allocs_a = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] allocs = allocs_a
    for i in range(n):
        key = keys[i]
        size = sizes[i]
        if type(key) is not str or type(size) is not int:
            return None
        klen = len(<str>key)
        if klen < 1 or klen > max_key_chars:
            return None
        if size < 1 or size > max_bytes:
            return None
        s = size
        allocs[i] = (s + unit - 1) // unit * unit
    return allocs_a


def place_most_free(const int64_t[::1] allocs, const int64_t[::1] seg_ids, const int64_t[::1] free_bytes):
    """Per put, in order, the index (into ``seg_ids``) of the segment with the most free bytes (ties:
    the smaller segment id), then that segment has ``allocs[i]`` fewer free bytes; ``(choice array,
    -1)`` or, when put ``i`` does not fit there, ``(None, i)``."""
    cdef Py_ssize_t n = allocs.shape[0], k = seg_ids.shape[0], i, j, t
    cdef int64_t f
    if k == 0:
        return None, 0
    # order: segment indices sorted by (-free, segment id); kept sorted as free space is taken
    order_a = np.lexsort((np.asarray(seg_ids), -np.asarray(free_bytes))).astype(np.int64)
    free_a = np.array(free_bytes, dtype=np.int64)
    choice_a = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] order = order_a
    cdef int64_t[::1] free = free_a
    cdef int64_t[::1] choice = choice_a
    for i in range(n):
        t = order[0]
        if free[t] < allocs[i]:
            return None, i
        free[t] -= allocs[i]
        choice[i] = t
        f = free[t]
        j = 0
        while j + 1 < k and (free[order[j + 1]] > f or (free[order[j + 1]] == f and seg_ids[order[j + 1]] < seg_ids[t])):
            order[j] = order[j + 1]
            j += 1
        order[j] = t
    return choice_a, -1


def record_columns(list objs):
    """The snapshot columns of ``objs`` (ObjectRecords): ``(keys, cols, rep_count, rep_seg, rep_off,
    digests)`` as ``ObjectTable.columns`` gives them for materialized records (reference:
    ``ObjectTable._columns_py``): ``cols`` = size, alloc, status, put_id, started, completed, pin,
    soft_pin_end arrays; replicas flattened in order; ``digests`` = ``{row: digest}`` where not None."""
    cdef Py_ssize_t i, n = len(objs), m = 0, total = 0
    cdef ObjectRecord o
    cdef object rep
    for i in range(n):
        total += len((<ObjectRecord?>objs[i]).replicas)
    size_a = np.empty(n, dtype="<i8")
    alloc_a = np.empty(n, dtype="<i8")
    status_a = np.empty(n, dtype="u1")
    put_id_a = np.empty(n, dtype="<i8")
    started_a = np.empty(n, dtype="<f8")
    completed_a = np.empty(n, dtype="<f8")
    pin_a = np.empty(n, dtype="u1")
    soft_a = np.empty(n, dtype="<f8")
    count_a = np.empty(n, dtype="u1")
    seg_a = np.empty(total, dtype="<u4")
    off_a = np.empty(total, dtype="<i8")
    cdef int64_t[::1] size_v = size_a, alloc_v = alloc_a, put_id_v = put_id_a, off_v = off_a
    cdef uint8_t[::1] status_v = status_a, pin_v = pin_a, count_v = count_a
    cdef double[::1] started_v = started_a, completed_v = completed_a, soft_v = soft_a
    cdef uint32_t[::1] seg_v = seg_a
    cdef list keys = [None] * n
    cdef dict digests = {}
    for i in range(n):
        o = <ObjectRecord>objs[i]
        keys[i] = o.key
        size_v[i] = o.size_bytes
        alloc_v[i] = o.alloc_bytes
        status_v[i] = o.status
        put_id_v[i] = o.put_id
        started_v[i] = o.started_s
        completed_v[i] = o.completed_s
        pin_v[i] = o.pin
        soft_v[i] = o.soft_pin_end_s
        count_v[i] = len(o.replicas)
        for rep in o.replicas:
            seg_v[m] = rep[0]
            off_v[m] = rep[1]
            m += 1
        if o.digest is not None:
            digests[i] = o.digest
    cols = {"size": size_a, "alloc": alloc_a, "status": status_a, "put_id": put_id_a, "started": started_a,
            "completed": completed_a, "pin": pin_a, "soft_pin_end": soft_a}
    return keys, cols, count_a, seg_a, off_a, digests


def all_of_type(list items, type kind):
    """``all(type(x) is kind for x in items)`` (exact type, no subclasses)."""
    cdef object x
    for x in items:
        if type(x) is not kind:
            return False
    return True


cdef int64_t _EMPTY = -1
cdef int64_t _TOMBSTONE = -2
_MISSING_HANDLE = object()


cdef inline uint64_t _mix64(uint64_t x) noexcept nogil:
    """splitmix64's finalizer: aligned offsets (multiples of a large power of two) spread over every slot."""
    x ^= x >> 30
    x *= 0xbf58476d1ce4e5b9ULL
    x ^= x >> 27
    x *= 0x94d049bb133111ebULL
    x ^= x >> 31
    return x


cdef class HandleMap:
    """``offset -> allocator handle`` for a segment's live ranges: an open-addressing hash table of
    int64 pairs (linear probing, tombstones, grown at half load), so a batch of fresh allocations is
    stored by one ``put_batch`` over two arrays without creating an int object per range. Reference:
    a plain ``dict`` (tested equal under random programs). Offsets are >= 0; a present offset is never
    stored twice (``put_batch`` / ``__setitem__`` raise ValueError, storing nothing of that call)."""

    cdef int64_t* keys_
    cdef int64_t* vals_
    cdef Py_ssize_t cap      # slots, a power of two
    cdef Py_ssize_t n        # live entries
    cdef Py_ssize_t used     # live entries + tombstones

    def __cinit__(self):
        self.cap = 0
        self.n = 0
        self.used = 0
        self.keys_ = NULL
        self.vals_ = NULL
        self._rehash(16)

    def __dealloc__(self):
        free(self.keys_)
        free(self.vals_)

    cdef int _rehash(self, Py_ssize_t cap) except -1:
        cdef int64_t* ok = self.keys_
        cdef int64_t* ov = self.vals_
        cdef Py_ssize_t ocap = self.cap, i
        cdef int64_t* nk = <int64_t*>malloc(cap * sizeof(int64_t))
        cdef int64_t* nv = <int64_t*>malloc(cap * sizeof(int64_t))
        if nk == NULL or nv == NULL:
            free(nk)
            free(nv)
            raise MemoryError()
        for i in range(cap):
            nk[i] = _EMPTY
        self.keys_, self.vals_, self.cap, self.used = nk, nv, cap, 0
        self.n = 0
        for i in range(ocap):
            if ok[i] >= 0:
                self._insert(ok[i], ov[i])
        free(ok)
        free(ov)
        return 0

    cdef inline Py_ssize_t _find(self, int64_t key) noexcept:
        cdef Py_ssize_t mask = self.cap - 1
        cdef Py_ssize_t i = <Py_ssize_t>(_mix64(<uint64_t>key) & <uint64_t>mask)
        while True:
            if self.keys_[i] == key:
                return i
            if self.keys_[i] == _EMPTY:
                return -1
            i = (i + 1) & mask

    cdef inline void _insert(self, int64_t key, int64_t val) noexcept:
        """(key absent, room guaranteed) into the first empty or tombstone slot of its probe run."""
        cdef Py_ssize_t mask = self.cap - 1
        cdef Py_ssize_t i = <Py_ssize_t>(_mix64(<uint64_t>key) & <uint64_t>mask)
        while self.keys_[i] >= 0:
            i = (i + 1) & mask
        if self.keys_[i] == _EMPTY:
            self.used += 1
        self.keys_[i] = key
        self.vals_[i] = val
        self.n += 1

    cdef int _reserve(self, Py_ssize_t more) except -1:
        """Room for ``more`` inserts at most half full (tombstones count as full until a rehash)."""
        cdef Py_ssize_t cap = self.cap
        if 2 * (self.used + more) <= cap:
            return 0
        while 2 * (self.n + more) > cap // 2:  # rehash to at most a quarter full: tombstones are dropped
            cap *= 2
        self._rehash(cap)
        return 0

    cdef inline void _erase(self, Py_ssize_t i) noexcept:
        self.keys_[i] = _TOMBSTONE
        self.n -= 1

    def put_batch(self, const int64_t[::1] offsets, const int64_t[::1] handles):
        """Store ``offsets[j] -> handles[j]`` for every j (fresh offsets: none live, none repeated)."""
        cdef Py_ssize_t m = offsets.shape[0], j, k
        if handles.shape[0] != m:
            raise ValueError(f"{m} offsets but {handles.shape[0]} handles")
        self._reserve(m)
        for j in range(m):
            if offsets[j] < 0 or self._find(offsets[j]) >= 0:
                for k in range(j):  # undo this call
                    self._erase(self._find(offsets[k]))
                raise ValueError(f"offset {offsets[j]} is negative or already live")
            self._insert(offsets[j], handles[j])

    def __setitem__(self, int64_t off, int64_t handle):
        if off < 0 or self._find(off) >= 0:
            raise ValueError(f"offset {off} is negative or already live")
        self._reserve(1)
        self._insert(off, handle)

    def __contains__(self, off):
        try:
            off = _index(off)
        except TypeError:
            return False
        return 0 <= off <= 0x7fffffffffffffff and self._find(off) >= 0

    def pop(self, off, default=_MISSING_HANDLE):
        cdef Py_ssize_t i = -1
        try:
            off = _index(off)
        except TypeError:
            pass
        else:
            if 0 <= off <= 0x7fffffffffffffff:
                i = self._find(off)
        if i < 0:
            if default is _MISSING_HANDLE:
                raise KeyError(off)
            return default
        self._erase(i)
        return self.vals_[i]

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(self.keys())

    def keys(self) -> list:
        cdef Py_ssize_t i
        return [self.keys_[i] for i in range(self.cap) if self.keys_[i] >= 0]

    def items(self) -> list:
        cdef Py_ssize_t i
        return [(self.keys_[i], self.vals_[i]) for i in range(self.cap) if self.keys_[i] >= 0]

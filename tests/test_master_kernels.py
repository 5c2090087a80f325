"""The master's compiled batch paths (``quillcache.master._kernels``) against their plain-Python references.

- Twin services on one fake clock, one with ``fast_paths`` and the compiled state handlers, one running the
  references (``fast_paths = False`` + ``MasterState.use_reference_handlers()``), driven with the same random
  columnar puts (new, repeated, invalid, too big, several segments and nodes), put_ends, leased columnar
  gets, removes and clock advances: every answer, every object (``object_info``, leases included), every
  segment's usage and the allocators' next placement agree after every step; the compiled put path is
  taken in a good share of the batches (counted).
- ``place_most_free`` against ``BatchPlacer.place_one`` (the placement rule's reference) on random
  segments; ``new_records`` / ``end_apply`` through ``MasterState`` against ``_put_start_many_py`` /
  ``_put_end_many_py``; ``ObjectRecord`` keeps its Python attribute interface.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from quillcache.alloc import OffsetAllocator
from quillcache.master import MasterConfig, MasterError, MasterService, SegmentDescriptor
from quillcache.master._kernels import HandleMap, ObjectRecord, check_new_puts, place_most_free
from quillcache.master.placement import BatchPlacer
from quillcache.master.state import SegmentHandles

UNIT = 64


def _answer(x):
    if isinstance(x, MasterError):
        return ("error", x.code, str(x))
    return x


class Twins:
    """A compiled-path service and a reference one, same config, same clock."""

    def __init__(self, segments: list[tuple[str, int, int]]) -> None:
        self.now = 50.0
        cfg = MasterConfig(alignment_bytes=UNIT, lease_ttl_s=5.0)
        self.fast = MasterService(cfg, clock=lambda: self.now)
        self.ref = MasterService(cfg, clock=lambda: self.now)
        self.ref.fast_paths = False
        self.ref._state.use_reference_handlers()
        for node, sid, units in segments:
            for svc in (self.fast, self.ref):
                svc.mount_segment(SegmentDescriptor(node_id=node, segment_id=sid, capacity_bytes=units * UNIT))
        self.fast_batches = 0
        real = self.fast._put_columns_fast

        def counting(*a, **k):
            out = real(*a, **k)
            self.fast_batches += out is not None
            return out

        self.fast._put_columns_fast = counting

    def both(self, method: str, *args, **kwargs):
        a = getattr(self.fast, method)(*args, **kwargs)
        b = getattr(self.ref, method)(*args, **kwargs)
        return a, b

    def agree(self, keys: list[str]) -> None:
        for key in sorted(set(keys)):
            a = b = None
            try:
                a = self.fast.object_info(key)
            except MasterError as e:
                a = e.code
            try:
                b = self.ref.object_info(key)
            except MasterError as e:
                b = e.code
            assert a == b, key
        assert sorted(self.fast.keys()) == sorted(self.ref.keys())
        for seg in self.fast.segments():
            assert self.fast.segment_usage(seg.segment_id) == self.ref.segment_usage(seg.segment_id)
        self.fast.check_invariants()
        self.ref.check_invariants()
        fa, fb = self.fast._state, self.ref._state
        assert fa.pending == fb.pending and fa.next_put_id == fb.next_put_id and fa.used_bytes == fb.used_bytes


def _same_columns(a, b) -> None:
    assert [_answer(x) for x in a.to_list()] == [_answer(x) for x in b.to_list()]
    for name in ("counts", "segment_ids", "offsets", "sizes"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.segments == b.segments and set(a.segments) == set(np.unique(a.segment_ids).tolist())
    a.check()
    b.check()


names = st.sampled_from([f"k{i}" for i in range(40)] + ["", 7, "x" * 5000])
sizes = st.sampled_from([1, 63, 64, 65, 200, 1000, 4096, 0, -3, True, 2.5])
ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.lists(st.tuples(names, sizes), min_size=0, max_size=12),
              st.sampled_from([1, 1, 1, 2]), st.sampled_from([0, 0, 1, 2])),
    st.tuples(st.just("fresh"), st.integers(2, 30), st.sampled_from([64, 100, 640, 3000])),
    st.tuples(st.just("end"), st.lists(names, max_size=12)),
    st.tuples(st.just("get"), st.lists(names, max_size=12)),
    st.tuples(st.just("remove"), names),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 3.0, 6.0, 40.0])),
), min_size=1, max_size=25)
layouts = st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(4, 200)), min_size=1, max_size=5)


@settings(max_examples=120, deadline=None)
@given(layout=layouts, program=ops)
def test_compiled_paths_equal_their_references(layout, program):
    tw = Twins([(node, sid, units) for sid, (node, units) in enumerate(layout)])
    seen: list[str] = []
    fresh_no = 0
    for op in program:
        kind = op[0]
        if kind in ("put", "fresh"):
            if kind == "put":
                ks = [k for k, _ in op[1]]
                ss = [s for _, s in op[1]]
                n, pin = op[2], op[3]
            else:
                ks = [f"f{fresh_no}-{i}" for i in range(op[1])]
                fresh_no += 1
                ss = [op[2]] * op[1]
                n, pin = 1, 0
            a, b = tw.both("batch_put_start_columns", ks, ss, replica_num=n, pin=pin)
            _same_columns(a, b)
            assert np.array_equal(a.put_ids, b.put_ids) and np.array_equal(a.existing, b.existing)
            seen += [k for k in ks if isinstance(k, str)]
        elif kind == "end":
            a, b = tw.both("batch_put_end", list(op[1]))
            assert [_answer(x) for x in a] == [_answer(x) for x in b]
        elif kind == "get":
            a, b = tw.both("get_replicas_columns", list(op[1]))
            _same_columns(a, b)
        elif kind == "remove":
            try:
                a = tw.fast.remove(op[1])
            except MasterError as e:
                a = e.code
            try:
                b = tw.ref.remove(op[1])
            except MasterError as e:
                b = e.code
            assert a == b
        else:
            tw.now += op[1]
            assert tw.fast.tick() == tw.ref.tick()
        tw.agree([k for k in seen if 0 < len(k) <= 4096])
    # the allocators are in the same state: the next placement agrees
    a, b = tw.both("batch_put_start_columns", ["probe-1", "probe-2"], [64, 64])
    _same_columns(a, b)


def test_fast_put_path_is_taken_and_equal():
    tw = Twins([("a", 0, 1000), ("b", 1, 1000), ("c", 2, 600)])
    for rep in range(20):
        ks = [f"r{rep}-{i}" for i in range(50)]
        a, b = tw.both("batch_put_start_columns", ks, [64 * (1 + i % 3) for i in range(50)])
        _same_columns(a, b)
        ends = tw.both("batch_put_end", ks[: 40])
        assert ends[0] == ends[1]
        tw.now += 1.0
        g = tw.both("get_replicas_columns", ks)
        _same_columns(*g)
        tw.agree(ks)
    assert tw.fast_batches >= 5  # until the segments fill up (then eviction: the reference decides)


@settings(max_examples=200, deadline=None)
@given(frees=st.lists(st.integers(0, 50), min_size=1, max_size=6, unique=False),
       allocs=st.lists(st.integers(1, 8), min_size=1, max_size=40), perm=st.randoms(use_true_random=False))
def test_place_most_free_matches_batch_placer(frees, allocs, perm):
    sids = list(range(len(frees)))
    perm.shuffle(sids)
    segs = {}
    for sid, free in zip(sids, frees):
        cap = 64 * 64
        seg = types.SimpleNamespace(free_bytes=free * 64, alloc=OffsetAllocator(cap, 256, alignment=64),
                                    handles=SegmentHandles(), desc=types.SimpleNamespace(node_id=f"n{sid}"))
        segs[sid] = seg
    placer = BatchPlacer(segs)
    want: list[int] = []
    stop = -1
    for i, a in enumerate(allocs):
        got = placer.place_one(a * 64)
        if got is None:
            stop = i
            break
        want.append(got[0])
    ids = np.asarray(list(segs), dtype=np.int64)
    free_arr = np.asarray([segs[s].free_bytes for s in segs], dtype=np.int64)
    choice, failed_at = place_most_free(np.asarray(allocs, dtype=np.int64) * 64, ids, free_arr)
    if stop >= 0:
        assert choice is None and failed_at == stop
    else:
        assert failed_at == -1 and ids[choice].tolist() == want


def test_check_new_puts_refuses_what_check_put_fields_refuses():
    assert check_new_puts(["a", "b"], [1, 64], 10, 100, 64).tolist() == [64, 64]
    assert check_new_puts(["a", "b"], [65, 100], 10, 100, 64).tolist() == [128, 128]
    for keys, sizes in ((["a", ""], [1, 1]), (["a", "b" * 11], [1, 1]), (["a", 3], [1, 1]), (["a", "b"], [1, 0]),
                        (["a", "b"], [1, 101]), (["a", "b"], [1, True]), (["a", "b"], [1, 2.0]), (["a"], [1, 2])):
        assert check_new_puts(keys, sizes, 10, 100, 64) is None, (keys, sizes)


@settings(max_examples=60, deadline=None)
@given(batch=st.lists(st.tuples(st.integers(1, 3), st.sampled_from([0, 1, 2])), min_size=2, max_size=12),
       ended=st.integers(0, 12))
def test_state_kernels_equal_python_handlers(batch, ended):
    """PUT_START_MANY / PUT_END_MANY records applied by the compiled handlers and by the Python ones."""
    now = [10.0]
    svcs = []
    for ref in (False, True):
        svc = MasterService(MasterConfig(alignment_bytes=UNIT), clock=lambda: now[0])
        if ref:
            svc._state.use_reference_handlers()
            svc.fast_paths = False
        for sid, node in enumerate("abc"):
            svc.mount_segment(SegmentDescriptor(node_id=node, segment_id=sid, capacity_bytes=64 * UNIT))
        svcs.append(svc)
    keys = [f"s{i}" for i in range(len(batch))]
    outs = [svc.batch_put_start_columns(keys, [64] * len(keys), replica_num=batch[0][0], pin=batch[0][1])
            for svc in svcs]
    _same_columns(*outs)
    now[0] = 12.5
    ends = [svc.batch_put_end(keys[:ended]) for svc in svcs]
    assert ends[0] == ends[1]
    for key in keys:
        assert svcs[0].object_info(key) == svcs[1].object_info(key)
    rows = [sorted((e.block_hash, e.identity, e.node, e.segment_id, e.offset_bytes, e.size_bytes)
                   for node in "abc" for e in svc._projection.index.entries_on_node(node)) for svc in svcs]
    assert rows[0] == rows[1] and len(rows[0]) == batch[0][0] * min(ended, len(keys))


def test_object_record_python_interface():
    r = ObjectRecord("k", 10, 64, 1, [(0, 64)], 7, 1.0, -math.inf, -math.inf, 1.0, 0, -math.inf, None)
    assert (r.key, r.size_bytes, r.alloc_bytes, r.status, r.replicas, r.put_id) == ("k", 10, 64, 1, [(0, 64)], 7)
    r.status = 2
    r.lease_end_s = 9.5
    r.replicas = [(1, 0)]
    r.digest = b"d"
    assert (r.status, r.lease_end_s, r.replicas, r.digest) == (2, 9.5, [(1, 0)], b"d")
    with pytest.raises(TypeError):
        r.size_bytes = "big"
    with pytest.raises(AttributeError):
        r.other = 1


@settings(max_examples=60, deadline=None)
@given(objs=st.lists(st.tuples(st.integers(1, 10**9), st.integers(1, 2), st.sampled_from([0, 1, 2]),
                               st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**40)), min_size=1,
                                        max_size=3),
                               st.floats(allow_nan=False), st.sampled_from([None, b"d1", b"\x00" * 16])),
                     max_size=30), reload=st.booleans())
def test_record_columns_equal_python_columns(objs, reload):
    """``ObjectTable.columns`` (compiled ``record_columns``) against ``_columns_py``, with and without
    unmaterialized snapshot rows behind the records."""
    from quillcache.master.table import ObjectTable

    table = ObjectTable()
    for i, (size, status, pin, reps, t, digest) in enumerate(objs):
        table[f"o{i}"] = ObjectRecord(f"o{i}", size, size + 64, status, reps, i + 1, t, t + 1, -math.inf, t, pin,
                                      t + 2, digest)
    if reload and objs:
        loaded = ObjectTable()
        loaded.load_columns(*table.columns())
        loaded.get("o0")  # one materialized record, the rest still rows
        table = loaded
    a, b = table.columns(), table._columns_py()
    assert a[0] == b[0] and a[5] == b[5]
    for name in b[1]:
        assert np.array_equal(a[1][name], b[1][name]) and a[1][name].dtype == b[1][name].dtype, name
    for x, y in zip(a[2:5], b[2:5]):
        assert np.array_equal(x, y) and x.dtype == y.dtype


@given(items=st.lists(st.one_of(st.integers(), st.text(max_size=3), st.booleans(), st.none(), st.floats()), max_size=20))
def test_all_of_type_equals_all(items):
    from quillcache.master._kernels import all_of_type

    for kind in (int, str, bool, float):
        assert all_of_type(items, kind) == all(type(x) is kind for x in items)


_OFFSETS = st.one_of(st.integers(0, 64), st.integers(0, 2**40).map(lambda x: x * 4096), st.just(2**63 - 1))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["set", "batch", "pop", "contains"]),
                          st.lists(_OFFSETS, min_size=0, max_size=40)), max_size=60))
def test_handle_map_equals_a_dict(program):
    """HandleMap against its reference, a dict: single and batch stores (a repeat or a live offset
    refuses the whole call and stores nothing), pops, membership, length, contents, through growth
    and tombstones."""
    got, want = HandleMap(), {}
    h = 0
    for op, offs in program:
        if op == "batch":
            arr = np.asarray(offs, dtype=np.int64)
            hs = np.arange(h, h + len(offs), dtype=np.int64)
            h += len(offs)
            bad = len(set(offs)) != len(offs) or any(o in want for o in offs)
            if bad:
                with pytest.raises(ValueError, match="already live"):
                    got.put_batch(arr, hs)
            else:
                got.put_batch(arr, hs)
                want.update(zip(offs, hs.tolist()))
        for o in offs:
            if op == "set":
                if o in want:
                    with pytest.raises(ValueError):
                        got[o] = h
                else:
                    got[o] = want[o] = h
                h += 1
            elif op == "pop":
                assert got.pop(o, None) == want.pop(o, None)
            elif op == "contains":
                assert (o in got) == (o in want) and (np.int64(o) in got) == (o in want)
        assert len(got) == len(want)
        assert sorted(got.items()) == sorted(want.items())
    assert "x" not in got and -1 not in got and got.pop(-5, "d") == "d"
    with pytest.raises(KeyError):
        got.pop(-5)
    with pytest.raises(ValueError, match="offsets but"):
        got.put_batch(np.zeros(2, dtype=np.int64), np.zeros(1, dtype=np.int64))

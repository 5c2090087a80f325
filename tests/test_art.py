"""ArtTree (Cython, arena) against ArtReference (dict + sorted list): same operations, same answers.

The stateful test drives both with inserts/replaces, removes, gets, prefix scans/counts/removals,
ordered iteration from random start keys, batch calls and export -> bytes -> attach round trips
(with and without a lazily verified chunk checksum table), and checks after every step that they
agree and that ``verify()`` (full structural walk) passes.
Keys come from fixed-length families over a tiny alphabet (lots of shared prefixes, compressed
paths longer than the 16 stored prefix bytes) plus wide fan-out batches, so nodes grow and
shrink through Node4/16/48/256.
"""

from __future__ import annotations

import gc
import math
import mmap
import re

import crc32c
import dataclasses
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from quillcache.art import _art
from quillcache.art.meta import ArenaMeta
from quillcache.art.tree import ArtReference, ArtTree

ALPHABET = bytes([0x00, 0x01, 0x02, 0x7F, 0x80, 0xFE, 0xFF])
FILLER = b"\x55"


K16_KEYS = st.lists(st.sampled_from(ALPHABET), min_size=15, max_size=15).map(lambda b: bytes([16]) + bytes(b))


@st.composite
def family_keys(draw: st.DrawFn) -> bytes:
    """A key from one of several fixed-length families that share long prefixes."""
    alpha = st.sampled_from(ALPHABET)
    fam = draw(st.sampled_from(["k3", "k5", "k16", "k16", "k40", "k255", "raw"]))
    if fam == "raw":  # short free-form keys: these may conflict (prefix relation) on purpose
        return draw(st.binary(min_size=1, max_size=4))
    if fam == "k3":
        body = bytes(draw(st.lists(alpha, min_size=2, max_size=2)))
        return bytes([3]) + body
    if fam == "k5":
        return bytes([5]) + bytes(draw(st.lists(alpha, min_size=4, max_size=4)))
    if fam == "k16":
        return bytes([16]) + bytes(draw(st.lists(alpha, min_size=15, max_size=15)))
    if fam == "k40":  # a 30-byte run shared by every key: compressed paths > 16 stored bytes
        head = bytes(draw(st.lists(alpha, min_size=1, max_size=1)))
        tail = bytes(draw(st.lists(alpha, min_size=8, max_size=8)))
        return bytes([40]) + head + FILLER * 30 + tail
    head = bytes(draw(st.lists(alpha, min_size=2, max_size=2)))
    tail = bytes(draw(st.lists(alpha, min_size=3, max_size=3)))
    return bytes([255]) + head + FILLER * 249 + tail


def outcome(fn, *args):
    """('ok', result) or ('err', exception type, message): both implementations must agree."""
    try:
        res = fn(*args)
    except (ValueError, TypeError) as exc:
        return ("err", type(exc), str(exc))
    if isinstance(res, tuple):
        return ("ok", tuple(np.asarray(x).tolist() if isinstance(x, np.ndarray) else x for x in res))
    return ("ok", res)


class ArtMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tree: ArtTree
        self.ref: ArtReference
        self.keepalive: list[object] = []
        self.lazy_fresh = False  # just attached with a checksum table: nothing verified yet

    @initialize(value_size=st.sampled_from([0, 1, 6]), arena=st.sampled_from([64, 200, 4096]))
    def start(self, value_size: int, arena: int) -> None:
        self.tree = ArtTree(value_size, initial_arena_bytes=arena)
        self.ref = ArtReference(value_size)

    def same(self, name: str, *args):
        a = outcome(getattr(self.tree, name), *args)
        b = outcome(getattr(self.ref, name), *args)
        assert a == b, (name, args, a, b)
        return a

    def value(self, data: st.DataObject) -> bytes:
        vs = self.ref.value_size
        return data.draw(st.binary(min_size=vs, max_size=vs))

    def existing(self, data: st.DataObject) -> bytes:
        return data.draw(st.sampled_from(sorted(self.ref._data)))

    def some_prefix(self, data: st.DataObject) -> bytes:
        choice = data.draw(st.integers(0, 3))
        if choice == 0 or not len(self.ref):
            return data.draw(st.one_of(st.just(b""), family_keys(), st.binary(max_size=3)))
        key = self.existing(data)
        return key[: data.draw(st.integers(0, len(key)))]

    @rule(key=family_keys(), data=st.data())
    def insert(self, key: bytes, data: st.DataObject) -> None:
        self.same("insert", key, self.value(data))

    @precondition(lambda self: len(self.ref) > 0)
    @rule(data=st.data())
    def replace(self, data: st.DataObject) -> None:
        assert self.same("insert", self.existing(data), self.value(data)) == ("ok", False)

    @precondition(lambda self: len(self.ref) > 0)
    @rule(data=st.data(), extend=st.booleans())
    def insert_conflicting(self, data: st.DataObject, extend: bool) -> None:
        key = self.existing(data)
        if extend and len(key) < 255:
            bad = key + data.draw(st.binary(min_size=1, max_size=255 - len(key)))
        elif len(key) > 1:
            bad = key[: data.draw(st.integers(1, len(key) - 1))]
        else:
            return
        res = self.same("insert", bad, self.value(data))
        assert res[0] == "err" and "prefix" in res[2] and str(len(bad)) in res[2]

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        key = self.existing(data) if len(self.ref) and data.draw(st.booleans()) else data.draw(family_keys())
        self.same("remove", key)

    @rule(data=st.data())
    def get_and_contains(self, data: st.DataObject) -> None:
        key = self.existing(data) if len(self.ref) and data.draw(st.booleans()) else data.draw(family_keys())
        self.same("get", key)
        self.same("__contains__", key)

    @rule(data=st.data(), limit=st.one_of(st.none(), st.integers(0, 6)))
    def scan_and_count(self, data: st.DataObject, limit: int | None) -> None:
        prefix = self.some_prefix(data)
        self.same("scan_prefix", prefix, limit)
        self.same("count_prefix", prefix)

    @rule(data=st.data())
    def scan_u64(self, data: st.DataObject) -> None:
        # The index's point-lookup path: a 1-byte head + a big-endian u64, built in C.
        key = self.existing(data) if len(self.ref) and data.draw(st.booleans()) else data.draw(family_keys())
        key = (key + bytes(9))[:9]
        self.same("scan_u64_prefix_packed", key[0], int.from_bytes(key[1:9], "big"))

    @rule(data=st.data())
    def scan_u64_batch(self, data: st.DataObject) -> None:
        # Batched form: every prefix shares the head byte; matched keys must all be 16 bytes.
        picks = [self.existing(data) for _ in range(data.draw(st.integers(0, 3)))] if len(self.ref) else []
        picks += data.draw(st.lists(family_keys(), max_size=2))
        head = data.draw(st.sampled_from([16, 3, 5]))
        nums = np.array([int.from_bytes((k[1:] + bytes(8))[:8], "big") for k in picks], dtype=np.uint64)
        self.same("scan_u64_prefix_batch", head, nums, 16)

    @rule(data=st.data())
    def remove_prefix(self, data: st.DataObject) -> None:
        prefix = self.some_prefix(data)
        if prefix == b"" and data.draw(st.integers(0, 9)):
            return  # clearing everything is allowed but should stay rare
        self.same("remove_prefix", prefix)

    @rule(data=st.data())
    def items_from(self, data: st.DataObject) -> None:
        start = None if data.draw(st.booleans()) else self.some_prefix(data)
        a = list(self.tree.items(start))
        b = list(self.ref.items(start))
        assert a == b

    @rule(data=st.data(), pos=st.integers(1, 15), first=st.integers(0, 255),
          count=st.one_of(st.integers(1, 20), st.integers(40, 160)), step=st.sampled_from([1, 37, 101]))
    def insert_fan(self, data: st.DataObject, pos: int, first: int, count: int, step: int) -> None:
        """Many keys that differ in one byte: grows a node up to Node48/Node256 in one batch."""
        base = bytearray(data.draw(K16_KEYS))
        rows = []
        for i in range(count):
            base[pos] = (first + i * step) % 256
            rows.append(bytes(base))
        keys = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), 16).copy()
        vs = self.ref.value_size
        values = np.frombuffer(data.draw(st.binary(min_size=vs * len(rows), max_size=vs * len(rows))),
                               dtype=np.uint8).reshape(len(rows), vs).copy()
        self.same("insert_batch", keys, values)

    @precondition(lambda self: len(self.ref) > 0)
    @rule(data=st.data(), keep=st.integers(0, 12))
    def remove_most_under_prefix(self, data: st.DataObject, keep: int) -> None:
        """Removes all but `keep` keys below a prefix: shrinks 256 -> 48 -> 16 -> 4 -> merge."""
        key = self.existing(data)
        prefix = key[: data.draw(st.integers(1, min(len(key), 16)))]
        victims = [k for k, _ in self.ref.scan_prefix(prefix)]
        order = data.draw(st.permutations(victims))
        for k in order[keep:]:
            self.same("remove", k)

    @precondition(lambda self: len(self.ref) > 0)
    @rule(data=st.data())
    def batches(self, data: st.DataObject) -> None:
        key_len = data.draw(st.sampled_from(sorted({len(k) for k in self.ref._data})))
        pool = [k for k in self.ref._data if len(k) == key_len]
        picks = data.draw(st.lists(st.sampled_from(pool), min_size=0, max_size=6))
        picks += data.draw(st.lists(st.binary(min_size=key_len, max_size=key_len), max_size=2))
        keys = np.frombuffer(b"".join(picks), dtype=np.uint8).reshape(len(picks), key_len).copy()
        self.same("get_batch", keys)
        plen = data.draw(st.integers(0, key_len))
        prefixes = np.ascontiguousarray(keys[:, :plen])
        self.same("scan_prefix_batch", prefixes, None)
        self.same("scan_prefix_batch", prefixes, key_len)

    @rule(mode=st.sampled_from(["bytes", "bytearray_slack", "arena_view", "misaligned", "mmap_copy"]),
          chunk_bytes=st.one_of(st.none(), st.sampled_from([4096, 8192, 65536])))
    def export_and_attach(self, mode: str, chunk_bytes: int | None) -> None:
        """Round trip through bytes; with chunk_bytes, through the lazily verified path (the next
        rule then runs on a tree whose chunks are verified only as it touches them)."""
        meta = self.tree.export_meta()
        root = self.tree.root_offset
        with self.tree.arena_view() as view:
            raw = bytes(view)
        if mode == "bytes":
            buf: object = raw
        elif mode == "bytearray_slack":  # writable: mutated in place until it must grow
            buf = bytearray(raw) + bytearray(512)
        elif mode == "arena_view":  # read-only view of the old tree: copy on first write
            buf = self.tree.arena_view()
            self.keepalive = [self.tree, buf]
        elif mode == "misaligned":
            holder = bytearray(len(raw) + 1)
            holder[1:] = raw
            buf = memoryview(holder)[1:]
        else:
            m = mmap.mmap(-1, len(raw))
            m.write(raw)
            buf = m
        if chunk_bytes is None:
            new = ArtTree.attach(buf, root, meta)
            with new.arena_view() as view:
                assert bytes(view) == raw
        else:
            crcs = self.tree.chunk_crcs(chunk_bytes)
            new = ArtTree.attach(buf, root, meta, chunk_crcs=crcs, chunk_bytes=chunk_bytes)
            s = new.stats()
            assert (s["chunks_total"], s["chunks_verified"]) == (len(crcs), 0)
            self.lazy_fresh = True
        assert new.export_meta() == meta and new.root_offset == root and len(new) == len(self.ref)
        self.tree = new

    @invariant()
    def agree(self) -> None:
        if not hasattr(self, "tree"):
            return
        assert len(self.tree) == len(self.ref)
        s = self.tree.stats()
        assert 0 <= s["chunks_verified"] <= s["chunks_total"]
        if self.lazy_fresh:  # let the next rule meet unverified chunks; check fully after it
            self.lazy_fresh = False
            return
        stats = self.tree.verify()
        assert stats["leaves"] == len(self.ref)
        # verify() dereferences every object and free block, so every chunk is now verified
        assert stats["chunks_verified"] == stats["chunks_total"]
        for name in ("node48", "node256"):
            if stats[name]:
                event(f"tree has a {name}")
        assert list(self.tree.items()) == list(self.ref.items())


ArtMachine.TestCase.settings = settings(stateful_step_count=40, deadline=None)
TestArtStateful = ArtMachine.TestCase


# -- node types -------------------------------------------------------------------------------


def _fan_keys(n: int, pos: int = 3, length: int = 8) -> list[bytes]:
    out = []
    for b in range(n):
        k = bytearray(b"\x07" * length)
        k[pos] = b
        out.append(bytes(k))
    return out


def test_all_node_types_grow_and_shrink() -> None:
    tree, ref = ArtTree(2, initial_arena_bytes=64), ArtReference(2)
    keys = _fan_keys(256)
    seen = set()
    for i, k in enumerate(keys):
        assert tree.insert(k, i.to_bytes(2, "big")) and ref.insert(k, i.to_bytes(2, "big"))
        s = tree.verify()
        seen |= {t for t in ("node4", "node16", "node48", "node256") if s[t]}
    assert seen == {"node4", "node16", "node48", "node256"}
    assert tree.stats()["node256"] == 1
    shrunk = set()
    for k in keys[:-1]:
        assert tree.remove(k) and ref.remove(k)
        s = tree.verify()
        shrunk |= {t for t in ("node4", "node16", "node48", "node256") if s[t]}
        assert list(tree.items()) == list(ref.items())
    assert shrunk == {"node4", "node16", "node48", "node256"}
    s = tree.stats()
    # one key left: the root is that leaf, every node was freed onto a free list
    assert (s["node4"], s["node16"], s["node48"], s["node256"], s["leaves"]) == (0, 0, 0, 0, 1)
    assert tree.root_offset & 1 == 1
    assert s["free_list_bytes"] > 0
    used = tree.arena_used_bytes
    for i, k in enumerate(keys[:-1]):  # freed blocks are reused: no bump growth
        tree.insert(k, b"xx")
    assert tree.arena_used_bytes == used
    tree.verify()


def test_stats_shows_every_node_type_at_once() -> None:
    tree = ArtTree(0)
    for n, first in ((3, 1), (10, 2), (30, 3), (200, 4)):
        for k in _fan_keys(n, pos=2):
            tree.insert(bytes([first]) + k, b"")
    s = tree.verify()
    assert s["node4"] >= 1 and s["node16"] >= 1 and s["node48"] >= 1 and s["node256"] >= 1
    assert s["leaves"] == 243 == len(tree)


def test_long_compressed_paths_and_max_length_keys() -> None:
    tree, ref = ArtTree(1), ArtReference(1)
    base = b"\x01" + b"\x55" * 250
    keys = [base + bytes([a, b, c, d]) for a in (0, 9) for b in (1, 2) for c in (3,) for d in (0, 255)]
    for k in keys:
        assert len(k) == 255
        tree.insert(k, b"v")
        ref.insert(k, b"v")
    tree.verify()
    # a key diverging inside the 250-byte compressed run (beyond the 16 stored bytes)
    odd = b"\x01" + b"\x55" * 100 + b"\x56" + b"\x55" * 149 + b"\x00\x01\x03\x00"
    assert tree.insert(odd, b"o") and ref.insert(odd, b"o")
    assert tree.get(odd) == b"o"
    assert tree.get(odd[:-1] + b"\x07") is None  # same stored prefix bytes, different key
    for start in (None, odd, base, base[:120] + b"\x56", keys[3]):
        assert list(tree.items(start)) == list(ref.items(start))
    for prefix in (base[:17], base[:200], base + b"\x00", odd[:102], odd[:101] + b"\x57"):
        assert tree.scan_prefix(prefix) == ref.scan_prefix(prefix)
        assert tree.count_prefix(prefix) == ref.count_prefix(prefix)
    with pytest.raises(ValueError, match="length 200 conflicts with an existing key of length 255"):
        tree.insert(base[:200], b"x")
    assert tree.remove_prefix(base[:120]) == ref.remove_prefix(base[:120]) == len(keys)
    tree.verify()
    assert list(tree.items()) == list(ref.items()) == [(odd, b"o")]


def test_items_is_a_cursor_under_mutation() -> None:
    tree, ref = ArtTree(0), ArtReference(0)
    keys = [i.to_bytes(4, "big") for i in range(0, 3000, 3)]
    for k in keys:
        tree.insert(k, b"")
        ref.insert(k, b"")
    results = []
    for impl in (tree, ref):
        out = []
        it = impl.items((300).to_bytes(4, "big"))
        for n, (k, _) in enumerate(it):
            out.append(k)
            if n == 300:  # mutate mid-iteration: later chunks see it
                impl.remove_prefix(b"\x00\x00\x07")
                impl.insert((2999).to_bytes(4, "big"), b"")
        results.append(out)
    assert results[0] == results[1]
    assert results[0] == sorted(set(results[0]))


# -- persistence --------------------------------------------------------------------------------


def _sample_tree(n: int = 400, value_size: int = 4) -> tuple[ArtTree, ArtReference]:
    rng = np.random.default_rng(11)
    tree, ref = ArtTree(value_size, initial_arena_bytes=256), ArtReference(value_size)
    keys = rng.integers(0, 4, size=(n, 12), dtype=np.uint8)
    keys[: n // 2, 5] = rng.integers(0, 256, size=n // 2)  # wide fan-out somewhere
    keys = np.unique(keys, axis=0)
    values = rng.integers(0, 256, size=(len(keys), value_size), dtype=np.uint8)
    assert tree.insert_batch(keys, values) == ref.insert_batch(keys, values) == len(keys)
    for k in list(ref._data)[::5]:
        tree.remove(k)
        ref.remove(k)
    return tree, ref


def test_export_bytes_attach_round_trip() -> None:
    tree, ref = _sample_tree()
    meta, root = tree.export_meta(), tree.root_offset
    assert isinstance(meta, ArenaMeta) and all(type(getattr(meta, f)) is int for f in ArenaMeta.COUNTERS)
    with tree.arena_view() as view:
        raw = bytes(view)
    assert len(raw) == tree.arena_used_bytes == meta.arena_used_bytes
    copy = ArtTree.attach(raw, root, meta)
    assert copy.stats() == {**tree.stats(), "arena_capacity_bytes": len(raw)}
    assert list(copy.items()) == list(ref.items())
    copy.verify()
    # further mutations work (read-only bytes: copied into owned memory first) ...
    extra = np.full((50, 12), 9, dtype=np.uint8)
    extra[:, 11] = np.arange(50)
    vals = np.zeros((50, 4), dtype=np.uint8)
    assert copy.insert_batch(extra, vals) == ref.insert_batch(extra, vals) == 50
    for k in list(ref._data)[::3]:
        assert copy.remove(k) and ref.remove(k)
    assert list(copy.items()) == list(ref.items())
    copy.verify()
    # ... and never touch the source bytes
    with tree.arena_view() as view:
        assert bytes(view) == raw


def test_attach_writable_buffer_mutates_in_place_until_it_must_grow() -> None:
    tree, ref = _sample_tree(60)
    meta, root = tree.export_meta(), tree.root_offset
    with tree.arena_view() as view:
        buf = bytearray(view) + bytearray(4096)
    t2 = ArtTree.attach(buf, root, meta)
    k = bytes(12)
    t2.insert(k, b"abcd")
    assert b"abcd" in buf  # the leaf was written into the caller's buffer
    with pytest.raises(BufferError):
        buf.extend(b"x")  # the tree holds an export: the buffer cannot be resized under it
    for i in range(200):  # outgrows the buffer: the tree moves to owned memory
        t2.insert(bytes([5, i]) + bytes(10), b"zzzz")
    buf.extend(b"x")  # released
    assert t2.get(k) == b"abcd" and len(t2) == len(ref) + 201
    t2.verify()


def test_arena_view_pins_the_arena() -> None:
    tree = ArtTree(0, initial_arena_bytes=64)
    tree.insert(b"a1", b"")
    view = tree.arena_view()
    assert view.readonly and view.nbytes == tree.arena_used_bytes
    with pytest.raises(BufferError, match="arena_view"):
        for i in range(100):
            tree.insert(bytes([98, i]), b"")
    view.release()
    for i in range(100):
        tree.insert(bytes([98, i]), b"")
    assert len(tree) == 101
    tree.verify()


def _with_free_head(meta: ArenaMeta, block_bytes: int, head: int) -> tuple[tuple[int, int], ...]:
    """``meta.free_heads`` with the list of ``block_bytes`` blocks starting at ``head``."""
    heads = dict(meta.free_heads)
    heads[block_bytes] = head
    return tuple(sorted(heads.items()))


def test_attach_rejects_bad_buffers_and_meta() -> None:
    tree, _ = _sample_tree(80)
    meta, root = tree.export_meta(), tree.root_offset
    with tree.arena_view() as view:
        raw = bytes(view)

    def err(exc, match, buf=raw, r=root, **changes):
        with pytest.raises(exc, match=match):  # a bad field is refused building the record or by attach
            ArtTree.attach(buf, r, dataclasses.replace(meta, **changes))

    err(ValueError, "smaller than arena_used_bytes", buf=raw[:100])
    err(ValueError, "smaller than the 64-byte arena header", buf=b"QUILL", arena_used_bytes=0)
    err(ValueError, "magic", buf=b"X" + raw[1:])
    with pytest.raises(ValueError, match="exactly"):  # a record missing a field does not decode
        ArenaMeta.from_bytes(meta.to_bytes()[:-8])
    with pytest.raises(TypeError, match="bogus"):  # nor can one with an unknown field be built
        dataclasses.replace(meta, bogus=1)
    err(TypeError, "must be an int", num_node4="3")
    err(TypeError, "must be an int", num_node4=True)
    err(ValueError, "must be in 0", num_node4=-1)
    err(ValueError, "format_version 7", format_version=7)
    err(ValueError, "value_size 5 does not match", value_size=5)
    err(ValueError, "arena_used_bytes 101", arena_used_bytes=101)
    err(ValueError, "root_offset", r=len(raw) + 64)
    err(ValueError, "root_offset", r=8)  # inside the header
    err(ValueError, "inconsistent with num_leaves", r=0)
    err(ValueError, "cannot fit", num_node256=10**9)
    err(ValueError, r"free_heads\[64\]: free-list head", free_heads=_with_free_head(meta, 64, len(raw)))
    err(ValueError, r"free_heads\[64\]: free-list head 68", free_heads=_with_free_head(meta, 64, 68))
    err(ValueError, "size class 12", free_heads=((12, 64),))
    err(ValueError, "size class 4096 is not a multiple of 8 in 8..2072", free_heads=((4096, 64),))
    err(ValueError, "must be in 0..", free_heads=((2**70, 64),))
    err(TypeError, "buffer protocol", buf=12345)
    with pytest.raises(TypeError, match="ArenaMeta"):
        ArtTree.attach(raw, root, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ArenaMeta"):  # the old string-keyed dict is refused too
        ArtTree.attach(raw, root, dataclasses.asdict(meta))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="C-contiguous"):
        ArtTree.attach(memoryview(bytearray(raw * 2))[::2], root, meta)


def test_attach_rejects_mapping_type_error_message() -> None:
    with pytest.raises(TypeError, match="meta must be an ArenaMeta"):
        ArtTree.attach(b"", 0, None)  # type: ignore[arg-type]


def test_arena_meta_round_trips_through_bytes_and_attach() -> None:
    tree, ref = _sample_tree(200)  # removals leave free lists, so free_heads is not empty
    meta, root = tree.export_meta(), tree.root_offset
    assert meta.free_heads and meta.free_list_blocks >= len(meta.free_heads)
    assert [size for size, _ in meta.free_heads] == sorted({size for size, _ in meta.free_heads})
    raw_meta = meta.to_bytes()
    again = ArenaMeta.from_bytes(raw_meta)
    assert again == meta and again.to_bytes() == raw_meta
    with tree.arena_view() as view:
        raw = bytes(view)
    copy = ArtTree.attach(raw, root, ArenaMeta.from_bytes(bytearray(raw_meta)))
    assert copy.export_meta() == meta and list(copy.items()) == list(ref.items())
    copy.verify()
    # the restored free lists are the same lists: the same inserts reuse the same freed blocks
    blocks = meta.free_list_blocks
    for t in (tree, copy):
        t.insert(bytes([7]) * 12, b"abcd")
        t.insert(bytes([7]) * 11 + b"\x08", b"efgh")
    assert copy.export_meta() == tree.export_meta() and copy.export_meta().free_list_blocks < blocks
    with tree.arena_view() as v1, copy.arena_view() as v2:
        assert bytes(v1) == bytes(v2)
    copy.verify()


def test_arena_meta_refuses_bad_records() -> None:
    tree, _ = _sample_tree(80)
    meta = tree.export_meta()
    raw_meta = meta.to_bytes()
    with pytest.raises(ValueError, match="bad magic"):
        ArenaMeta.from_bytes(b"X" + raw_meta[1:])
    with pytest.raises(ValueError, match="shorter than"):
        ArenaMeta.from_bytes(raw_meta[:10])
    with pytest.raises(ValueError, match="exactly"):
        ArenaMeta.from_bytes(raw_meta + bytes(16))
    with pytest.raises(TypeError, match="needs bytes"):
        ArenaMeta.from_bytes({"free_head_64": 64})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ArenaMeta.num_leaves must be an int, got bool"):
        dataclasses.replace(meta, num_leaves=True)
    with pytest.raises(ValueError, match="strictly ascending"):
        dataclasses.replace(meta, free_heads=((64, 64), (16, 64)))
    with pytest.raises(ValueError, match=r"free_heads\[64\]: an empty list"):
        dataclasses.replace(meta, free_heads=((64, 0),))
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.num_leaves = 0  # type: ignore[misc]


def test_attach_refuses_a_free_head_beyond_the_arena_naming_it() -> None:
    tree, _ = _sample_tree(80)
    meta, root = tree.export_meta(), tree.root_offset
    with tree.arena_view() as view:
        raw = bytes(view)
    beyond = dataclasses.replace(meta, free_heads=_with_free_head(meta, 24, meta.arena_used_bytes + 8))
    msg = rf"meta free_heads\[24\]: free-list head {meta.arena_used_bytes + 8} lies outside the {len(raw)} used"
    with pytest.raises(ValueError, match=msg):
        ArtTree.attach(raw, root, beyond)
    with pytest.raises(ValueError, match=msg):  # the compiled core refuses it by itself too
        _art.ArtCore(4)._attach(raw, root, beyond)
    with pytest.raises(ValueError, match=msg):  # and so does the lazily verified attach
        ArtTree.attach(raw, root, beyond, chunk_crcs=tree.chunk_crcs(4096), chunk_bytes=4096)
    straddles = dataclasses.replace(meta, free_heads=_with_free_head(meta, 2072, meta.arena_used_bytes - 8))
    with pytest.raises(ValueError, match=r"free_heads\[2072\]"):  # starts inside, ends outside
        ArtTree.attach(raw, root, straddles)


_CORRUPT_BASE = _sample_tree(300, value_size=3)[0]
_CORRUPT_META = _CORRUPT_BASE.export_meta()
_CORRUPT_ROOT = _CORRUPT_BASE.root_offset
with _CORRUPT_BASE.arena_view() as _v:
    _CORRUPT_RAW = bytes(_v)


@settings(deadline=None)
@given(
    flips=st.lists(st.tuples(st.integers(64, len(_CORRUPT_RAW) - 1), st.integers(0, 255)), min_size=1, max_size=12),
    word_flips=st.lists(st.tuples(st.integers(8, len(_CORRUPT_RAW) // 8 - 1), st.integers(0, 2**64 - 1)), max_size=4),
    head=st.one_of(st.none(), st.integers(8, len(_CORRUPT_RAW) // 8 - 1)),
    ops=st.lists(st.sampled_from(["get", "insert", "remove", "scan", "count", "remove_prefix", "items",
                                  "verify", "batch", "scan_batch"]), min_size=1, max_size=8),
    key=st.binary(min_size=12, max_size=12),
)
def test_corrupted_arena_raises_never_crashes(flips, word_flips, head, ops, key) -> None:
    buf = bytearray(_CORRUPT_RAW)
    for pos, byte in flips:
        buf[pos] = byte
    for word, value in word_flips:  # plausible-looking offsets are the dangerous corruption
        buf[word * 8: word * 8 + 8] = (value % (len(buf) + 64)).to_bytes(8, "little")
    meta = _CORRUPT_META
    if head is not None:
        meta = dataclasses.replace(meta, free_heads=_with_free_head(meta, 64, head * 8))
    try:
        tree = ArtTree.attach(bytes(buf), _CORRUPT_ROOT, meta)
    except ValueError:
        return
    keys = np.frombuffer(key * 3, dtype=np.uint8).reshape(3, 12).copy()
    for op in ops:
        try:
            if op == "get":
                tree.get(key)
            elif op == "insert":
                tree.insert(key, b"abc")
            elif op == "remove":
                tree.remove(key)
            elif op == "scan":
                tree.scan_prefix(key[:2])
            elif op == "count":
                tree.count_prefix(key[:1])
            elif op == "remove_prefix":
                tree.remove_prefix(key[:3])
            elif op == "items":
                list(tree.items(key[:1]))
            elif op == "verify":
                tree.verify()
            elif op == "batch":
                tree.get_batch(keys)
                tree.insert_batch(keys, np.zeros((3, 3), dtype=np.uint8))
            else:
                tree.scan_prefix_batch(keys[:, :1])
        except ValueError:
            pass


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", [ArtTree, ArtReference])
def test_bad_single_key_input(impl) -> None:
    t = impl(4)
    t.insert(b"abcd", b"1234")
    for bad, exc, match in [
        ("abcd", TypeError, "key must be bytes, got str"),
        (bytearray(b"abcd"), TypeError, "got bytearray"),
        (None, TypeError, "got NoneType"),
        (b"", ValueError, "key length must be in 1..255 bytes, got 0"),
        (b"x" * 256, ValueError, "got 256"),
    ]:
        for call in (lambda: t.insert(bad, b"1234"), lambda: t.get(bad), lambda: t.remove(bad),
                     lambda: bad in t):
            with pytest.raises(exc, match=match):
                call()
    with pytest.raises(ValueError, match="value must be exactly 4 bytes, got 3"):
        t.insert(b"zz", b"123")
    with pytest.raises(TypeError, match="value must be bytes, got memoryview"):
        t.insert(b"zz", memoryview(b"1234"))
    with pytest.raises(ValueError, match="key of length 2 conflicts with an existing key of length 4"):
        t.insert(b"ab", b"1234")
    with pytest.raises(ValueError, match="key of length 6 conflicts with an existing key of length 4"):
        t.insert(b"abcdef", b"1234")
    with pytest.raises(ValueError, match="prefix length must be in 0..255 bytes, got 256"):
        t.scan_prefix(b"p" * 256)
    with pytest.raises(TypeError, match="prefix must be bytes"):
        t.count_prefix("ab")
    with pytest.raises(ValueError, match="limit=-1 must be in \\[0,"):
        t.scan_prefix(b"a", -1)
    with pytest.raises(TypeError, match="limit must be an integer, got float"):
        t.scan_prefix(b"a", 1.5)
    with pytest.raises(TypeError, match="start must be bytes"):
        t.items("a")
    assert list(t.items()) == [(b"abcd", b"1234")]


def test_bad_constructor_arguments() -> None:
    for vs, exc in ((-1, ValueError), (256, ValueError), ("4", TypeError), (True, TypeError)):
        with pytest.raises(exc, match="value_size"):
            ArtTree(vs)
    with pytest.raises(ValueError, match="initial_arena_bytes=8 must be in \\[64,"):
        ArtTree(4, initial_arena_bytes=8)
    with pytest.raises(TypeError):
        ArtTree(4, 1 << 20)  # type: ignore[misc]  # keyword-only


@pytest.mark.parametrize("impl", [ArtTree, ArtReference])
def test_bad_batch_input(impl) -> None:
    t = impl(2)
    ok_keys = np.zeros((3, 5), dtype=np.uint8)
    ok_keys[:, 4] = [1, 2, 3]
    ok_vals = np.zeros((3, 2), dtype=np.uint8)
    cases = [
        (lambda: t.insert_batch(ok_keys.tolist(), ok_vals), TypeError, "keys must be a numpy.ndarray"),
        (lambda: t.insert_batch(ok_keys.astype(np.int64), ok_vals), ValueError, "dtype uint8, got int64"),
        (lambda: t.insert_batch(ok_keys[0], ok_vals), ValueError, "must be 2-D"),
        (lambda: t.insert_batch(np.asfortranarray(np.zeros((3, 5), np.uint8)), ok_vals), ValueError, "C-contiguous"),
        (lambda: t.insert_batch(ok_keys[:, :0], ok_vals), ValueError, "keys rows must be 1..255 bytes wide, got 0"),
        (lambda: t.insert_batch(np.zeros((1, 256), np.uint8), ok_vals[:1]), ValueError, "got 256"),
        (lambda: t.insert_batch(ok_keys, ok_vals[:2]), ValueError, "values must have 3 rows"),
        (lambda: t.insert_batch(ok_keys, np.zeros((3, 3), np.uint8)), ValueError, "values rows must be 2..2"),
        (lambda: t.get_batch(ok_keys.astype(np.int8)), ValueError, "dtype uint8"),
        (lambda: t.scan_prefix_batch(np.zeros((2, 256), np.uint8)), ValueError, "prefixes rows"),
        (lambda: t.scan_prefix_batch(ok_keys, key_len=0), ValueError, "key_len=0 must be in \\[1, 255\\]"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    assert len(t) == 0
    conflicting = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 1, 2], [1, 1, 1, 1, 1]], dtype=np.uint8)
    assert t.insert_batch(conflicting, ok_vals) == 2
    prefix_keys = np.array([[1, 1, 1]], dtype=np.uint8)
    with pytest.raises(ValueError, match="row 0: key of length 3 conflicts with an existing key of length 5"):
        t.insert_batch(prefix_keys, ok_vals[:1])


@pytest.mark.parametrize("impl", [ArtTree, ArtReference])
def test_batches_and_csr_scan(impl) -> None:
    t = impl(3)
    keys = np.array([[h, r, 0] for h in (5, 9, 7) for r in range(h)], dtype=np.uint8)
    vals = np.arange(len(keys) * 3, dtype=np.uint8).reshape(-1, 3)
    assert t.insert_batch(keys, vals) == len(keys)
    assert t.insert_batch(keys[:4], vals[:4]) == 0  # replacements
    found, got = t.get_batch(np.array([[9, 0, 0], [9, 9, 0], [7, 6, 0]], dtype=np.uint8))
    assert found.tolist() == [True, False, True]
    assert got[1].tolist() == [0, 0, 0] and got[0].tolist() == vals[5].tolist()
    k, v, off = t.scan_prefix_batch(np.array([[9], [8], [5], [7]], dtype=np.uint8))
    assert off.tolist() == [0, 9, 9, 14, 21]
    assert k[:9, 0].tolist() == [9] * 9 and k[:9, 1].tolist() == list(range(9))
    assert k.shape == (21, 3) and v.shape == (21, 3)
    k, v, off = t.scan_prefix_batch(np.zeros((2, 0), dtype=np.uint8))
    assert off.tolist() == [0, 21, 42]
    t.insert(b"\x01\x02", b"abc")
    with pytest.raises(ValueError, match="one length"):
        t.scan_prefix_batch(np.zeros((1, 0), dtype=np.uint8))
    k, v, off = t.scan_prefix_batch(np.array([[1]], dtype=np.uint8), key_len=2)
    assert k.tolist() == [[1, 2]] and v.tolist() == [[97, 98, 99]]
    k, v, off = t.scan_prefix_batch(np.zeros((0, 4), dtype=np.uint8))
    assert k.shape == (0, 4) and off.tolist() == [0]


def test_value_size_zero_key_only_index() -> None:
    t = ArtTree(0)
    assert t.insert(b"k1", b"") and not t.insert(b"k1", b"")
    assert t.get(b"k1") == b"" and t.get(b"k2") is None
    found, vals = t.get_batch(np.array([[107, 49]], dtype=np.uint8))
    assert found.tolist() == [True] and vals.shape == (1, 0)
    assert t.scan_prefix(b"k") == [(b"k1", b"")]


def test_smoke_microbench_sized_workload_matches_reference() -> None:
    """A few thousand hash-like 16-byte keys (the residency-index shape) through every path."""
    rng = np.random.default_rng(5)
    hashes = rng.integers(0, 256, size=(1500, 8), dtype=np.uint8)
    reps = rng.integers(1, 6, size=1500)
    rows = [np.concatenate([h, [0, 0, 0, r, r % 3, 0, 0, 0]]) for h, n in zip(hashes, reps) for r in range(n)]
    keys = np.unique(np.array(rows, dtype=np.uint8), axis=0)
    keys = keys[rng.permutation(len(keys))]
    vals = rng.integers(0, 256, size=(len(keys), 32), dtype=np.uint8)
    tree, ref = ArtTree(32), ArtReference(32)
    assert tree.insert_batch(keys, vals) == ref.insert_batch(keys, vals)
    probe = np.ascontiguousarray(hashes[rng.integers(0, 1500, size=400)])
    a, b = tree.scan_prefix_batch(probe), ref.scan_prefix_batch(probe)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    fa, va = tree.get_batch(keys[:500])
    assert fa.all() and np.array_equal(va, vals[:500])
    tree.verify()


def test_mutation_from_a_gc_callback_during_a_scan_is_refused() -> None:
    """Building scan results allocates Python objects, which can run arbitrary code (gc
    callbacks, finalizers); mutating the tree from there must be refused, not corrupt memory."""
    tree = ArtTree(1)
    keys = [i.to_bytes(2, "big") for i in range(6000)]  # > tuple free list: real gc allocations
    for k in keys:
        tree.insert(k, b"v")
    attempts: list[str] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            try:
                tree.insert(b"\xff\xff\xff", b"x")
                attempts.append("inserted")
            except RuntimeError:
                attempts.append("refused")

    threshold = gc.get_threshold()
    gc.callbacks.append(callback)
    gc.set_threshold(1)
    try:
        out = tree.scan_prefix(b"")
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(callback)
    assert "refused" in attempts
    assert [k for k, _ in out] == keys
    tree.verify()


def test_private_core_validates_too() -> None:
    core = _art.ArtCore()  # value_size 0, small arena
    with pytest.raises(TypeError):
        core.insert(None, b"")
    with pytest.raises(ValueError, match="key length"):
        core.insert(b"", b"")
    with pytest.raises(ValueError, match="value must be exactly 0 bytes"):
        core.insert(b"a", b"x")
    with pytest.raises(ValueError):
        core.scan_prefix_batch(np.zeros((2, 3), np.int64))
    with pytest.raises(ValueError, match="key length"):
        core.get_batch(np.zeros((2, 0), np.uint8))
    with pytest.raises(ValueError, match="value_size"):
        _art.ArtCore(300)
    core.insert(b"a", b"")
    with pytest.raises(RuntimeError, match="fresh"):
        core._attach(b"QUILLART" + bytes(56), 0, {})


# -- lazy per-chunk checksums -------------------------------------------------------------------


@settings(deadline=None)
@given(length=st.one_of(st.integers(0, 64), st.integers(0, 3 * 8192 + 3 * 256 + 64), st.integers(49000, 70000)),
       align=st.integers(0, 7), seed=st.integers(0, 2**32 - 1))
def test_crc32c_equals_the_crc32c_package(length: int, align: int, seed: int) -> None:
    raw = np.random.default_rng(seed).integers(0, 256, size=length + 8, dtype=np.uint8).tobytes()
    data = memoryview(raw)[align: align + length]
    want = crc32c.crc32c(data)
    assert _art._crc32c(data) == want
    assert _art._crc32c(data, "portable") == want
    if _art.CRC32C_HW:
        assert _art._crc32c(data, "sse42") == want


def test_crc32c_impl_choice_is_validated() -> None:
    assert _art._crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    with pytest.raises(ValueError, match="impl must be"):
        _art._crc32c(b"x", "fast")
    with pytest.raises(TypeError):
        _art._crc32c("not a buffer")


def _lazy(raw: object, tree_meta: ArenaMeta, root: int, crcs: np.ndarray, chunk_bytes: int = 4096) -> ArtTree:
    return ArtTree.attach(raw, root, tree_meta, chunk_crcs=crcs, chunk_bytes=chunk_bytes)


def _export(tree: ArtTree) -> tuple[bytes, ArenaMeta, int]:
    with tree.arena_view() as view:
        return bytes(view), tree.export_meta(), tree.root_offset


def _big_tree(n: int = 6000, value_size: int = 3, seed: int = 3) -> tuple[ArtTree, ArtReference]:
    """A few hundred KiB of arena (many 4 KiB chunks) with free-list blocks of several sizes."""
    rng = np.random.default_rng(seed)
    tree, ref = ArtTree(value_size, initial_arena_bytes=4096), ArtReference(value_size)
    keys = rng.integers(0, 6, size=(n, 10), dtype=np.uint8)
    keys[: n // 3, 1:4] = 5  # six shared prefixes fanning out at byte 4: Node48/Node256
    keys[: n // 3, 4] = rng.integers(0, 256, size=n // 3)
    keys[n // 3: n // 3 + n // 12, 1:4] = 4  # ... and six more with ~30 children: Node48
    keys[n // 3: n // 3 + n // 12, 4] = rng.integers(0, 30, size=n // 12)
    keys = np.unique(keys, axis=0)[rng.permutation(len(np.unique(keys, axis=0)))]
    values = rng.integers(0, 256, size=(len(keys), value_size), dtype=np.uint8)
    tree.insert_batch(keys, values)
    ref.insert_batch(keys, values)
    for k in list(ref._data)[::7]:
        tree.remove(k)
        ref.remove(k)
    return tree, ref


def test_chunk_crcs_is_crc32c_of_each_chunk() -> None:
    tree, _ = _sample_tree(300)
    raw, _, _ = _export(tree)
    for cb in (4096, 8192, 1 << 24):
        crcs = tree.chunk_crcs(cb)
        assert crcs.dtype == np.uint32 and crcs.shape == (-(-len(raw) // cb),)
        assert crcs.tolist() == [crc32c.crc32c(raw[i: i + cb]) for i in range(0, len(raw), cb)]
    with pytest.raises(ValueError, match="power of two"):
        tree.chunk_crcs(5000)


def test_lazy_attach_round_trip_verifies_as_it_goes(tmp_path) -> None:
    tree, ref = _big_tree()
    raw, meta, root = _export(tree)
    crcs = tree.chunk_crcs(4096)
    total = len(crcs)
    assert total > 40
    path = tmp_path / "arena.bin"
    path.write_bytes(raw)
    with open(path, "rb") as fh:  # the checkpoint shape: a copy-on-write file mapping
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    lazy = _lazy(mm, meta, root, crcs)
    assert lazy.stats()["chunks_total"] == total and lazy.stats()["chunks_verified"] == 0
    assert not lazy._chunk_bitmap().any()
    key = next(k for k in ref._data if k[1] < 4)  # outside the wide fan-outs
    assert lazy.get(key) == ref.get(key)
    touched = lazy._chunk_bitmap()
    assert touched[0] and 1 < touched.sum() < 12  # header chunk + the path to one leaf
    assert lazy.stats()["chunks_verified"] == touched.sum()
    assert lazy.get(key) == ref.get(key) and (lazy._chunk_bitmap() == touched).all()  # never re-checked
    assert lazy.scan_prefix(key[:5]) == ref.scan_prefix(key[:5])
    assert lazy.count_prefix(key[:4]) == ref.count_prefix(key[:4])
    assert lazy.stats()["chunks_verified"] < total
    keys = np.frombuffer(b"".join(list(ref._data)[:10]), dtype=np.uint8).reshape(10, 10).copy()
    assert all(np.array_equal(x, y) for x, y in zip(lazy.get_batch(keys), ref.get_batch(keys)))
    # mutations work and are applied in place in the private mapping; verified bits survive
    rng = np.random.default_rng(9)
    for k in rng.choice(sorted(ref._data), size=3, replace=False).tolist():
        assert lazy.remove(k) == ref.remove(k)
    new = np.unique(rng.integers(6, 9, size=(50, 10), dtype=np.uint8), axis=0)
    vals = np.zeros((len(new), 3), dtype=np.uint8)
    assert lazy.insert_batch(new, vals) == ref.insert_batch(new, vals)
    assert lazy.remove_prefix(key[:3]) == ref.remove_prefix(key[:3])  # frees a whole subtree
    before = lazy.stats()["chunks_verified"]
    assert 0 < before < total
    assert lazy.verify_all_chunks() == total - before
    assert lazy.stats()["chunks_verified"] == total and lazy.verify_all_chunks() == 0
    assert list(lazy.items(key[:1])) == list(ref.items(key[:1]))
    # grow far beyond the mapping: the arena moves to owned memory, same offsets, same table
    for i in range(3000):
        k = bytes([9, i % 256, i // 256]) + bytes(7)
        lazy.insert(k, b"xyz")
        ref.insert(k, b"xyz")
    assert lazy.owns_arena and list(lazy.items()) == list(ref.items())
    lazy.verify()
    assert lazy.stats()["chunks_total"] == total


def test_lazy_tree_copied_on_first_write_keeps_the_table() -> None:
    tree, ref = _big_tree(2000)
    raw, meta, root = _export(tree)
    lazy = _lazy(raw, meta, root, tree.chunk_crcs(8192), 8192)  # read-only bytes
    key = sorted(ref._data)[len(ref) // 2]
    assert lazy.insert(key, b"new") is False and ref.insert(key, b"new") is False
    assert lazy.owns_arena and 0 < lazy.stats()["chunks_verified"] < lazy.stats()["chunks_total"]
    assert list(lazy.items()) == list(ref.items())
    lazy.verify()
    # the exported copy of a lazy tree is verified first and re-attaches with a fresh table
    again = _lazy(lazy.arena_view(), lazy.export_meta(), lazy.root_offset, lazy.chunk_crcs(4096))
    assert list(again.items()) == list(ref.items())


def test_remove_all_discards_the_table() -> None:
    tree, ref = _big_tree(1500)
    raw, meta, root = _export(tree)
    lazy = _lazy(bytearray(raw), meta, root, tree.chunk_crcs(4096))
    assert lazy.remove_prefix(b"") == len(ref)
    assert lazy.stats()["chunks_total"] == 0 and lazy.verify_all_chunks() == 0
    for k in list(ref._data)[:200]:  # new objects reuse the old bytes: nothing to verify
        lazy.insert(k, b"abc")
    assert len(lazy) == 200
    lazy.verify()


def test_attach_without_table_is_unchanged() -> None:
    tree, ref = _sample_tree(200)
    raw, meta, root = _export(tree)
    plain = ArtTree.attach(raw, root, meta)
    s = plain.stats()
    assert (s["chunks_total"], s["chunks_verified"]) == (0, 0) and plain.verify_all_chunks() == 0
    assert list(plain.items()) == list(ref.items())
    assert ArtTree(4).stats()["chunks_total"] == 0
    # without a table a damaged value byte is simply returned: the table is what catches it
    key = next(iter(ref._data))
    leaf_value = raw.index(key + ref._data[key]) + len(key)
    damaged = bytearray(raw)
    damaged[leaf_value] ^= 0xFF
    assert ArtTree.attach(bytes(damaged), root, meta).get(key) != ref.get(key)
    lazy = _lazy(bytes(damaged), meta, root, tree.chunk_crcs(4096))
    with pytest.raises(ValueError, match=r"corrupt arena: chunk 0 \(bytes 0\.\.4095\) checksum mismatch"):
        lazy.get(key)


def test_bad_chunk_tables_are_refused() -> None:
    tree, _ = _sample_tree(300)
    raw, meta, root = _export(tree)
    crcs = tree.chunk_crcs(4096)
    n = len(crcs)

    def err(exc, match, table=crcs, cb=4096):
        with pytest.raises(exc, match=match):
            ArtTree.attach(raw, root, meta, chunk_crcs=table, chunk_bytes=cb)

    err(ValueError, f"chunk_crcs has {n + 1} entries but arena_used_bytes {len(raw)} in chunks of 4096 bytes needs {n}",
        np.append(crcs, np.uint32(0)))
    err(ValueError, f"has {n - 1} entries", crcs[:-1])
    err(ValueError, "needs 1", crcs, 1 << 20)
    err(ValueError, "dtype uint32 .*got int64", crcs.astype(np.int64))
    err(ValueError, "dtype uint32 .*got uint64", crcs.astype(np.uint64))
    err(ValueError, "dtype uint32 .*got >u4", crcs.astype(">u4"))
    err(ValueError, "must be 1-D", crcs.reshape(1, n))
    err(ValueError, "contiguous", np.repeat(crcs, 2)[::2])
    err(TypeError, "numpy.ndarray of uint32, got list", crcs.tolist())
    err(ValueError, "chunk_bytes must be a power of two in 4096..16777216, got 5000", cb=5000)
    err(ValueError, "chunk_bytes=2048 must be in \\[4096, 16777216\\]", cb=2048)
    err(ValueError, "chunk_bytes=33554432 must be in", cb=1 << 25)
    err(TypeError, "chunk_bytes must be an integer, got bool", cb=True)
    err(TypeError, "chunk_bytes must be an integer, got str", cb="4096")
    # the compiled core checks what memory safety depends on by itself
    core = _art.ArtCore(4)
    with pytest.raises(ValueError, match="needs"):
        core._attach(raw, root, meta, crcs[:-1], 4096)
    with pytest.raises(ValueError, match="power of two"):
        _art.ArtCore(4)._attach(raw, root, meta, crcs, 4097)
    with pytest.raises(ValueError):
        _art.ArtCore(4)._attach(raw, root, meta, crcs.astype(np.int64), 4096)
    ok = _art.ArtCore(4)._attach(raw, root, meta, crcs, 4096)
    assert ok.stats()["chunks_total"] == n


def test_lazy_header_is_checked_before_the_first_operation() -> None:
    tree, ref = _sample_tree(100)
    raw, meta, root = _export(tree)
    bad = bytearray(raw)
    bad[0:8] = b"NOTANART"
    table = np.array([crc32c.crc32c(bytes(bad[i: i + 4096])) for i in range(0, len(bad), 4096)], dtype=np.uint32)
    lazy = _lazy(bytes(bad), meta, root, table)  # the checksums match: only the header check can tell
    for call in (lambda: lazy.get(next(iter(ref._data))), lambda: lazy.count_prefix(b""), lazy.verify_all_chunks):
        with pytest.raises(ValueError, match="corrupt arena: the header .* arena magic"):
            call()
    with pytest.raises(ValueError, match="value_size 2 does not match the arena header's 4"):
        _lazy(raw, dataclasses.replace(meta, value_size=2), root, tree.chunk_crcs(4096)).get(b"x")
    # the root is only range-checked at attach (its bytes are read when first used)
    with pytest.raises(ValueError, match="root_offset"):
        _lazy(raw, meta, len(raw) + 8, tree.chunk_crcs(4096))
    with pytest.raises(ValueError, match="root_offset"):
        _lazy(raw, meta, 12, tree.chunk_crcs(4096))


# One tree for the corruption property: ~40 chunks of 4 KiB, free lists of every leaf/node size.
_LAZY_TREE, _LAZY_REF = _big_tree(4000, value_size=3, seed=8)
_LAZY_RAW, _LAZY_META, _LAZY_ROOT = _export(_LAZY_TREE)
_LAZY_CRCS = _LAZY_TREE.chunk_crcs(4096)
_LAZY_KEYS = sorted(_LAZY_REF._data)
_SPREAD = 1_000_003  # a prime: p -> p * _SPREAD % len is a bijection that spreads Hypothesis's small draws
assert math.gcd(_SPREAD, len(_LAZY_RAW)) == 1
_LAZY_OPS = ["get", "get_absent", "contains", "insert", "replace", "remove", "remove_absent", "scan",
             "count", "remove_prefix", "items", "get_batch", "insert_batch", "scan_batch", "verify",
             "arena_view", "chunk_crcs"]


def _run_op(tree: ArtTree, op: str, key: bytes, other: bytes, limit: int | None) -> object:
    keys = np.frombuffer(key + other, dtype=np.uint8).reshape(2, 10).copy()
    if op in ("get", "get_absent"):
        return tree.get(key if op == "get" else other)
    if op == "contains":
        return key in tree
    if op == "insert":
        return tree.insert(other, b"new")
    if op == "replace":
        return tree.insert(key, b"rep")
    if op in ("remove", "remove_absent"):
        return tree.remove(key if op == "remove" else other)
    if op == "scan":
        return tree.scan_prefix(key[: len(key) // 2], limit)
    if op == "count":
        return tree.count_prefix(key[:2])
    if op == "remove_prefix":
        return tree.remove_prefix(key[:4])
    if op == "items":
        return list(tree.items(key))[:50]
    if op == "get_batch":
        return tree.get_batch(keys)
    if op == "insert_batch":
        return tree.insert_batch(keys, np.zeros((2, 3), dtype=np.uint8))
    if op == "scan_batch":
        return tree.scan_prefix_batch(np.ascontiguousarray(keys[:, :3]))
    if op == "verify":
        return tree.verify()
    if op == "arena_view":
        with tree.arena_view() as view:
            return bytes(view)
    return tree.chunk_crcs(4096)


@settings(deadline=None)
@given(pos=st.integers(0, len(_LAZY_RAW) - 1), xor=st.integers(1, 255),
       ops=st.lists(st.sampled_from(_LAZY_OPS), min_size=1, max_size=4),
       key=st.sampled_from(_LAZY_KEYS), other=st.binary(min_size=10, max_size=10).map(lambda b: b"\x07" + b[1:]),
       limit=st.one_of(st.none(), st.integers(0, 3)))
def test_flipped_byte_is_caught_by_the_first_operation_that_touches_its_chunk(pos, xor, ops, key, other, limit) -> None:
    """Same operations on a clean and a one-byte-damaged lazily attached copy: until an operation
    touches the damaged chunk (as seen on the clean copy) both agree; that operation raises the
    checksum error and changes nothing; every later operation raises too."""
    pos = pos * _SPREAD % len(_LAZY_RAW)
    bad_chunk = pos // 4096
    event(f"damaged chunk {'0 (header)' if bad_chunk == 0 else 'after 0'}")
    message = (f"corrupt arena: chunk {bad_chunk} (bytes {bad_chunk * 4096}.."
               f"{min(bad_chunk * 4096 + 4096, len(_LAZY_RAW)) - 1}) checksum mismatch")
    clean = _lazy(_LAZY_RAW, _LAZY_META, _LAZY_ROOT, _LAZY_CRCS)
    buf = bytearray(_LAZY_RAW) + bytearray(1 << 16)  # writable with slack: mutated in place
    buf[pos] ^= xor
    bad = _lazy(buf, _LAZY_META, _LAZY_ROOT, _LAZY_CRCS)  # O(1): reads nothing, so it succeeds
    caught = False
    for op in ops:
        if caught:
            with pytest.raises(ValueError, match=re.escape(message)):
                _run_op(bad, op, key, other, limit)
            continue
        want = outcome(_run_op, clean, op, key, other, limit)
        touched = bool(clean._chunk_bitmap()[bad_chunk]) or op in ("arena_view", "chunk_crcs")
        snapshot, meta = bytes(buf), bad.export_meta()
        got = outcome(_run_op, bad, op, key, other, limit)
        event(f"{op}: {'touches the damaged chunk' if touched else 'does not touch it'}")
        if touched:  # (a batch names its failing row first)
            assert got[:2] == ("err", ValueError) and got[2].endswith(message), (op, got)
            assert bytes(buf) == snapshot and bad.export_meta() == meta  # nothing was modified
            caught = True
        else:
            assert got == want, (op, got, want)
            assert not bad._chunk_bitmap()[bad_chunk]
    if not caught:
        with pytest.raises(ValueError, match=re.escape(message)):
            bad.verify_all_chunks()
    with pytest.raises(ValueError, match=re.escape(message)):
        bad.get(key)
    assert len(bad) >= 0 and bad.stats()["chunks_total"] == len(_LAZY_CRCS)


def _mutations() -> list[tuple[str, bytes, bytes]]:
    """(kind, argument, a key the operation's read-only descent also reaches)."""
    rng = np.random.default_rng(4)
    keys = _LAZY_KEYS
    out = []
    for k in keys:  # every removal (the few that shrink or merge are the interesting ones)
        out.append(("remove", k, k))
    for i in rng.choice(len(keys), size=60, replace=False).tolist():  # splits and node growth
        k = bytearray(keys[i])
        k[int(rng.integers(3, 10))] ^= 0x80
        out.append(("insert", bytes(k), bytes(k)))
    for i in rng.choice(len(keys), size=30, replace=False).tolist():  # whole-subtree removals
        out.append(("remove_prefix", keys[i][: int(rng.integers(2, 5))], keys[i]))
    return out


def _apply(tree: ArtTree, kind: str, arg: bytes) -> object:
    if kind == "remove":
        return tree.remove(arg)
    if kind == "insert":
        return tree.insert(arg, b"new")
    return tree.remove_prefix(arg)


def test_mutation_fails_before_its_first_write() -> None:
    """Chunks a mutation needs beyond its descent (free blocks it pops, the child a Node4 merges
    into, the subtree remove_prefix frees) are verified before anything is written: damage in
    any of them fails the operation with the arena bytes and counters exactly as they were."""
    kinds_hit: dict[str, int] = {}
    for kind, arg, probe_key in _mutations():
        if kinds_hit.get(kind, 0) >= 40:
            continue
        seen = _lazy(_LAZY_RAW, _LAZY_META, _LAZY_ROOT, _LAZY_CRCS)
        seen.get(probe_key)
        descent = seen._chunk_bitmap()
        done = _lazy(_LAZY_RAW, _LAZY_META, _LAZY_ROOT, _LAZY_CRCS)
        try:
            _apply(done, kind, arg)
        except ValueError:
            continue  # e.g. a prefix conflict
        extra = np.flatnonzero(done._chunk_bitmap() & ~descent)
        for chunk in extra.tolist():
            buf = bytearray(_LAZY_RAW) + bytearray(1 << 16)
            buf[chunk * 4096 + 4091 if chunk * 4096 + 4091 < len(_LAZY_RAW) else len(_LAZY_RAW) - 1] ^= 0x10
            bad = _lazy(buf, _LAZY_META, _LAZY_ROOT, _LAZY_CRCS)
            bad.get(probe_key)  # the descent is verified and clean
            snapshot, meta = bytes(buf), bad.export_meta()
            with pytest.raises(ValueError, match=f"corrupt arena: chunk {chunk} "):
                _apply(bad, kind, arg)
            assert bytes(buf) == snapshot and bad.export_meta() == meta, (kind, arg, chunk)
            kinds_hit[kind] = kinds_hit.get(kind, 0) + 1
    assert set(kinds_hit) == {"remove", "insert", "remove_prefix"}, kinds_hit

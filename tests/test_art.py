"""ArtTree (Cython, arena) against ArtReference (dict + sorted list): same operations, same answers.

The stateful test drives both with inserts/replaces, removes, gets, prefix scans/counts/removals,
ordered iteration from random start keys, batch calls and export -> bytes -> attach round trips,
and checks after every step that they agree and that ``verify()`` (full structural walk) passes.
Keys come from fixed-length families over a tiny alphabet (lots of shared prefixes, compressed
paths longer than the 16 stored prefix bytes) plus wide fan-out batches, so nodes grow and
shrink through Node4/16/48/256.
"""

from __future__ import annotations

import gc
import mmap

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from quillcache._fast import _art
from quillcache.art import ArtReference, ArtTree

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

    @rule(mode=st.sampled_from(["bytes", "bytearray_slack", "arena_view", "misaligned", "mmap_copy"]))
    def export_and_attach(self, mode: str) -> None:
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
        new = ArtTree.attach(buf, root, meta)
        assert new.export_meta() == meta and new.root_offset == root and len(new) == len(self.ref)
        with new.arena_view() as view:
            assert bytes(view) == raw
        self.tree = new

    @invariant()
    def agree(self) -> None:
        if not hasattr(self, "tree"):
            return
        assert len(self.tree) == len(self.ref)
        stats = self.tree.verify()
        assert stats["leaves"] == len(self.ref)
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
    assert all(type(v) is int for v in meta.values())
    with tree.arena_view() as view:
        raw = bytes(view)
    assert len(raw) == tree.arena_used_bytes == meta["arena_used_bytes"]
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


def test_attach_rejects_bad_buffers_and_meta() -> None:
    tree, _ = _sample_tree(80)
    meta, root = tree.export_meta(), tree.root_offset
    with tree.arena_view() as view:
        raw = bytes(view)

    def err(exc, match, buf=raw, r=root, **changes):
        m = {**meta, **changes}
        for k, v in list(m.items()):
            if v is None:
                del m[k]
        with pytest.raises(exc, match=match):
            ArtTree.attach(buf, r, m)

    err(ValueError, "smaller than arena_used_bytes", buf=raw[:100])
    err(ValueError, "smaller than the 64-byte arena header", buf=b"QUILL", arena_used_bytes=0)
    err(ValueError, "magic", buf=b"X" + raw[1:])
    err(ValueError, "missing num_leaves", num_leaves=None)
    err(ValueError, "unknown meta entry 'bogus'", bogus=1)
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
    err(ValueError, "free-list head", free_head_64=len(raw))
    err(ValueError, "free-list head", free_head_64=68)
    err(ValueError, "size class 12", free_head_12=64)
    err(ValueError, "size class 9999999999999999999999", free_head_9999999999999999999999=64)
    err(TypeError, "buffer protocol", buf=12345)
    with pytest.raises(TypeError, match="mapping"):
        ArtTree.attach(raw, root, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="C-contiguous"):
        ArtTree.attach(memoryview(bytearray(raw * 2))[::2], root, meta)


def test_attach_rejects_mapping_type_error_message() -> None:
    with pytest.raises(TypeError, match="meta must be a mapping"):
        ArtTree.attach(b"", 0, None)  # type: ignore[arg-type]


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
    meta = dict(_CORRUPT_META)
    if head is not None:
        meta["free_head_64"] = head * 8
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
    with pytest.raises(ValueError, match="limit must be in 0"):
        t.scan_prefix(b"a", -1)
    with pytest.raises(TypeError, match="limit must be an int, got float"):
        t.scan_prefix(b"a", 1.5)
    with pytest.raises(TypeError, match="start must be bytes"):
        t.items("a")
    assert list(t.items()) == [(b"abcd", b"1234")]


def test_bad_constructor_arguments() -> None:
    for vs, exc in ((-1, ValueError), (256, ValueError), ("4", TypeError), (True, TypeError)):
        with pytest.raises(exc, match="value_size"):
            ArtTree(vs)
    with pytest.raises(ValueError, match="initial_arena_bytes must be in 64"):
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
        (lambda: t.scan_prefix_batch(ok_keys, key_len=0), ValueError, "key_len must be in 1..255"),
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

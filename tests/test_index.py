"""Residency index: every backend agrees with a dict+sorted reference, across close/reopen."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from quillcache.index import (
    INDEX_BACKENDS,
    IndexClosedError,
    IndexKeyError,
    NotAnIndexError,
    ReplicaKey,
    ResidencyEntry,
    open_index,
)
from quillcache.index.base import iter_raw
from quillcache.types import CacheTier

PERSISTENT_KINDS = sorted(INDEX_BACKENDS)

hashes = st.sampled_from([0, 1, 2, 2**63, 2**64 - 1, 0xDEADBEEF])
nodes = st.sampled_from(["n0", "n1", "node-10", "ünï"])
tiers = st.sampled_from(list(CacheTier))
identities = st.sampled_from([bytes(16), b"\x01" * 16, b"\xff" * 16])
entries = st.builds(
    ResidencyEntry,
    block_hash=hashes,
    node=nodes,
    tier=tiers,
    identity=identities,
    segment_id=st.integers(0, 2**32 - 1),
    offset_bytes=st.integers(0, 2**64 - 1),
    size_bytes=st.integers(0, 2**32 - 1),
)


class Reference:
    """The specification: a dict keyed by replica, answers sorted like the key layout."""

    def __init__(self) -> None:
        self.d: dict[ReplicaKey, ResidencyEntry] = {}
        self.node_order: dict[str, int] = {}

    def put(self, es):
        for e in es:
            self.node_order.setdefault(e.node, len(self.node_order) + 1)
            self.d[e.key] = e

    def remove(self, ks):
        for k in ks:
            self.d.pop(ReplicaKey(k.block_hash, k.node, k.tier, k.identity), None)

    def _order(self, e):
        return (e.block_hash, self.node_order[e.node], e.identity, int(e.tier))

    def locate(self, hs):
        return [sorted((e for e in self.d.values() if e.block_hash == h), key=self._order) for h in hs]

    def on_node(self, node):
        return sorted((e for e in self.d.values() if e.node == node), key=self._order)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="qc-index-"))
        self.ref = Reference()
        self.ixs = {}

    @initialize()
    def open_all(self):
        for kind in PERSISTENT_KINDS:
            self.ixs[kind] = open_index(kind, self.dir / kind)

    @rule(es=st.lists(entries, min_size=1, max_size=6))
    def put(self, es):
        self.ref.put(es)
        for ix in self.ixs.values():
            assert ix.put(es) == len(es)

    @rule(es=st.lists(entries, max_size=4))
    def remove(self, es):
        keys = [e.key for e in es]
        self.ref.remove(keys)
        for ix in self.ixs.values():
            ix.remove(keys)

    @rule(hs=st.lists(hashes, max_size=4))
    def locate(self, hs):
        want = self.ref.locate(hs)
        for kind, ix in self.ixs.items():
            assert ix.locate(hs) == want, kind
            for h, w in zip(hs, want):
                assert [ix._entry(k, v) for k, v in iter_raw(ix.locate_raw(h))] == w, kind
            arr = ix.locate_arrays(np.array(hs, dtype=np.uint64))
            assert [arr.count(j) for j in range(len(hs))] == [len(w) for w in want], kind
            flat = [e for w in want for e in w]
            assert [int(h) for h in arr.keys["block_hash"]] == [e.block_hash for e in flat], kind
            assert [ix.node_name(n) for n in arr.keys["node_no"]] == [e.node for e in flat], kind
            assert [bytes(i) for i in arr.keys["identity"]] == [e.identity for e in flat], kind
            assert [int(v) for v in arr.values["offset_bytes"]] == [e.offset_bytes for e in flat], kind

    @rule(node=nodes)
    def on_node(self, node):
        want = self.ref.on_node(node)
        for kind, ix in self.ixs.items():
            assert ix.entries_on_node(node) == want, kind

    @rule(node=nodes)
    def remove_node(self, node):
        gone = self.ref.on_node(node)
        self.ref.remove([e.key for e in gone])
        for kind, ix in self.ixs.items():
            assert ix.remove_node(node) == len(gone), kind

    @rule()
    def reopen(self):
        for kind, ix in list(self.ixs.items()):
            ix.close()
            self.ixs[kind] = open_index(kind, self.dir / kind)

    @rule()
    def flush(self):
        for ix in self.ixs.values():
            ix.flush()

    @invariant()
    def raw_scans_agree(self):
        if not self.ixs:
            return
        scans = {kind: ix.scan_prefix(b"B") for kind, ix in self.ixs.items()}
        first = next(iter(scans.values()))
        assert len(first) == len(self.ref.d)
        for kind, rows in scans.items():
            assert rows == first, kind
            assert len(self.ixs[kind]) == len(self.ref.d), kind  # len = replicas, in every backend

    def teardown(self):
        for ix in self.ixs.values():
            ix.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestIndexMachine = IndexMachine.TestCase
# Each example opens real RocksDB instances; bound the work so the file stays well under a minute.
TestIndexMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


@pytest.fixture(params=PERSISTENT_KINDS)
def index(request, tmp_path):
    ix = open_index(request.param, tmp_path / request.param)
    yield ix
    ix.close()


def entry(h=1, node="n0", tier=CacheTier.DRAM, ident=bytes(16), seg=0, off=0, size=64):
    return ResidencyEntry(h, node, tier, ident, seg, off, size)


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match=r"unknown index backend 'btree'.*registered"):
        open_index("btree")


@pytest.mark.parametrize(
    "bad, match",
    [
        (entry(h=-1), "block hash"),
        (entry(h=2**64), "block hash"),
        (entry(ident=b"short"), "identity"),
        (entry(tier=9), "tier"),
        (entry(seg=2**32), "segment_id"),
        (entry(size=-1), "size_bytes"),
        (entry(node=""), "node name"),
        (entry(node="a\x00b"), "node name"),
    ],
)
def test_bad_entries_are_refused_and_nothing_applied(index, bad, match):
    index.put([entry(h=7)])
    with pytest.raises(IndexKeyError, match=match):
        index.put([entry(h=8, node="fresh"), bad])
    assert [len(x) for x in index.locate([7, 8])] == [1, 0]
    assert "fresh" not in index.nodes()


def test_put_rejects_non_entries(index):
    with pytest.raises(TypeError, match="ResidencyEntry"):
        index.put([(1, 2)])


def test_prefix_scan_validates(index):
    with pytest.raises(TypeError):
        index.scan_prefix("B")
    with pytest.raises(IndexKeyError, match="longer than a key"):
        index.scan_prefix(b"x" * 31)


def test_closed_index_refuses(index):
    index.close()
    with pytest.raises(IndexClosedError):
        index.locate([1])


def test_locate_returns_every_replica_in_order(index):
    index.put([entry(h=5, node="b", tier=CacheTier.SSD), entry(h=5, node="a"), entry(h=6, node="a")])
    (got,) = index.locate([5])
    assert [(e.node, e.tier) for e in got] == [("b", CacheTier.SSD), ("a", CacheTier.DRAM)]  # node numbers: b=1, a=2


def test_len_is_the_replica_count_in_every_backend(index):
    assert len(index) == 0
    index.put([entry(h=h, node=n) for h in range(3) for n in ("n0", "n1")])
    assert len(index) == 6  # not the 12 primary+secondary records, nor the 2 node names
    index.remove([entry(h=0, node="n0").key])
    assert len(index) == 5
    index.close()
    with pytest.raises(IndexClosedError):
        len(index)


def test_locate_order_is_node_then_identity_then_tier(index):
    a, b = b"\x01" * 16, b"\x02" * 16
    index.put([entry(h=5, tier=CacheTier.GPU, ident=b), entry(h=5, tier=CacheTier.SSD, ident=a),
               entry(h=5, tier=CacheTier.DRAM, ident=a)])
    (got,) = index.locate([5])
    assert [(e.identity, e.tier) for e in got] == [(a, CacheTier.DRAM), (a, CacheTier.SSD), (b, CacheTier.GPU)]


def test_remove_counts_the_keys_on_known_nodes(index):
    index.put([entry(h=1)])
    assert index.remove([entry(h=1).key, entry(h=2).key, entry(h=1, node="never-seen").key]) == 2
    assert index.locate([1, 2]) == [[], []] and "never-seen" not in index.nodes()


@pytest.mark.parametrize("field, value", [("seg", 1.5), ("seg", "1"), ("off", 2.0), ("size", True),
                                          ("off", None)])
def test_entry_locations_must_be_integers_naming_the_field(index, field, value):
    name = {"seg": "segment_id", "off": "offset_bytes", "size": "size_bytes"}[field]
    with pytest.raises(IndexKeyError, match=f"{name} must be an integer"):
        index.put([entry(h=3, **{field: value})])
    assert index.locate([3]) == [[]]


@pytest.mark.parametrize("kind", PERSISTENT_KINDS)
def test_path_that_is_not_an_index(kind, tmp_path):
    (tmp_path / "junk.txt").write_text("hello")
    with pytest.raises(NotAnIndexError, match=str(tmp_path)):
        open_index(kind, tmp_path)


def test_corrupt_flat_snapshot_is_refused(tmp_path):
    ix = open_index("flat", tmp_path / "f")
    ix.put([entry()])
    ix.close()
    (tmp_path / "f" / "flat.snapshot").write_bytes(b"\x93garbage")
    with pytest.raises(NotAnIndexError, match="not a valid flat-index snapshot"):
        open_index("flat", tmp_path / "f")


@pytest.mark.parametrize("kind", ["flat", "sorted"])
@pytest.mark.parametrize("records, why", [
    (5, "records is a int"),
    ([[b"a", b"b", b"c"]], "record \\d+: expected a \\[key, value\\] pair"),
    ([[30, 16]], "record \\d+: expected a \\[key, value\\] pair"),
    ([[b"B" + bytes(28), bytes(16)]], "needs a 30-byte key"),
    ([[b"B" + bytes(29), None]], "record \\d+: expected"),
    ([[b"N" + bytes(29), bytes(16)]], "needs a 30-byte key and a 0-byte value"),
    ([[b"M" + b"n0", (1).to_bytes(4, "big")]], "malformed node-name record"),
    ([[b"M\xff\x00", (1).to_bytes(4, "big")]], "malformed node-name record"),
    ([[b"Z" + bytes(29), bytes(16)]], "unknown key family"),
])
def test_a_damaged_flat_snapshot_is_refused_naming_the_file_and_record(tmp_path, kind, records, why):
    import crc32c
    import msgpack

    from quillcache.index.flat import _HEAD, MAGIC, SNAPSHOT, VERSION

    ix = open_index(kind, tmp_path / "ix")
    ix.put([entry()])
    ix.close()
    good = tmp_path / "ix" / SNAPSHOT
    have = msgpack.unpackb(good.read_bytes()[_HEAD.size:], raw=False)
    # a checksum-valid snapshot whose records are malformed (as a writer bug would leave): refused all the same
    body = msgpack.packb(have + records if isinstance(records, list) else records, use_bin_type=True)
    good.write_bytes(_HEAD.pack(MAGIC, VERSION, 0, crc32c.crc32c(body), len(body)) + body)
    with pytest.raises(NotAnIndexError, match=why) as exc:
        open_index(kind, tmp_path / "ix")
    assert str(good) in str(exc.value)


@pytest.mark.parametrize("kind", sorted(INDEX_BACKENDS))
def test_a_regular_file_as_the_index_path_is_one_typed_refusal(tmp_path, kind):
    from quillcache.index import NotAnIndexError

    path = tmp_path / "not-an-index"
    path.write_bytes(b"someone else's data")
    with pytest.raises(NotAnIndexError, match=rf"is a file, not an index directory: .*{kind!r} index"):
        open_index(kind, str(path))
    assert path.read_bytes() == b"someone else's data"
